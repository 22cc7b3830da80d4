"""The launch-configuration sweep behind sweep-launch-configs.txt (on a CUDA GPU, from the repo root):

    python3 results/gpu-h100-2026-11-22/sweep.py [CONTEXT] [all|attn|topk|none]

Llama-3.1-8B shapes (8 kv heads x 4, head_dim 128), bf16, k=64, 1 and 2 bits. Times are CUDA-graph
replays after an L2 flush (measure.time_fn graph=True); a torch.profiler breakdown per GPU kernel
comes first. (sweep-unpack-variants.txt came from a variant of this script with a trial unpack
option, since removed from kernels.py.)"""
import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import kernels  # noqa: E402
from tools import measure  # noqa: E402
from tools.bench_kernels import lowbit_kernel_case  # noqa: E402

cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
cli.add_argument("context", type=int, nargs="?", default=32768)
cli.add_argument("which", nargs="?", default="all", choices=["all", "attn", "topk", "none"])
args = cli.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
Hkv, G, D, K = 8, 4, 128, 64
S, which = args.context, args.which
g = torch.Generator(device=dev).manual_seed(0)


def profile(name, fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    print(f"## profile {name} (us per call of each GPU kernel)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"   {e.device_time_total / e.count:8.1f}  x{e.count // 5}  {e.key[:90]}")


def sweep(label, nbytes, call, grid):
    """Time call(**config) for each config of the grid (a dict of lists); print each and the best."""
    best = []
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        try:
            us = 1e6 * measure.time_fn(lambda: call(**cfg), dev, warmup=2, reps=15, graph=True)["median_s"]
        except Exception as e:  # noqa: BLE001 (a config that does not compile is a result too)
            print(f"   {label} {cfg}: {type(e).__name__} {str(e)[:80]}")
            continue
        best.append((round(us, 1), cfg))
        print(f"   {label} {cfg}: {us:7.1f} us  {nbytes / us / 1e3:7.1f} GB/s", flush=True)
    print(f"# best {label}: {sorted(best, key=lambda b: b[0])[:3]}", flush=True)


for bits in (1, 2):
    c, st, f, q2 = lowbit_kernel_case(Hkv, G, D, S, bits, dt, dev, g, k=K)
    res, lse = c.residual_rows(2), torch.zeros(1, Hkv * G, device=dev)
    nbytes = c.read_bytes(2)
    key_bytes = kernels.lowbit_read_bytes(st._replace(v_codes=None, v_scale=None, v_zero=None), int(c.n_quant))
    print(f"# {bits}-bit S={S}: attention reads {nbytes / 1e6:.1f} MB (H100 floor {nbytes / 3.35e3:.1f} us)", flush=True)
    attn = lambda **kw: kernels.attention_lowbit_triton(q2, st, res, f, c.sm_scale, **kw)  # noqa: E731
    topk = lambda **kw: kernels.topk_lowbit_triton(q2[:, :, 1], lse, st, K, c.sm_scale, f, **kw)  # noqa: E731
    profile(f"attention {bits}-bit default", attn)
    profile(f"topk {bits}-bit default", topk)
    if which in ("all", "attn"):
        sweep(f"attention {bits}-bit", nbytes, attn,
              dict(n_splits=[16, 32, 64, 128, 256], num_warps=[2, 4, 8], num_stages=[1, 2, 3]))
    if which in ("all", "topk"):
        sweep(f"top-k {bits}-bit", key_bytes, topk, dict(chunk=[256, 512, 1024, 2048], num_warps=[4, 8], num_stages=[1, 2]))
