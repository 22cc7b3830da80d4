"""Interpreter time of one topk_lowbit_triton call, old (chunked tl.topk + merge) vs radix; run from a
repo root (argv[1]) with TRITON_INTERPRET=1."""
import argparse, os, sys, time
cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
cli.add_argument("root", help="a checkout of the repository (the old or the new code)")
root = cli.parse_args().root
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, root)
os.chdir(root)
import torch
torch.set_num_threads(1)
import topk
from tests.test_kernels import topk_inputs, fetched_rows
for S, nq, k in ((256, 160, 16), (1024, 960, 64)):
    t = topk_inputs(G=3, n_quant=nq, S=S, k=k)
    f = fetched_rows(t)
    topk.topk_lowbit_triton(*t, f)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); topk.topk_lowbit_triton(*t, f); ts.append(time.perf_counter() - t0)
    print(f"{root}: S={S} k={k}: min {min(ts):.3f} s, median {sorted(ts)[1]:.3f} s per call")
