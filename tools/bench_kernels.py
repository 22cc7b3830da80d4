"""Each decode-step kernel alone, at a model's shapes (`python tools/bench.py --kernels`): the low-bit
attention, the speculative top-k, the row transfer and re-ranking's transfer, timed against their
byte floors, and the main stream's attention with the transfer beside it on a side stream.

On CUDA each kernel is timed as a CUDA graph's replays after an L2 flush (what a compiled decode step
sees) and eagerly (with the Python launch overhead); on CPU the references run (compiled with
--compile)."""
import sys

import torch

from config import CacheConfig
from tools import measure
from tools.measure import H100_GBS


def lowbit_kernel_case(Hkv, G, D, context, bits, dtype, device, g, group=64, k=64):
    """A SpeCache layer's cache filled with random codes and scales to `context` tokens, k fetched
    rows and two query tokens: the inputs of the attention and top-k kernels at a model's shapes.
    -> (cache, its LowBitKV, Fetched, q [1, Hkv*G, 2, D])."""
    import quant
    from cache import LowBitCache
    c = LowBitCache(1, Hkv, context + 128, D, dtype, device, CacheConfig("specache", bits=bits, group=group, k=k))
    for name in ("k_codes", "v_codes"):
        getattr(c, name).random_(0, 256, generator=g)
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        getattr(c, name).normal_(0, 0.1, generator=g)
    c.n_quant.fill_(context // c.residual * c.residual)
    c.res_len.fill_(c.residual // 2)
    idx = torch.randperm(int(c.n_quant), generator=g, device=device)[:k].expand(1, Hkv, k).contiguous()
    fetched = quant.Fetched(torch.randn(1, Hkv, k, D, generator=g, device=device).to(dtype),
                             torch.randn(1, Hkv, k, D, generator=g, device=device).to(dtype), idx,
                             torch.ones(1, Hkv, k, dtype=torch.bool, device=device))
    q2 = torch.randn(1, Hkv * G, 2, D, generator=g, device=device).to(dtype)
    return c, c.stored(), fetched, q2


@torch.no_grad()
def kernel_rows(model, context: int, a, bw) -> list[dict]:
    """Each decode-step kernel alone at the model's shapes, batch 1, `context` tokens: time, bytes it
    must move, achieved GB/s, and its byte floor here and on an H100."""
    import torch.nn.functional as F

    import decoding
    import kernels
    import prefetch
    from config import DEFAULT_ATTN_PATH
    from gpu import topk, transfer

    args = model.args
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    Hkv, G, D = args.n_kv_heads, args.n_heads // args.n_kv_heads, args.head_dim
    def wrap(f):  # a fresh compile per kernel: the closures differ, so dynamo would pile up recompiles
        if not (a.compile and device.type == "cpu"):
            return f
        torch._dynamo.reset()
        return decoding.compiled_step(device, f)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []

    def add(name, fn, nbytes, note=""):
        t = measure.time_fn(fn, device, warmup=3, reps=a.kernel_reps)  # (the first warmup call compiles)
        # on CUDA, eager calls pay Python launch overhead (custom op, Triton launcher): the kernels' own
        # time is a CUDA graph's replay, cold L2 (what a compiled decode step sees)
        tg = measure.time_fn(fn, device, warmup=2, reps=a.kernel_reps, graph=True) if device.type == "cuda" else t
        rows.append(dict(kernel=name, context=context, bytes=nbytes, us=1e6 * tg["median_s"], us_min=1e6 * tg["min_s"],
                         us_eager=1e6 * t["median_s"],
                         achieved_gbs=nbytes / tg["median_s"] / 1e9, floor_us_here=1e6 * nbytes / (bw["copy_gbs"] * 1e9),
                         floor_us_h100=1e6 * nbytes / (H100_GBS * 1e9), note=note))
        print(f"#   {name}: {rows[-1]['us']:.1f} us (eager {rows[-1]['us_eager']:.1f})", file=sys.stderr, flush=True)

    k = torch.randn(1, Hkv, context, D, generator=g, device=device).to(dtype)
    q1 = torch.randn(1, Hkv * G, 1, D, generator=g, device=device).to(dtype)
    mask = torch.ones(1, context, dtype=torch.bool, device=device)
    sdpa = wrap(lambda: F.scaled_dot_product_attention(q1, k, k, attn_mask=mask, enable_gqa=True))
    add("full-cache SDPA (1 token)", sdpa, 2 * k.nbytes, "fp16/bf16 K and V")
    victim = None  # (name, fn, bytes): the first low-bit attention, timed beside the transfers below
    for bits in a.kernel_bits:
        c, store, fetched, q2 = lowbit_kernel_case(Hkv, G, D, context, bits, dtype, device, g, group=a.group or 64,
                                                   k=a.k or 64)
        K, idx = fetched.idx.shape[2], fetched.idx
        c.attn_path = a.attn_path or DEFAULT_ATTN_PATH  # (the cache's attention: the op on CUDA, the reference on CPU)
        attn = wrap(lambda: c.attend(q2, fetched))
        fbytes = fetched.k.nbytes + fetched.v.nbytes + idx.nbytes
        path = f", {a.attn_path or DEFAULT_ATTN_PATH}" if device.type == "cuda" else ""
        add(f"{bits}-bit attention (2 tokens, {K} fetched{path})", attn, c.read_bytes(2) + fbytes)
        victim = victim or (f"{bits}-bit attention", attn, c.read_bytes(2) + fbytes)
        attn_sel = wrap(lambda: c.attend(q2, fetched, select=1))
        _, lse, logits = c.attend(q2, fetched, select=1)
        add(f"{bits}-bit attention + the speculative token's logits{path}", attn_sel, c.read_bytes(2) + fbytes,
            f"+ {logits.nbytes:,} B of logits written")
        ring = (torch.full((1, Hkv, K), -1, device=device), torch.zeros(1, Hkv, K, dtype=torch.bool, device=device), 0,
                torch.empty(1, Hkv, K, dtype=torch.long, device=device))
        if device.type == "cuda":  # one launch: the radix selection, the ring's record, the transfer's rows
            select = wrap(lambda: topk.select_triton(logits, lse[:, :, 1:], store.n_quant, K, record=ring))
        else:
            select = wrap(lambda: prefetch.record_rows(*kernels.select_ref(logits, lse[:, :, 1:], store.n_quant, K), *ring[:3]))
        add(f"{bits}-bit selection from the logits (+ the ring's record)", select, logits.nbytes + ring[3].nbytes)
    # the transfer: k rows of K and V per kv head from the host store
    K = a.k or 64
    hk, hv = (torch.randn(1, Hkv, context, D, generator=torch.Generator().manual_seed(1)).to(dtype) for _ in range(2))
    if device.type == "cuda":  # pinned: read by the device over PCIe
        hk, hv = hk.pin_memory(), hv.pin_memory()
    rk, rv = (torch.zeros(1, Hkv, K, D, dtype=dtype, device=device) for _ in range(2))
    idx = torch.randint(0, context, (1, Hkv, K), device=device)
    new = torch.zeros(1, Hkv, 1, D, dtype=dtype, device=device)
    pos = torch.tensor(context - 1, device=device)
    add(f"fetch {K} rows of K and V per kv head (+ write 1)", lambda: transfer.transfer_rows_triton(hk, hv, rk, rv, idx, new, new, pos),
        rk.nbytes + rv.nbytes, "host -> device over PCIe on CUDA")
    # re-ranking's transfer (rr2): the keys of 2k low-bit candidates, the k best by exact score, their values
    C = min(2 * K, context)
    cand = torch.stack([torch.randperm(context, generator=g, device=device)[:C] for _ in range(Hkv)])[None]
    fetch_idx, fetch_valid = torch.zeros_like(idx), torch.zeros(1, Hkv, K, dtype=torch.bool, device=device)
    q_rows, lse_rows = q1, torch.full((1, Hkv * G, 1), 4.0, device=device)
    scratch = transfer.rerank_scratch(1, Hkv, C, D, dtype, device)
    add(f"re-rank {C} candidate keys, fetch the {K} best's values (+ write 1)",
        lambda: transfer.rerank_rows_triton(hk, hv, rk, rv, fetch_idx, fetch_valid, cand, torch.ones_like(cand, dtype=torch.bool),
                                     q_rows, lse_rows, 1 / D ** 0.5, new, new, pos, scratch=scratch),
        rk.nbytes * (C + K) // K, "host -> device over PCIe on CUDA: 2k keys + k values per kv head")
    # The side stream's cost to the main stream. On the H100 (2026-11-23) a 16 KB main-stream copy that
    # ran beside the transfer took 26 us. Here the main stream's low-bit attention runs with the fetch
    # on a second stream, as in a decode step: the UVA kernel (SMs read host memory), then a copy-engine
    # copy of the same bytes from one pinned block (no SMs). Without interference a pair takes the
    # longer of its two times alone (rows above); with it, more.
    dm = torch.get_device_module(device.type)
    side = dm.Stream(device=device) if device.type == "cuda" else dm.Stream()
    block = torch.randn(2, Hkv * K, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    block = block.pin_memory() if device.type == "cuda" else block
    ring_block = torch.empty(2, Hkv * K, D, dtype=dtype, device=device)

    def beside(fetch):
        def step():
            side.wait_stream(dm.current_stream(device))
            with dm.stream(side):
                fetch()
            victim[1]()
            dm.current_stream(device).wait_stream(side)
        return step
    if victim is not None:
        add(f"{victim[0]} beside the {K}-row fetch kernel on a side stream",
            beside(lambda: transfer.transfer_rows_triton(hk, hv, rk, rv, idx, new, new, pos)),
            victim[2] + rk.nbytes + rv.nbytes, "no interference: the longer of the two alone")
        add(f"{victim[0]} beside a copy-engine copy of the same bytes on a side stream",
            beside(lambda: ring_block.copy_(block, non_blocking=True)),
            victim[2] + ring_block.nbytes, "one pinned block, cudaMemcpyAsync on CUDA")
    return rows


# ---- the launch-configuration sweep (`python tools/bench.py --kernels --sweep`, CUDA only) -------------------
# Every attention path (kernels.py: words, Triton bit planes, the Gluon plane kernel), the 1/2/4-bit widths, key
# groups 64 (the paper's) and 32 (the preset's), each launch configuration the launcher takes (num_warps x
# num_stages, and the split count around its default), at 8k, 32k and 128k, Llama-3.1-8B shapes (8 kv heads x 4
# query heads, d 128), bf16, batch 1, 2 query tokens and 64 fetched rows: us (CUDA-graph replay after an L2
# flush), GB/s and % of the byte floor (the bytes over the measured copy bandwidth). The Gluon kernel fixes its
# own warps (attn_gluon.WARPS; num_warps/num_stages reach only the fp-row program beside it), so its rows
# take the launcher's choice and the split counts, not the warps/stages grid.
# Cost (all configurations): 2 Triton paths x 3 widths x 2 groups x (1 + 9) compiled configurations + 6 Gluon
# compiles = 126 compiles at ~1-3 s each (Triton + ptxas, one core) = 2-6 min, and 486 timings of ~0.1 s
# (3 warm-ups, a graph capture, 10 replays after a 256 MiB flush). `--sweep-configs launcher` (what `make
# gpu-check` runs): the launcher's choice alone, 18 compiles and 54 timings, ~1 min. A guard stops at
# SWEEP_BUDGET_S and says how many timings it skipped; each row goes to `on_row` as it is measured.
SWEEP_CONTEXTS = (8192, 32768, 131072)
SWEEP_BITS = (1, 2, 4)  # (4-bit: also the layout of QuantSpec's INT4 draft view)
SWEEP_GROUPS = (64, 32)
SWEEP_WARPS = (1, 2, 4)  # (8 warps over a 16-row tile: idle warps)
SWEEP_STAGES = (1, 2, 3)
SWEEP_SPLIT_FACTORS = (0.5, 2.0)  # x the launcher's split count, at its own warps/stages
SWEEP_BUDGET_S = 540


def sweep_kernels() -> dict:
    """path -> launcher(q, store, residual, fetched, sm_scale, n_splits=None, **launch): the split-KV
    kernel's quantized-slot paths (docs/kernels.md), each asked for by name (kernels.py's attn_path)."""
    import functools

    from gpu import attention
    return {path: functools.partial(attention.attention_lowbit_triton, attn_path=path) for path in ("words", "planes", "gluon")}


def sweep_configs(n_splits_default: int, path: str = "words", every: bool = True) -> list[dict]:
    """The launch overrides one width is timed with: {} = the launcher's own choice first; every=False:
    that alone. The Gluon path's warps are its own: the split counts only."""
    configs = [{}]
    if every and path != "gluon":
        configs += [dict(num_warps=w, num_stages=s) for w in SWEEP_WARPS for s in SWEEP_STAGES]
    if every:
        configs += [dict(n_splits=max(1, round(n_splits_default * f))) for f in SWEEP_SPLIT_FACTORS]
    return configs


@torch.no_grad()
def sweep_rows(args, bw, device=torch.device("cuda"), dtype=torch.bfloat16, every=True, on_row=None,
               budget_s=SWEEP_BUDGET_S) -> list[dict]:
    """The sweep's rows (kernel = the path asked for, gluon = whether the Gluon kernel ran), each passed
    to on_row(row) as soon as it is measured."""
    import time

    from gpu import attention
    Hkv, G, D = args.n_kv_heads, args.n_heads // args.n_kv_heads, args.head_dim
    start, rows, skipped = time.perf_counter(), [], 0
    n_splits_default = max(1, attention.programs_target(device) // Hkv)
    g = torch.Generator(device=device).manual_seed(0)
    for bits in SWEEP_BITS:
        for group in SWEEP_GROUPS:
            for context in SWEEP_CONTEXTS:
                c, store, fetched, q2 = lowbit_kernel_case(Hkv, G, D, context, bits, dtype, device, g, group=group)
                nbytes = c.read_bytes(2) + fetched.k.nbytes + fetched.v.nbytes + fetched.idx.nbytes
                for name, launcher in sweep_kernels().items():
                    for cfg in sweep_configs(n_splits_default, name, every):
                        if time.perf_counter() - start > budget_s:
                            skipped += 1
                            continue
                        row = dict(kernel=name, gluon=name == "gluon", bits=bits, group=group, context=context,
                                   config=cfg or "launcher's choice", bytes=nbytes)
                        fn = lambda: launcher(q2, store, c.residual_rows(2), fetched, c.sm_scale, **cfg)  # noqa: E731
                        try:
                            t = measure.time_fn(fn, device, warmup=3, reps=10, graph=True)
                        except Exception as e:  # noqa: BLE001 - a configuration that does not fit (shared memory) is a row
                            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
                        else:
                            us = 1e6 * t["median_s"]
                            floor_us = 1e6 * nbytes / (bw["copy_gbs"] * 1e9)
                            row.update(us=us, gbs=nbytes / t["median_s"] / 1e9, floor_pct=100 * floor_us / us)
                        rows.append(row)
                        if on_row:
                            on_row(row)
                        print(f"{name} {bits}-bit g{group} {context:>6} {str(row['config']):<40} " +
                              (f"{row['us']:8.1f} us {row['gbs']:7.0f} GB/s {row['floor_pct']:5.1f}% of floor"
                               if "us" in row else row["error"]), flush=True)
                del c, store, fetched, q2
    if skipped:
        print(f"# time budget ({budget_s} s) spent: {skipped} timings skipped", flush=True)
    return rows
