"""Top-k selection: which quantized positions' fp16 rows to fetch (SpeCache §3.3, Algorithm 3's ArgTopK).

  topk_lowbit   the k positions with the largest attention probability under the selecting query
                token(s), scored over the low-bit keys (the speculative token's row; several rows:
                the best of them), summed over the query heads that share a kv head (GQA: one
                fetch per kv head serves all its query heads); fetched positions score with their
                fp rows.
  topk_exact    the same top-k from full-precision keys (oracle fetch, hit rates).
  rerank_exact  the k best of N*k candidates by their fp keys (re-ranking's reference).
  rerank_rows   re-ranking where the keys land: the candidates' fp keys read from the host store
                score them, and the k best go to the ring (Triton on the side stream, prefetch.py).
  select        what a SpeCache layer fetches: one of the above by its configuration, for
                prefetch.Prefetcher.start.

A torch reference beside each Triton kernel; the public functions dispatch on the device as
kernels.py's do (CUDA: Triton behind a custom op; CPU: the reference).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from lowbit import (Fetched, LowBitKV, Residual, Tensor, code_layout, dot_precision, from_op_inputs,
                    interpreter_upcast, key_logits, op_inputs, planes_for_keys)
from tiles import LOG2E, key_group, key_scores, load_codes, plane_key_scores, tile_channels
from transfer import host_row, record_rows, record_rows_tile, square_tile_warps, transfer_rows_ref, write_new_rows


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def _row_scores(logits, lse_rows, G, R):
    """logits [B,Hkv,G*R,N] of query rows m = g*R + r -> score [B,Hkv,N]: the attention probability
    summed over the kv head's G query heads, the best of the R query tokens."""
    B, Hkv, _, N = logits.shape
    p = torch.exp(logits - lse_rows.float().reshape(B, Hkv, G * R, 1))
    return p.view(B, Hkv, G, R, N).sum(2).amax(2)


def as_rows(q_row, lse_row):
    """[B,H,D] / [B,H] (one query token) or [B,H,R,D] / [B,H,R] (R tokens) -> the 4-d / 3-d form."""
    return (q_row[:, :, None], lse_row[:, :, None]) if q_row.dim() == 3 else (q_row, lse_row)


