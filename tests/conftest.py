"""Test-wide setup: one thread (see cpu-toolchain notes on oversubscription), a repo-local
inductor cache, and the compile gate started in the background."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No GPU here or in CI: Triton kernels are checked on CPU tensors by its interpreter, which Triton
# reads at import time, so it is set before anything imports kernels.py.
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, ".cache", "inductor"))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# SPECACHE_TEST_TIMEOUT_S=N (tools/gpu_check.py sets it): a test still running after N seconds fails with
# TimeoutError and the rest go on (an alarm in the main thread: it cannot stop a kernel that never returns,
# which the caller's process timeout covers).
TEST_TIMEOUT_S = float(os.environ.get("SPECACHE_TEST_TIMEOUT_S") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    import signal
    if not TEST_TIMEOUT_S or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"over SPECACHE_TEST_TIMEOUT_S={TEST_TIMEOUT_S:g} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# The compile gate (tests/test_compile_gate.py) compiles Triton kernel variants for GPU targets:
# minutes of single-threaded ptxas on a cold cache. It starts in the background as soon as
# collection shows it will run, on the core the (single-threaded) suite leaves free, and its tests
# move to the end of the run, by which time it has usually finished. SPECACHE_GATE picks the matrix:
# "quick" (make test: sm_90, the GPU-default variants but the KIVI-only ones) or "full" (make test-full and
# CI: every variant for sm_80 and sm_90).
# (make test-full runs little else, so its gate takes both cores.)
GATE_MATRIX = {"quick": (["--quick", "--arch", "90", "--jobs", "1"], {90}), "full": (["--jobs", "2"], {80, 90})}


@pytest.hookimpl(trylast=True)  # after the -m deselection: only a gate that will be read is started
def pytest_collection_modifyitems(config, items):
    gate = [item for item in items if item.nodeid.startswith("tests/test_compile_gate.py::test_every")
            or item.nodeid.startswith("tests/test_compile_gate.py::test_fp32")]
    if not gate:
        return
    items[:] = [item for item in items if item not in gate] + gate
    import subprocess
    import tempfile
    mode = os.environ.get("SPECACHE_GATE", "quick")
    if mode not in GATE_MATRIX:
        raise pytest.UsageError(f"SPECACHE_GATE={mode!r}: expected one of {', '.join(GATE_MATRIX)}")
    args, archs = GATE_MATRIX[mode]
    out = os.path.join(tempfile.mkdtemp(prefix="gate-"), "gate.json")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.Popen([sys.executable, "tools/triton_aot.py", "--no-report", "--json", out, *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config.add_cleanup(proc.kill)  # a run stopped early (-x, Ctrl-C) leaves no compiler behind
    config.specache_gate = dict(json=out, archs=archs, proc=proc)
