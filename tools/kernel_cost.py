"""What tools/triton_aot.py's report says per innermost loop and per decode step, and each decode
kernel's budget (docs/kernels.md explains the rules; no GPU is needed for any of it).

Loops. `loops_of(row, bodies)` names each innermost SASS loop of a compiled variant after the source
loop it is (`LOOPS`: a kernel's source loops in address order, with the constexpr that says how many
items one iteration processes and the constexpr flag without which the loop is absent) and gives its
instructions per item (x num_warps / items per iteration). A variant whose innermost loops do not
match its source loops one to one (a loop the compiler made or split) gets unnamed loops, per item None.

Per step. `per_step(row)`: warp-instructions one decode step issues for one layer at Llama-3.1-8B's
shapes (STEP) and 32k quantized tokens: each innermost loop's body x num_warps x its iterations in the
step (the step's items / items per iteration, summed over programs: an uneven split's last partial
iteration is not counted), plus the instructions outside innermost loops x num_warps x programs (an
upper bound: every branch taken, outer loops once). The items and programs are the launchers' choices
for that shape (`step_shape`).

Budgets (`BUDGETS`, written before any kernel was tuned against them): per item, 4 x the work's own
minimum in warp-instructions: its global loads at 16 B a lane, one instruction per two 16-bit codes
unpacked, its m16n8k16 MMAs with the query rows as the n8 side, and about 3 lane-operations per element
for the selection or softmax itself (exp, max, sum; compare, count). For the attention kernel that
minimum is 5.9 per KV token (bf16, d 128, 1 bit: 0.1 loads + 4 unpack + 1 MMA + 0.75 softmax), so 4x
gives the 24 the design asks for; the same factor sets the others.
"""
from typing import Optional

# Llama-3.1-8B per layer, batch 1: 8 kv heads of 4 query heads, d 128, 2 query tokens, k = 64 fetched
# rows, 64 residual rows (the window's upper bound at group 64), 2 x 64 re-ranking candidates, 132 SMs.
STEP = dict(n_quant=32768, Hkv=8, G=4, T=2, k=64, res_len=64, candidates=128, sms=132)

# Source loops in address order: (name, items per iteration: a constexpr name or a number, item, present when).
LOOPS = {
    "_attn_words_kernel": [("quantized", "GROUP_K", "token", None), ("fetched", "BLOCK_F", "row", "HAS_FETCH"),
                           ("residual", "BLOCK_F", "row", None)],
    "_attn_planes_kernel": [("quantized", "GROUP_K", "token", None), ("fetched", "BLOCK_F", "row", "HAS_FETCH"),
                            ("residual", "BLOCK_F", "row", None)],
    "_attn_fp_rows_kernel": [("fetched", "BLOCK_F", "row", "HAS_FETCH"), ("residual", "BLOCK_F", "row", None)],
    "attn_planes_gluon": [("quantized", ("GROUP_K", "NW"), "token", None)],
    "_attn_views_kernel": [("quantized", "GROUP_K", "token", None)],
    # (the radix rounds and the merge work on register tiles, outside any loop: counted as the kernel's rest)
    "_select_kernel": [("keys", "SLICE", "query row position", None)],
    "_transfer_rows_kernel": [("rows", "BLOCK_R", "row", "HAS_ROWS"), ("new token", 1, "kv head", ("HAS_NEW", "!HAS_ROWS")),
                              ("token slot", ("BLOCK_R", 4), "slot", ("HAS_NEW", "HAS_ROWS"))],
}

ATTENTION_KERNELS = ("_attn_words_kernel", "_attn_planes_kernel", "_attn_fp_rows_kernel", "attn_planes_gluon",
                     "_attn_views_kernel")