def _fp_row_scores(q_rows, lse_rows, keys, sm_scale):
    """topk_lowbit's score of fp keys [B,Hkv,N,D] for query rows [B,H,R,D] -> [B,Hkv,N]."""
    B, H, R, D = q_rows.shape
    Hkv = keys.shape[1]
    qg = q_rows.float().reshape(B, Hkv, (H // Hkv) * R, D) * sm_scale
    return _row_scores(qg @ keys.float().transpose(-1, -2), lse_rows, H // Hkv, R)


def _exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched: Fetched):
    """Algorithm 3 takes ArgTopK of the attention that already used the fetched fp rows: their
    positions get exact scores, so a row that matters keeps its place whatever its low-bit copy
    scores. Invalid fetch slots write back the scratch slot's own value (position S-1 >= n_quant)."""
    S = prob.shape[2]
    exact = _fp_row_scores(q_rows, lse_rows, fetched.k, sm_scale)
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return prob.scatter(-1, safe, torch.where(fetched.valid, exact, prob.gather(-1, safe)))


def topk_lowbit_ref(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None,
                    first: int = 0):
    """score[p] = sum over the G query heads of kv head j of exp(sm_scale * q_g . k'_p - lse_g): the
    attention probability kv row p would get, summed over the heads that share it (one fetch per
    kv head serves all G heads); with several query tokens ([B,H,R,D]) the best of them. With
    `fetched`, fetched positions score with their fp rows. Positions below `first` (rows kept in fp
    anyway) or >= n_quant score -1 with index 0. Sorted descending."""
    q_rows, lse_rows = as_rows(q_row, lse_row)
    B, H, R, D = q_rows.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    G = H // Hkv
    prob = _row_scores(key_logits(q_rows.float().reshape(B, Hkv, G * R, D) * sm_scale, store), lse_rows, G, R)
    if fetched is not None:
        prob = _exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched)
    pos = torch.arange(S, device=q_row.device)
    valid = (pos >= first) & (pos < store.n_quant)
    score, idx = torch.where(valid, prob, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


def topk_exact(q_row, keys, n_quant, k, sm_scale, first: int = 0):
    """Top-k of quantized positions [first, n_quant) by exact fp attention of q_row [B,H,D] (or
    [B,H,R,D]: the best of R tokens) against full-precision keys [B,Hkv,S,D]: each query head's
    softmax over the quantized positions, summed over the kv head's query heads (the reduction of
    topk_lowbit). The oracle fetch and the fetch probe use it."""
    q_rows = q_row[:, :, None] if q_row.dim() == 3 else q_row
    B, H, R, D = q_rows.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q_rows.float().reshape(B, Hkv, G * R, D)
    scores = (qg @ keys.float().transpose(-1, -2)) * sm_scale
    pos = torch.arange(S, device=q_row.device)
    valid = (pos >= first) & (pos < n_quant)
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).view(B, Hkv, G, R, S).sum(2).amax(2)  # [B,Hkv,S]
    score, idx = torch.where(valid, probs, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


def rerank_exact(q_row, lse_row, keys, valid, k, sm_scale):
    """The k best of C candidates by their fp keys [B,Hkv,C,D] (valid [B,Hkv,C]), scored as topk_lowbit
    scores (probability summed over the kv head's query heads, best of R tokens) -> (score, index
    into the C candidates) [B,Hkv,k]; invalid candidates score -1."""
    prob = _fp_row_scores(*as_rows(q_row, lse_row), keys, sm_scale)
    return torch.where(valid, prob, -1.0).topk(k, dim=-1)


# =============================================================================================
# Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)
# =============================================================================================
@triton.jit
def _topk_score_kernel(q, lse, k_codes, k_lo, k_scale, k_zero, n_quant_ptr, f_idx, f_valid, f_k, keys, hist,
                       k_ref, ref_map, qk_scale, S, S_PAD, K, D, G, FIRST, N_REF, R: tl.constexpr,
                       BITS: tl.constexpr, HIER: tl.constexpr, RB: tl.constexpr, WORDS: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_FETCH: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                       PLANES: tl.constexpr = False, CODES: tl.constexpr = 0, CODE_OFF: tl.constexpr = 0.0):
    """Grid (B*Hkv, n_chunks). Scores one chunk of CHUNK quantized positions for the selecting query
    tokens (R of them, rows m = g*R + r): score[p] = max_r sum_g 2^(q_gr.k'_p - lse_gr) (the
    attention probability summed over the kv head's query heads, the best token's; fetched positions
    use their fp rows). Writes each position's radix key (_radix_key) and adds the chunk's histogram
    of the keys' top 8 bits to the kv head's round-0 histogram (the selection's first round, fused).
    Positions below FIRST or past n_quant are never candidates (key 0).
    PLANES (plain KIVI codes): the attention's bit-plane tiles (kernels.py: plane-major columns, codes
    as CODE_OFF + c), and the fetched rows' exact keys written over the chunk's after the loop instead
    of a [GROUP_K, K] comparison in it."""
    bh = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_c = tl.arange(0, BLOCK_D)
    offs_d = tile_channels(offs_c, BLOCK_D, BITS, PLANES)
    g_ok = offs_g < G * R
    d_ok = offs_d < D
    dt = q.dtype.element_ty
    if UPCAST:
        dt = tl.float32
    qt = tl.load(q + (bh * G * R + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                 other=0.0)
    qt = qt.to(tl.float32) * qk_scale
    lse_g = tl.load(lse + bh * G * R + offs_g, mask=g_ok, other=float("inf")).to(tl.float32) * LOG2E
    offs_f = tl.arange(0, BLOCK_F)
    if HAS_FETCH:  # exact probabilities of the fetched rows (Algorithm 3's A)
        f_ok = offs_f < K
        valid = tl.load(f_valid + bh * K + offs_f, mask=f_ok, other=0) != 0
        fidx = tl.where(valid, tl.load(f_idx + bh * K + offs_f, mask=f_ok, other=-1), -1)
        fk = tl.load(f_k + (bh * K + offs_f[:, None]) * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                     other=0.0).to(dt)
        fs = tl.exp2(tl.dot(qt.to(dt), tl.trans(fk), input_precision=DOT) - lse_g[:, None])
        f_exact = best_row(fs, offs_g, g_ok, R)  # [BLOCK_F]
    lo = chunk * CHUNK
    hi = tl.minimum(tl.load(n_quant_ptr), S)
    if PLANES:
        last = S // GROUP_K - 1
        for n0 in range(0, CHUNK, GROUP_K):
            offs_n = lo + n0 + tl.arange(0, GROUP_K)
            n_ok = (offs_n < hi) & (offs_n >= FIRST)
            grp = bh * (S // GROUP_K) + tl.minimum((lo + n0) // GROUP_K, last)  # (past S: any group, no key)
            s = plane_key_scores(qt, k_codes, k_scale, k_zero, bh * S + tl.minimum(offs_n, S - 1), grp, offs_c, offs_d, D,
                                 dt, BITS, BLOCK_D, CODES, CODE_OFF, DOT)
            tl.store(keys + bh * S_PAD + offs_n, _radix_key(best_row(tl.exp2(s - lse_g[:, None]), offs_g, g_ok, R), n_ok))
        if HAS_FETCH:  # the fetched positions of this chunk: their fp rows' exact scores replace the low-bit ones
            tl.debug_barrier()
            mine = (fidx >= lo) & (fidx < lo + CHUNK)
            tl.store(keys + bh * S_PAD + fidx, _radix_key(f_exact, (fidx < hi) & (fidx >= FIRST)), mask=mine)
    else:
        for n0 in range(0, CHUNK, GROUP_K):
            offs_n = lo + n0 + tl.arange(0, GROUP_K)
            n_ok = (offs_n < hi) & (offs_n >= FIRST)
            rows = bh * S + offs_n
            grp_ok = offs_d < tl.where(lo + n0 < hi, D, 0)  # (block & scalar-bool masks break the interpreter)
            sk, zk, ref_rows, ref_ok = key_group(k_scale, k_zero, ref_map, rows, n_ok, bh * (S // GROUP_K) + (lo + n0) // GROUP_K,
                                                  offs_d, grp_ok, D, N_REF, HIER, RB)
            ck = load_codes(k_codes, k_lo, rows, n_ok, offs_d, D, k_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS,
                            GROUP_K, BLOCK_D)
            s = key_scores(qt, sk, zk, ck, dt, DOT)
            prob = best_row(tl.exp2(s - lse_g[:, None]), offs_g, g_ok, R)
            if HAS_FETCH:
                hit = offs_n[:, None] == fidx[None, :]
                exact = tl.sum(tl.where(hit, f_exact[None, :], 0.0), 1)
                prob = tl.where(tl.max(hit.to(tl.int32), 1) > 0, exact, prob)
            tl.store(keys + bh * S_PAD + offs_n, _radix_key(prob, n_ok))
    tl.debug_barrier()  # the chunk's keys, written by all threads, are read back by all threads
    key = tl.load(keys + bh * S_PAD + lo + tl.arange(0, CHUNK))
    h = tl.histogram(key >> 24, RADIX)
    tl.atomic_add(hist + bh * HIST_ROW + tl.arange(0, RADIX), h, mask=h > 0)


@triton.jit
def best_row(p, offs_g, g_ok, R: tl.constexpr):
    """p [BLOCK_G, N] probabilities of query rows m = g*R + r -> max_r sum_g p: [N]."""
    best = tl.sum(tl.where((g_ok & (offs_g % R == 0))[:, None], p, 0.0), 0)
    for r in tl.static_range(1, R):
        best = tl.maximum(best, tl.sum(tl.where((g_ok & (offs_g % R == r))[:, None], p, 0.0), 0))
    return best


# ---- radix selection (FlashInfer's top_k, Quest's RAFT select): 8 bits per round ------------------
# A score p >= 0 has the key bits(p) + 1 (the fp32 bits of a non-negative float order as integers);
# a position that is no candidate has key 0. Keys fit 31 bits, so int32 shifts never sign-extend.
# Round r histograms digit r (bits 31-8r down to 24-8r) of the keys whose higher digits equal the k-th
# largest key's (found by rounds < r); after 4 rounds the k-th key T is known, and the selection is
# every key > T and the first (k - #keys > T) keys == T. Each round is a launch over the same
# (kv head, chunk) grid, adding its chunks' histograms with atomics: no host sync, a static grid.
RADIX = tl.constexpr(256)
# One warp per program for the rounds and the collect: each program's fixed work (the threshold from
# the histograms) is not repeated per warp (docs/kernels.md; not timed). The order's [K, K] ranks:
# transfer.square_tile_warps.
ROUND_WARPS, COLLECT_WARPS = 1, 1
HIST_ROW = tl.constexpr(4 * 256 + 2)  # per kv head: the 4 rounds' histograms, then the two collect counters


@triton.jit
def _radix_key(score, ok):
    bits = tl.minimum(score.to(tl.int32, bitcast=True), 0x7F800000)  # (NaN ranks as +inf)
    return tl.where(ok, bits + 1, 0)


@triton.jit
def _radix_threshold(hist_row, K, ROUNDS: tl.constexpr):
    """From the histograms of rounds < ROUNDS -> (prefix, need): the ROUNDS high digits of the K-th
    largest key, and how many of the keys with that prefix belong to the K largest."""
    bins = tl.arange(0, RADIX)
    prefix = 0
    need = K
    for r in tl.static_range(ROUNDS):
        h = tl.load(hist_row + r * RADIX + bins)
        above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in higher buckets
        here = (above < need) & (above + h >= need)  # exactly one bucket holds the need-th key
        b = tl.max(tl.where(here, bins, 0), 0)
        need = need - tl.sum(tl.where(bins == b, above, 0), 0)
        prefix = (prefix << 8) | b
    return prefix, need


@triton.jit
def _radix_round_kernel(keys, hist, S_PAD, K, CHUNK: tl.constexpr, ROUND: tl.constexpr):
    """Grid (B*Hkv, n_chunks): one chunk's histogram of digit ROUND over the keys that share the K-th
    key's higher digits, added to the kv head's histogram of round ROUND (ROUND 0: every key, for keys
    that did not come from _topk_score_kernel)."""
    bh = tl.program_id(0).to(tl.int64)
    key = tl.load(keys + bh * S_PAD + tl.program_id(1) * CHUNK + tl.arange(0, CHUNK))
    if ROUND == 0:
        h = tl.histogram(key >> 24, RADIX)
    else:
        prefix, _ = _radix_threshold(hist + bh * HIST_ROW, K, ROUND)
        h = tl.histogram((key >> (24 - 8 * ROUND)) & 255, RADIX, mask=(key >> (32 - 8 * ROUND)) == prefix)
    tl.atomic_add(hist + bh * HIST_ROW + ROUND * RADIX + tl.arange(0, RADIX), h, mask=h > 0)


@triton.jit
def _radix_collect_kernel(keys, hist, sel_key, sel_pos, S_PAD, K, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (B*Hkv, n_chunks): the chunk's keys > T go to slots [0, K - need) and its keys == T to the
    next free of slots [K - need, K) while any is left (which ties get in: the order the chunks
    arrive). Slots are claimed with two atomic counters per kv head; unsorted."""
    bh = tl.program_id(0).to(tl.int64)
    row = hist + bh * HIST_ROW
    t, need = _radix_threshold(row, K, 4)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    key = tl.load(keys + bh * S_PAD + offs)
    gt = (key > t).to(tl.int32)
    eq = (key == t).to(tl.int32)
    n_gt = tl.sum(gt, 0)
    n_eq = tl.sum(eq, 0)
    base_gt = tl.atomic_add(row + 4 * RADIX, n_gt, mask=n_gt > 0)
    base_eq = tl.atomic_add(row + 4 * RADIX + 1, n_eq, mask=n_eq > 0)
    slot = tl.where(gt != 0, base_gt + tl.cumsum(gt, 0) - gt, K - need + base_eq + tl.cumsum(eq, 0) - eq)
    take = ((gt != 0) | (eq != 0)) & (slot < K)  # (slot < K always holds for keys > T: a guard)
    tl.store(sel_key + bh * BLOCK_K + slot, key, mask=take)
    tl.store(sel_pos + bh * BLOCK_K + slot, offs, mask=take)


@triton.jit
def _radix_order_kernel(sel_key, sel_pos, top_score, top_idx, K, BLOCK_K: tl.constexpr):
    """Grid (B*Hkv,): the K selected keys in descending order (rank = keys ahead of it, ties by slot)
    -> (score, position); a slot with key 0 (fewer than K candidates) gets score -1 and position 0."""
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    ok = offs < K
    key = tl.load(sel_key + bh * BLOCK_K + offs, mask=ok, other=-1)
    pos = tl.load(sel_pos + bh * BLOCK_K + offs, mask=ok, other=0)
    ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (offs[None, :] < offs[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)
    valid = key > 0
    tl.store(top_score + bh * K + rank, tl.where(valid, (key - 1).to(tl.float32, bitcast=True), -1.0), mask=ok)
    tl.store(top_idx + bh * K + rank, tl.where(valid, pos, 0).to(tl.int64), mask=ok)


def radix_select_triton(keys, k: int, chunk: int, hist=None):
    """keys [BH, S_PAD] int32 (_radix_key images; S_PAD a multiple of chunk) -> (score, position)
    [BH, k] of the k largest, descending. `hist`: a [BH, HIST_ROW] int32 workspace whose round-0
    histogram the producer of the keys already added (_topk_score_kernel); None: zeros, round 0 here.
    The selection reads nothing but keys, so any producer of scores (e.g. an attention kernel that
    writes the selecting row's probabilities) can hand them over."""
    BH, S_PAD = keys.shape
    grid = (BH, S_PAD // chunk)
    first_round = 1
    if hist is None:
        hist, first_round = torch.zeros(BH, HIST_ROW.value, dtype=torch.int32, device=keys.device), 0
    for r in range(first_round, 4):
        _radix_round_kernel[grid](keys, hist, S_PAD, k, CHUNK=chunk, ROUND=r, num_warps=ROUND_WARPS)
    BLOCK_K = max(16, triton.next_power_of_2(k))
    sel_key = torch.empty(BH, BLOCK_K, dtype=torch.int32, device=keys.device)
    sel_pos = torch.empty(BH, BLOCK_K, dtype=torch.int32, device=keys.device)
    _radix_collect_kernel[grid](keys, hist, sel_key, sel_pos, S_PAD, k, CHUNK=chunk, BLOCK_K=BLOCK_K, num_warps=COLLECT_WARPS)
    top_score = torch.empty(BH, k, dtype=torch.float32, device=keys.device)
    top_idx = torch.empty(BH, k, dtype=torch.int64, device=keys.device)
    _radix_order_kernel[(BH,)](sel_key, sel_pos, top_score, top_idx, k, BLOCK_K=BLOCK_K,
                               num_warps=square_tile_warps(BLOCK_K))
    return top_score, top_idx


def topk_lowbit_triton(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None,
                       first: int = 0, chunk: int = 1024, attn_path=None, **launch):
    q_rows, lse_rows = as_rows(q_row, lse_row)
    B, H, R, D = q_rows.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    words, BLOCK_D, k_codes, _, k_lo, _, k_ref, _ = code_layout(store, D)
    plane = planes_for_keys(store, D, q_row.dtype, attn_path)  # (CODES, CODE_OFF) of the bit-plane tiles, or None
    if plane is not None:  # bytes, not words
        k_codes = store.k_codes.contiguous()
    chunk = max(min(chunk, triton.next_power_of_2(S)), store.group_k)
    n_chunks = triton.cdiv(S, chunk)
    BH, G, dev = B * Hkv, H // Hkv, q_row.device
    f = fetched
    K = f.k.shape[2] if f is not None else 0
    keys = torch.empty(BH, n_chunks * chunk, dtype=torch.int32, device=dev)
    hist = torch.zeros(BH, HIST_ROW.value, dtype=torch.int32, device=dev)
    c = lambda x: x.contiguous() if x is not None else q_row  # noqa: E731
    _topk_score_kernel[(BH, n_chunks)](
        q_rows.contiguous(), lse_rows.contiguous(), k_codes, c(k_lo), c(store.k_scale), c(store.k_zero),
        c(store.n_quant), c(f.idx) if f else q_row, f.valid.contiguous().view(torch.uint8) if f else q_row,
        c(f.k) if f else q_row, keys, hist, c(k_ref), c(store.ref_map), float(sm_scale) * LOG2E.value, S,
        n_chunks * chunk, K, D, G, first, store.n_ref, R,
        BITS=store.bits, HIER=store.k_codes_lo is not None, RB=store.ref_bits if store.k_ref is not None else 0,
        WORDS=words, GROUP_K=store.group_k, HAS_FETCH=f is not None,
        DOT=dot_precision(q_row.dtype), UPCAST=interpreter_upcast(q_row.dtype), CHUNK=chunk,
        BLOCK_G=max(16, triton.next_power_of_2(G * R)), BLOCK_D=BLOCK_D,
        BLOCK_F=max(16, triton.next_power_of_2(max(K, 1))), PLANES=plane is not None,
        CODES=plane[0] if plane else 0, CODE_OFF=plane[1] if plane else 0.0,
        **{**({'num_warps': 2} if plane else {}), **launch})  # (planes: 2 warps, fewest instructions per position)
    top_score, top_idx = radix_select_triton(keys, k, chunk, hist)
    return top_score.view(B, Hkv, k), top_idx.view(B, Hkv, k)


# =============================================================================================
# the custom op (CUDA path, opaque to torch.compile) and the public dispatcher
# =============================================================================================
@torch.library.custom_op("specache::topk_lowbit", mutates_args=())
def _topk_lowbit_op(q_row: Tensor, lse_row: Tensor, tensors: list[Tensor], ints: list[int],
                    optional: list[Optional[Tensor]], k: int, sm_scale: float, first: int = 0,
                    attn_path: Optional[str] = None) -> tuple[Tensor, Tensor]:
    store, _, fetched = from_op_inputs(tensors, ints, optional)
    return topk_lowbit_triton(q_row, lse_row, store, k, sm_scale, fetched, first, attn_path=attn_path)


@_topk_lowbit_op.register_fake
def _(q_row, lse_row, tensors, ints, optional, k, sm_scale, first=0, attn_path=None):
    shape = (q_row.shape[0], tensors[0].shape[1], k)
    return q_row.new_empty(shape, dtype=torch.float32), q_row.new_empty(shape, dtype=torch.int64)


def topk_lowbit(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None, first: int = 0,
                use_op=None, attn_path=None):
    """-> (score [B,Hkv,k] fp32, idx [B,Hkv,k] int64), sorted by score; see topk_lowbit_ref for the
    GQA reduction, several selecting tokens and `first`. Slots with score < 0 are invalid (fewer
    than k candidate positions). use_op, attn_path: as kernels.attention_lowbit's."""
    if q_row.is_cuda if use_op is None else use_op:
        tensors, ints, optional = op_inputs(store, Residual(None, None, None), fetched)
        return _topk_lowbit_op(q_row, lse_row, list(tensors[:7]), list(ints), list(optional), k, float(sm_scale), first,
                               attn_path)
    return topk_lowbit_ref(q_row, lse_row, store, k, sm_scale, fetched, first)


# =============================================================================================
# what a layer fetches
# =============================================================================================
def select(q_rows, lse_rows, fetched: Optional[Fetched] = None, *, store: LowBitKV, k: int, sm_scale, first: int = 0,
           use_op=None, attn_path=None, keys: Optional[Tensor] = None, candidates: Optional[int] = None):
    """The rows a SpeCache layer fetches for its selecting query token(s) q_rows [B,H,D] or [B,H,R,D]
    (lse_rows: their softmax normalizers) -> (idx, valid [B,Hkv,k], rerank_by) for Prefetcher.start:
    the top-k quantized positions (below `first`, the sinks: never) by low-bit attention (`fetched`:
    the rows this step attended in fp score exactly, Algorithm 3's A), or by exact attention over the fp
    `keys` (the oracle). With `candidates` (re-ranking), the low-bit top-`candidates` instead, and
    rerank_by = (query rows, lse, sm_scale) that pick the k among them where their keys land (rerank_rows)."""
    if keys is not None:
        score, idx = topk_exact(q_rows, keys, store.n_quant, k, sm_scale, first=first)
    else:
        score, idx = topk_lowbit(q_rows, lse_rows, store, candidates or k, sm_scale, fetched, first=first, use_op=use_op,
                                 attn_path=attn_path)
    return idx, score >= 0, (*as_rows(q_rows, lse_rows), sm_scale) if candidates else None


# =============================================================================================
# re-ranking: the k best of N*k candidates by their fp keys, read from the host (side stream)
# =============================================================================================
# Of the selecting token's low-bit top-(N*k) candidates (name part rrN), the k whose fp keys score best
# go to the ring, with their positions: three launches on the side stream (prefetch.py) where the
# candidates' keys land. One program per candidate reads its fp key and scores it; one per kv head
# ranks the candidates and lays the winners out (record_rows: rows the ring holds stay); one per
# candidate writes a winner the ring lacks. Bus bytes per layer and kv head: N*k keys + at most k values.
RERANK_WARPS = 1  # one candidate per program: more warps only repeat its fixed cost (static count; not timed)
# The layout launch ranks a kv head's candidates in one [C, C] tile: ptxas took 8-39 s at 512 and 170 s at
# 1,024 (sm_90/sm_80, the CPU compile gate), so the GPU path stops at 256 (rerank x k; the reference has no limit).
RERANK_MAX_CANDIDATES = 256


def rerank_rows_ref(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                    sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0):
    """Of the candidate host rows cand [B,Hkv,C] (cand_valid: real ones), keep the K = ring slots - ring_off
    whose fp keys score best for the query rows q_rows [B,H,R,D] (lse_rows [B,H,R]; the score of
    topk.rerank_exact); lay them out in ring slots [ring_off, ...) as record_rows does (a row the
    ring holds keeps its slot, the others, best first, take the freed slots), write the keys and
    values of the rows the ring lacks, their positions and validity (score >= 0) to
    fetch_idx/fetch_valid, and the real token (new_*) to host row new_pos, whose candidate copy is
    taken from new_k/new_v."""
    C = cand.shape[2]
    keys = host_k.gather(2, cand[..., None].expand(*cand.shape, host_k.shape[-1]))
    if new_k is not None:
        keys = torch.where((cand == new_pos)[..., None], new_k.to(keys.dtype), keys)
    score, pick = rerank_exact(q_rows, lse_rows, keys, cand_valid, min(ring_k.shape[2] - ring_off, C), sm_scale)
    rows = record_rows(cand.gather(-1, pick), score >= 0, fetch_idx, fetch_valid, ring_off)
    transfer_rows_ref(host_k, host_v, ring_k, ring_v, rows, new_k, new_v, new_pos, ring_off)


@triton.jit
def _rerank_score_kernel(host_k, cand, cand_valid, q, lse, new_k, new_pos_ptr, keys, score, sm_scale, S, C, D, M,
                         R: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, C): program (bh, c) reads candidate c's fp key (UVA on CUDA; the token's own row
    from new_k), keeps it in the device scratch keys [B*Hkv, C, D] and writes its score
    score[bh, c] = max over r of sum over g of exp(sm_scale * q_{g,r} . k_c - lse_{g,r}) (-1: not
    a candidate) for the kv head's M = G*R query rows (row m = g*R + r). One host row per program,
    as in the transfer: the reads are in flight together instead of one kv head's C rows in turn."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_ok, m_ok = offs_d < D, offs_m < M
    i = tl.load(cand + bh * C + c).to(tl.int64)
    ok = tl.load(cand_valid + bh * C + c) != 0
    new_pos = -1
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    # the ring's dtype: what gets scored is what gets fetched
    key = host_row(host_k, new_k, bh, i, new_pos, S, D, offs_d, HAS_NEW).to(keys.dtype.element_ty)
    tl.store(keys + (bh * C + c) * D + offs_d, key, mask=d_ok)
    qm = tl.load(q + (bh * M + offs_m)[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    logits = tl.sum(qm.to(tl.float32) * key.to(tl.float32)[None, :], 1) * sm_scale  # [BLOCK_M]
    p = tl.exp(logits - tl.load(lse + bh * M + offs_m, mask=m_ok, other=float("inf")))
    best = tl.sum(best_row(p[:, None], offs_m, m_ok, R), 0)
    tl.store(score + bh * C + c, tl.where(ok, best, -1.0))


@triton.jit
def _rerank_layout_kernel(cand, score, fetch_idx, fetch_valid, target, C, K, RING, OFF, BLOCK_C: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Grid (B*Hkv,): rank the kv head's C candidates by score (ties to the lower index, so the top-K
    needs no sort) and lay the K best out as record_rows does: a winner the ring already holds keeps
    its slot; the others, best first, take the freed slots. Writes fetch_idx/fetch_valid [.., RING]
    from slot OFF and target[bh, c], the ring slot candidate c's key and value go to (-1: none,
    not a winner or already held)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    s = tl.load(score + bh * C + offs_c, mask=c_ok, other=-2.0)  # (-2 beats nothing)
    i = tl.load(cand + bh * C + offs_c, mask=c_ok, other=-1)
    ahead = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (offs_c[None, :] < offs_c[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)
    ok = c_ok & (rank < K) & (s >= 0)  # the real winners
    offs_k = tl.arange(0, BLOCK_K)
    put = record_rows_tile(fetch_idx, fetch_valid, bh * RING + OFF + offs_k, offs_k < K, i, ok, rank, BY_RANK=True)
    to_slot = tl.where(tl.max(put.to(tl.int32), 0) > 0, tl.sum(tl.where(put, offs_k[:, None], 0), 0), -1)
    tl.store(target + bh * C + offs_c, to_slot, mask=c_ok)


@triton.jit
def _rerank_pick_kernel(host_k, host_v, ring_k, ring_v, cand, keys, target, new_k, new_v, new_pos_ptr, S, C, D, RING,
                        OFF, HAS_NEW: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, C + 1): program (bh, c < C) writes candidate c's key (from the scratch) and value
    (from the host over UVA; the token's own row from new_v) to ring slot OFF + target[bh, c] if it
    has one: only the winners the ring lacks move their values over the bus. Program C writes the
    step's token to host row new_pos."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new_pos = -1
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    if c < C:
        slot = tl.load(target + bh * C + c)
        if slot >= 0:
            i = tl.load(cand + bh * C + c).to(tl.int64)
            dst = (bh * RING + OFF + slot) * D + offs_d
            tl.store(ring_k + dst, tl.load(keys + (bh * C + c) * D + offs_d, mask=d_ok), mask=d_ok)
            val = host_row(host_v, new_v, bh, i, new_pos, S, D, offs_d, HAS_NEW)
            tl.store(ring_v + dst, val.to(ring_v.dtype.element_ty), mask=d_ok)
    else:
        if HAS_NEW:  # the token's own row to the host (its candidate copies came from new_k/new_v)
            write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs_d)


def rerank_scratch(B, Hkv, C, D, dtype, device):
    """Device scratch of the re-ranking launches: the candidates' fp keys, their scores and ring slots."""
    if C > RERANK_MAX_CANDIDATES:
        raise ValueError(f"re-ranking {C} candidates a kv head (rerank x k) on the GPU: at most {RERANK_MAX_CANDIDATES} "
                         "(one [C, C] tile ranks them); use a smaller k or rerank")
    return (torch.empty(B, Hkv, C, D, dtype=dtype, device=device),
            torch.empty(B, Hkv, C, dtype=torch.float32, device=device),
            torch.empty(B, Hkv, C, dtype=torch.int32, device=device))


def rerank_rows_triton(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                       sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0, scratch=None):
    """rerank_rows_ref in three launches: one program per candidate (read its key, score it), one
    per kv head (rank, lay out the winners), one per candidate (move a winner the ring lacks).
    scratch: rerank_scratch(...) (the Prefetcher preallocates one, shared by its layers: the side
    stream runs them in turn); allocated here when None."""
    B, Hkv, S, D = host_k.shape
    C, (H, R) = cand.shape[2], q_rows.shape[1:3]
    for t in (host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid):
        assert t.is_contiguous()
    keys, score, target = scratch if scratch is not None else rerank_scratch(B, Hkv, C, D, ring_k.dtype, ring_k.device)
    assert keys.shape == (B, Hkv, C, D) and keys.dtype == ring_k.dtype and score.shape == target.shape == (B, Hkv, C)
    has_new, any_t = new_k is not None, ring_k  # absent inputs: any valid pointer
    new_k, new_v, pos = (new_k.contiguous(), new_v.contiguous(), new_pos) if has_new else (any_t, any_t, any_t)
    cand, M, BLOCK_D = cand.contiguous(), H // Hkv * R, triton.next_power_of_2(D)
    K = min(ring_k.shape[2] - ring_off, C)
    _rerank_score_kernel[(B * Hkv, C)](
        host_k, cand, cand_valid.contiguous().view(torch.int8), q_rows.contiguous(), lse_rows.float().contiguous(),
        new_k, pos, keys, score, float(sm_scale), S, C, D, M, R,
        HAS_NEW=has_new, BLOCK_M=triton.next_power_of_2(M), BLOCK_D=BLOCK_D, num_warps=RERANK_WARPS)
    _rerank_layout_kernel[(B * Hkv,)](cand, score, fetch_idx, fetch_valid.view(torch.int8), target, C, K,
                                      ring_k.shape[2], ring_off, BLOCK_C=triton.next_power_of_2(C),
                                      BLOCK_K=triton.next_power_of_2(K),
                                      num_warps=max(8, square_tile_warps(triton.next_power_of_2(C))))  # ([C, C] ranks)
    _rerank_pick_kernel[(B * Hkv, C + 1)](
        host_k, host_v, ring_k, ring_v, cand, keys, target, new_k, new_v, pos, S, C, D, ring_k.shape[2], ring_off,
        HAS_NEW=has_new, BLOCK_D=BLOCK_D, num_warps=RERANK_WARPS)


def rerank_rows(*args, scratch=None, **kw):
    """The re-ranking transfer on the current stream: the Triton kernels when the ring is on CUDA, else the reference."""
    if args[2].is_cuda:
        rerank_rows_triton(*args, scratch=scratch, **kw)
    else:
        rerank_rows_ref(*args, **kw)
