"""Test-wide setup: one thread (see cpu-toolchain notes on oversubscription), a repo-local
inductor cache, and the `slow` marker switch."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No GPU here or in CI: Triton kernels are checked on CPU tensors by its interpreter, which Triton
# reads at import time, so it is set before anything imports kernels.py.
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".cache", "inductor"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)


# The compile gate (tests/test_compile_gate.py) compiles every Triton kernel variant for two GPU
# targets: minutes of single-threaded ptxas on a cold cache. It starts in the background as soon as
# collection shows it will run, on the core the (single-threaded) suite leaves free, and its tests
# move to the end of the run, by which time it has usually finished.
def pytest_collection_modifyitems(config, items):
    gate = [item for item in items if item.nodeid.startswith("tests/test_compile_gate.py::test_every")
            or item.nodeid.startswith("tests/test_compile_gate.py::test_fp32")]
    if not gate:
        return
    items[:] = [item for item in items if item not in gate] + gate
    import subprocess
    import tempfile
    out = os.path.join(tempfile.mkdtemp(prefix="gate-"), "gate.json")
    env = dict(os.environ, TRITON_INTERPRET="0")
    config.specache_gate = dict(json=out, proc=subprocess.Popen(
        [sys.executable, "triton_aot.py", "--no-report", "--jobs", "1", "--json", out],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
