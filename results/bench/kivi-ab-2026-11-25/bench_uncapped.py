"""tools/bench.py with inductor's CPU kernels left at their default argument cap (500) instead of the
128 that generate.compile_step sets: the third side of the KIVI A/B, to test whether the cap is what
costs the compiled KIVI step its time. Same arguments as tools/bench.py.

    python results/bench/kivi-ab-2026-11-25/bench_uncapped.py --checkpoint ... --compile --caches full,kivi
"""
import contextlib
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import generate  # noqa: E402

generate.cpp_kernel_args_capped = lambda n: contextlib.nullcontext()  # compile_step looks it up per call
sys.argv[0] = str(ROOT / "tools" / "bench.py")
runpy.run_path(sys.argv[0], run_name="__main__")