# kernel -> (budget per item, item, the minimum it is 4x of: what it counts)
BUDGETS = {
    "_attn_words_kernel": (24.0, "KV token", "5.9: codes 0.1 loads + 4 unpack + 1 MMA + 0.75 softmax (every loop: 24)"),
    "_attn_planes_kernel": (24.0, "KV token", "as _attn_words_kernel's"),
    "_attn_fp_rows_kernel": (24.0, "KV token", "the fp rows' loops (as _attn_words_kernel's)"),
    "attn_planes_gluon": (24.0, "KV token", "the attention's quantized slots (as _attn_words_kernel's)"),
    "_attn_views_kernel": (24.0, "KV token", "the siblings' quantized slots (as _attn_words_kernel's)"),
    "_select_kernel": (4.0, "position", "1.0: keys 0.3 (G = 4 logits, exp2, sum, key, store, count) + 3 rounds x 0.15 "
                                        "(digit, count, from registers) + collect 0.25 (compare, a scan, store)"),
    "_transfer_rows_kernel": (8.3, "row", "2.06: 512 B of K+V loaded and stored (2 x 1 LDG/STG.128 a warp) + index"),
    "_rerank_score_kernel": (135.0, "candidate", "33.8: 1 key load + store, 8 rows x 128 FMA / 32, exp and sums"),
    "_rerank_layout_kernel": (96.0, "candidate", "24: 128 x 3 lane-ops of ranking / 32 + record_rows' 64 x 6 / 32"),
    "_rerank_pick_kernel": (8.0, "candidate", "2: key and value loaded and stored"),
}


def _cx(row, name, default=None):
    v = row["constexprs"].get(name, default)
    return v if v is None or not isinstance(v, str) else (v == "True" if v in ("True", "False") else int(v) if v.lstrip("-").isdigit() else v)


def items_per_iteration(row, per):
    """A number, a constexpr's value, or the product of a tuple of those."""
    if isinstance(per, int):
        return per
    if isinstance(per, tuple):
        out = 1
        for x in per:
            out *= items_per_iteration(row, x)
        return out
    return _cx(row, per)


def _present(row, cond) -> bool:
    """A loop's condition: None (always), a constexpr flag, "!flag", or a tuple of those (all hold)."""
    if cond is None:
        return True
    if isinstance(cond, tuple):
        return all(_present(row, c) for c in cond)
    return not _cx(row, cond[1:], True) if cond.startswith("!") else bool(_cx(row, cond, True))


def loops_of(row, bodies: list[int]) -> list[dict]:
    """Each innermost loop (bodies: their instructions, address order) with its name and per-item cost."""
    want = [lp for lp in LOOPS.get(row["kernel"], []) if _present(row, lp[3])]
    if len(want) != len(bodies):
        return [dict(name=f"loop {i}", instr=n, item=None, per_item=None) for i, n in enumerate(bodies)]
    out = []
    for (name, per, item, _), n in zip(want, bodies):
        k = items_per_iteration(row, per)
        out.append(dict(name=name, instr=n, item=item, per_iteration=k,
                        per_item=n * row["num_warps"] / k if k else None))
    return out


