"""The launch-config sweep that produced sweep-launch-configs.txt (run from the repo root: python3 results/gpu-h100-2026-11-22/sweep.py 32768 all). Scratch: launch-config sweep of the low-bit attention and top-k kernels at Llama-3.1-8B shapes, 32k,
bf16, on a CUDA GPU. Times are CUDA-graph replays after an L2 flush (measure.time_fn graph=True).
Also: a torch.profiler breakdown of one eager call per op (GPU time per kernel)."""
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import kernels  # noqa: E402
import measure  # noqa: E402
from cache import CacheConfig, LowBitCache  # noqa: E402

dev = torch.device("cuda")
dt = torch.bfloat16
Hkv, G, D, S, K = 8, 4, 128, int(sys.argv[1]) if len(sys.argv) > 1 else 32768, 64
which = sys.argv[2] if len(sys.argv) > 2 else "all"
g = torch.Generator(device=dev).manual_seed(0)


def case(bits):
    cfg = CacheConfig("specache", bits=bits, group=64, k=K)
    c = LowBitCache(1, Hkv, S + 128, D, dt, dev, cfg)
    for n in ("k_codes", "v_codes"):
        getattr(c, n).random_(0, 256, generator=g)
    for n in ("k_scale", "k_zero", "v_scale", "v_zero"):
        getattr(c, n).normal_(0, 0.1, generator=g)
    c.n_quant.fill_(S // c.residual * c.residual)
    c.res_len.fill_(c.residual // 2)
    idx = torch.randperm(int(c.n_quant), generator=g, device=dev)[:K].expand(1, Hkv, K).contiguous()
    f = kernels.Fetched(torch.randn(1, Hkv, K, D, generator=g, device=dev).to(dt),
                        torch.randn(1, Hkv, K, D, generator=g, device=dev).to(dt), idx,
                        torch.ones(1, Hkv, K, dtype=torch.bool, device=dev))
    q2 = torch.randn(1, Hkv * G, 2, D, generator=g, device=dev).to(dt)
    return c, c.stored(), f, q2


def t_us(fn):
    return 1e6 * measure.time_fn(fn, dev, warmup=2, reps=15, graph=True)["median_s"]


def profile(name, fn):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    print(f"## profile {name} (us per call of each GPU kernel)")
    for k, us, n in sorted(rows, key=lambda r: -r[1]):
        print(f"   {us:8.1f}  x{n // 5}  {k[:90]}")


for bits in (1, 2):
    c, st, f, q2 = case(bits)
    nbytes = c.read_bytes(2)
    res = c.residual_rows(2)
    print(f"# {bits}-bit S={S}: attention reads {nbytes / 1e6:.1f} MB (H100 floor {nbytes / 3.35e9 * 1e6 / 1e3:.1f} us)", flush=True)
    profile(f"attention {bits}-bit default", lambda: kernels.attention_lowbit_triton(q2, st, res, f, c.sm_scale))
    lse = torch.zeros(1, Hkv * G, device=dev)
    profile(f"topk {bits}-bit default", lambda: kernels.topk_lowbit_triton(q2[:, :, 1], lse, st, K, c.sm_scale, f))
    if which in ("all", "attn"):
        best = []
        for ns, nw, stg in itertools.product((16, 32, 64, 128, 256), (2, 4, 8), (1, 2, 3)):
            try:
                us = t_us(lambda: kernels.attention_lowbit_triton(q2, st, res, f, c.sm_scale, n_splits=ns,
                                                                 num_warps=nw, num_stages=stg))
            except Exception as e:  # noqa: BLE001
                print(f"   attn splits={ns} warps={nw} stages={stg}: {type(e).__name__} {str(e)[:80]}")
                continue
            best.append((us, ns, nw, stg))
            print(f"   attn {bits}b splits={ns:4d} warps={nw} stages={stg}: {us:7.1f} us  {nbytes / us / 1e3:7.1f} GB/s", flush=True)
        best.sort()
        print(f"# best attention {bits}-bit: {best[:3]}")
    if which in ("all", "topk"):
        kb = kernels.lowbit_read_bytes(st._replace(v_codes=None, v_scale=None, v_zero=None), int(c.n_quant))
        best = []
        for ch, nw, stg in itertools.product((256, 512, 1024, 2048), (4, 8), (1, 2)):
            try:
                us = t_us(lambda: kernels.topk_lowbit_triton(q2[:, :, 1], lse, st, K, c.sm_scale, f, chunk=ch,
                                                             num_warps=nw, num_stages=stg))
            except Exception as e:  # noqa: BLE001
                print(f"   topk chunk={ch} warps={nw}: {type(e).__name__} {str(e)[:80]}")
                continue
            best.append((us, ch, nw, stg))
            print(f"   topk {bits}b chunk={ch:5d} warps={nw} stages={stg}: {us:7.1f} us  {kb / us / 1e3:7.1f} GB/s", flush=True)
        best.sort()
        print(f"# best topk {bits}-bit: {best[:3]}")
