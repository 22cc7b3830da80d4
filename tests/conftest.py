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