def step_shape(row) -> Optional[tuple[int, dict, int, str]]:
    """(programs, {loop name: items in the step}, the step's items, item) for the STEP shape, or None."""
    s, kern = STEP, row["kernel"]
    H, nq = s["Hkv"], s["n_quant"]
    splits = min(nq // (_cx(row, "GROUP_K") or 1), 4 * s["sms"] // H)
    if kern in ("_attn_words_kernel", "_attn_planes_kernel", "_attn_fp_rows_kernel"):
        quant = kern != "_attn_fp_rows_kernel"  # (the fp rows' program alone: beside attn_planes_gluon or _attn_views_kernel)
        loops = dict(quantized=nq * H if quant else 0, fetched=s["k"] * H if _cx(row, "HAS_FETCH") else 0,
                     residual=s["res_len"] * H)
        return H * (splits * quant + 1), loops, sum(loops.values()), "KV token"
    if kern == "_attn_views_kernel":
        return H * splits, dict(quantized=nq * H), nq * H, "KV token"
    if kern == "attn_planes_gluon":
        splits = -(-splits // _cx(row, "NW"))  # (a split is a whole number of its warps' groups)
        return H * splits, dict(quantized=nq * H), nq * H, "KV token"
    if kern == "_attn_combine_kernel":
        return H * s["G"] * s["T"], {}, H * s["G"] * s["T"], "output row"
    if kern == "_select_kernel":  # the keys' loop runs once per query head of a kv head over each slice
        from gpu import topk
        n_slices = topk.slices(nq, s["k"])[1]
        return H * n_slices, {"keys": nq * H * s["G"]}, nq * H, "position"
    if kern == "_transfer_rows_kernel":
        rows = s["k"] * H if _cx(row, "HAS_ROWS") else 0
        progs = min(16, max(-(-rows // _cx(row, "BLOCK_R")), H))
        new = H if _cx(row, "HAS_NEW") else 0
        return progs, {"rows": rows, "new token": new, "token slot": s["k"] * new}, rows or H, "row" if rows else "kv head"
    if kern in ("_rerank_score_kernel", "_rerank_pick_kernel"):
        return H * (s["candidates"] + (kern == "_rerank_pick_kernel")), {}, H * s["candidates"], "candidate"
    if kern == "_rerank_layout_kernel":
        return H, {}, H * s["candidates"], "candidate"
    return None


def per_step(row, total_instr: int, loops: list[dict]) -> Optional[dict]:
    """Warp-instructions of one step (STEP shape) and per item, from the variant's loop bodies and its
    instructions outside innermost loops (total_instr: every instruction of the kernel, NOPs aside)."""
    shape = step_shape(row)
    if shape is None:
        return None
    programs, items, total_items, item = shape
    w = row["num_warps"]
    straight = total_instr - sum(lp["instr"] for lp in loops)
    count = straight * w * programs
    for lp in loops:
        if lp.get("per_iteration") is None:
            return None  # (a loop we cannot name has no trip count)
        count += lp["instr"] * w * items.get(lp["name"], 0) // lp["per_iteration"]
    return dict(step_instr=count, step_items=total_items, item=item, per_item=count / total_items,
                programs=programs)


def budget_check(row) -> Optional[dict]:
    """{budget, item, met}: the kernel's budget against its worst loop (attention: every loop, per KV
    token) or, for kernels without loops, its per-step count per item."""
    if row["kernel"] not in BUDGETS or "loops" not in row:
        return None
    b, item, _ = BUDGETS[row["kernel"]]
    if row["kernel"] in ATTENTION_KERNELS:
        worst = max((lp["per_item"] or float("inf")) for lp in row["loops"]) if row["loops"] else None
    else:
        worst = (row.get("step") or {}).get("per_item")
        for lp in row["loops"]:  # a loop over the items is held to the budget too
            if lp["per_item"] is not None:
                worst = max(worst or 0, lp["per_item"])
    return dict(budget=b, item=item, worst=worst, met=worst is not None and worst <= b)


# ---- launches per decode layer, counted on CPU ------------------------------------------------------
# Not a torch op: allocations and views launch nothing on a GPU.
NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "select",
             "slice", "detach", "alias", "unsqueeze", "squeeze", "expand", "reshape", "lift_fresh", "empty_like",
             "new_empty"}


def count_launches(cache: str, layers: int = 4, context: int = 1000, steps: int = 3, head_dim: int = 128) -> dict:
    """One decode step of the GPU's path on CPU (custom ops, Triton interpreted, the prefetcher's async path on
    torch.cpu's no-op streams) after a prefill of `context` tokens and a warm-up step, over a random model of
    Llama-3.1-8B's head layout (4 query heads a kv head, head_dim 128) with `layers` layers. Counts, per decode
    layer and step: Triton launches by kernel, and the torch ops the custom ops run (each a kernel on a GPU;
    allocations and views aside). The compiled graph's own torch ops (KV write, quantizer, norms) are the same
    for KIVI and SpeCache and are not counted. Run in a process with TRITON_INTERPRET=1 set before triton
    is imported (main() does)."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    import generate
    import prefetch
    from gpu import attention, transfer
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    args = ModelArgs(name="launches", dim=8 * head_dim, n_layers=layers, n_heads=8, n_kv_heads=2, head_dim=head_dim,
                     vocab_size=512, intermediate_size=512, max_seq_len=context + steps + 8)
    model = Transformer(args).eval()
    caches = generate.setup_caches(model, cache, 1, args.max_seq_len)
    for c in caches:
        c.custom_ops = True
    p = caches.prefetcher
    if p is not None:  # the CUDA code path: custom ops, staging, side-stream work (no-op streams on CPU)
        p.async_ops, p.triton = True, True
        p._setup_async()
    counts, ops, state = collections.Counter(), collections.Counter(), {"on": False, "in_op": 0}

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            name = func.overloadpacket.__name__
            out = func(*a, **(kw or {}))
            same = isinstance(out, torch.Tensor) and a and isinstance(a[0], torch.Tensor) and \
                out.data_ptr() == a[0].data_ptr() and name in ("contiguous", "to")  # (already so: no copy)
            if state["on"] and state["in_op"] and name.rstrip("_") not in NO_KERNEL and not same:
                ops[name] += 1
            return out

    run = interpreter.InterpretedFunction.run

    def counted(self, *a, grid, warmup, **kw):
        if state["on"]:
            counts[self.fn.__name__] += 1
        state["in_op"] -= 1  # (the interpreter's own tensor copies are not the kernel's)
        try:
            return run(self, *a, grid=grid, warmup=warmup, **kw)
        finally:
            state["in_op"] += 1

    def inside(fn):  # the bodies of the custom ops: what they run is what a GPU launches for them
        def wrapped(*a, **kw):
            state["in_op"] += 1
            try:
                with TorchOps():
                    return fn(*a, **kw)
            finally:
                state["in_op"] -= 1
        return wrapped

    patches = [(interpreter.InterpretedFunction, "run", counted), (attention, "attention_lowbit_triton", None)]
    patches += [(prefetch.Prefetcher, n, None) for n in ("_start_async", "_wait_async", "_join_async")]
    patches += [(prefetch, "keep_sink_rows", None), (transfer, "keep_sinks_triton", None)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new or inside(getattr(obj, name)))
        prompt = torch.randint(0, args.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for i in range(steps):  # (pre-decoding, then decode steps; the last one is counted)
                state["on"] = i == steps - 1
                if i == 0:
                    generate.prefill(model, prompt)
                    token = torch.zeros(1, dtype=torch.long)
                    if caches.config.policy.pre_decode:
                        generate.pre_decode(model, token, torch.tensor([context]))
                    continue
                T = caches.config.policy.step_tokens
                pos = torch.arange(context + i - 1, context + i - 1 + T)
                generate.decode_step(model, torch.zeros(1, T, dtype=torch.long), pos)
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
    per = lambda c: {k: v / layers for k, v in sorted(c.items())}  # noqa: E731
    return dict(cache=caches.config.name, layers=layers, steps=1, context=context,
                launches_per_layer=sum(counts.values()) / layers, triton=per(counts),
                torch_ops_in_custom_ops_per_layer=sum(ops.values()) / layers, torch_ops=per(ops))


def main(argv=None):
    import argparse
    import json
    import os
    import sys
    ap = argparse.ArgumentParser(description="tools/kernel_cost.py --launches: Triton launches per decode layer "
                                 "of a cache configuration's GPU path, counted on CPU (interpreted kernels)")
    ap.add_argument("--launches", action="store_true", required=True)
    ap.add_argument("--cache", action="append", required=True, help="a cache name (config.CacheConfig); repeatable")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=1000)
    a = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # (before anything imports triton)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from config import CacheConfig
    for name in a.cache:
        try:
            CacheConfig.from_name(name)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        print(json.dumps(count_launches(name, a.layers, a.context)))


if __name__ == "__main__":
    main()
