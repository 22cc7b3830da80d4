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
    "_attn_split_kernel": [("quantized", "GROUP_K", "token", "QUANT"), ("fetched", "BLOCK_F", "row", "HAS_FETCH"),
                           ("residual", "BLOCK_F", "row", None)],
    "_attn_planes_gluon": [("quantized", ("GROUP_K", "NW"), "token", None)],
    "_attn_views_kernel": [("quantized", "GROUP_K", "token", None)],
    "_topk_score_kernel": [("scores", "GROUP_K", "position", None)],
    "_transfer_rows_kernel": [("rows", "BLOCK_R", "row", "HAS_IDX"), ("new token", 1, "kv head", ("HAS_NEW", "!HAS_IDX")),
                              ("token slot", ("BLOCK_R", 4), "slot", ("HAS_NEW", "HAS_IDX"))],
}

# kernel -> (budget per item, item, the minimum it is 4x of: what it counts)
BUDGETS = {
    "_attn_split_kernel": (24.0, "KV token", "5.9: codes 0.1 loads + 4 unpack + 1 MMA + 0.75 softmax (every loop: 24)"),
    "_attn_planes_gluon": (24.0, "KV token", "the attention's quantized slots (as _attn_split_kernel's)"),
    "_attn_views_kernel": (24.0, "KV token", "the siblings' quantized slots (as _attn_split_kernel's)"),
    "_topk_score_kernel": (12.0, "position", "3.1: 0.04 loads + 2 unpack + 0.5 MMA + 0.6 exp, sum over heads, key"),
    "_radix_round_kernel": (1.1, "key", "0.28: 0.01 load + 0.125 digit and count + 0.14 threshold (3 rounds x 256 bins / 1024 keys)"),
    "_radix_collect_kernel": (2.0, "key", "0.51: 0.01 load + 0.31 compare, two scans, store + 0.19 threshold"),
    "_radix_order_kernel": (24.0, "selected row", "6.1: 64 x 3 lane-ops of ranking / 32 + stores"),
    "_transfer_rows_kernel": (8.3, "row", "2.06: 512 B of K+V loaded and stored (2 x 1 LDG/STG.128 a warp) + index"),
    "_stage_kernel": (3100.0, "kv head", "772: the copies (3) + record_rows' 64 x 64 x 6 lane-ops / 32"),
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
    if kern == "_attn_split_kernel":
        quant = _cx(row, "QUANT", True)  # (False: the fp-row program alone, beside _attn_planes_gluon or _attn_views_kernel)
        loops = dict(quantized=nq * H if quant else 0, fetched=s["k"] * H if _cx(row, "HAS_FETCH") else 0,
                     residual=s["res_len"] * H)
        return H * (splits * quant + 1), loops, sum(loops.values()), "KV token"
    if kern == "_attn_views_kernel":
        return H * splits, dict(quantized=nq * H), nq * H, "KV token"
    if kern == "_attn_planes_gluon":
        splits = -(-splits // _cx(row, "NW"))  # (a split is a whole number of its warps' groups)
        return H * splits, dict(quantized=nq * H), nq * H, "KV token"
    if kern == "_attn_combine_kernel":
        return H * s["G"] * s["T"], {}, H * s["G"] * s["T"], "output row"
    if kern in ("_topk_score_kernel", "_radix_round_kernel", "_radix_collect_kernel"):
        chunks = nq // _cx(row, "CHUNK")
        return H * chunks, dict(scores=nq * H), nq * H, "position" if kern == "_topk_score_kernel" else "key"
    if kern == "_radix_order_kernel":
        return H, {}, s["k"] * H, "selected row"
    if kern == "_transfer_rows_kernel":
        rows = s["k"] * H if _cx(row, "HAS_IDX") else 0
        progs = min(16, max(-(-rows // _cx(row, "BLOCK_R")), H))
        new = H if _cx(row, "HAS_NEW") else 0
        return progs, {"rows": rows, "new token": new, "token slot": s["k"] * new}, rows or H, "row" if rows else "kv head"
    if kern == "_stage_kernel":
        return H, {}, H, "kv head"
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
    if row["kernel"] in ("_attn_split_kernel", "_attn_planes_gluon", "_attn_views_kernel"):
        worst = max((lp["per_item"] or float("inf")) for lp in row["loops"]) if row["loops"] else None
    else:
        worst = (row.get("step") or {}).get("per_item")
        for lp in row["loops"]:  # a loop over the items is held to the budget too
            if lp["per_item"] is not None:
                worst = max(worst or 0, lp["per_item"])
    return dict(budget=b, item=item, worst=worst, met=worst is not None and worst <= b)
