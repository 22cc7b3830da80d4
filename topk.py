"""Top-k selection: which quantized positions' fp16 rows to fetch (SpeCache §3.3, Algorithm 3's ArgTopK).

  topk_lowbit   the k positions with the largest attention probability under the selecting query
                token(s), scored over the low-bit keys (the speculative token's row; several rows:
                the best of them), summed over the query heads that share a kv head (GQA: one
                fetch per kv head serves all its query heads); fetched positions score with their
                fp rows.
  topk_exact    the same top-k from full-precision keys (oracle fetch, hit rates).
  rerank_exact  the k best of N*k candidates by their fp keys (re-ranking, transfer.py).

A torch reference beside each Triton kernel; the public functions dispatch on the device as
kernels.py's do (CUDA: Triton behind a custom op; CPU: the reference).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

import kernels
from kernels import (LOG2E, Fetched, LowBitKV, Residual, Tensor, _code_layout, _dot_precision, _flat, _key_group,
                     _load_codes, _unflat, _upcast, key_logits)


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def _row_scores(logits, lse_rows, G, R):
    """logits [B,Hkv,G*R,N] of query rows m = g*R + r -> score [B,Hkv,N]: the attention probability
    summed over the kv head's G query heads, the best of the R query tokens."""
    B, Hkv, _, N = logits.shape
    p = torch.exp(logits - lse_rows.float().reshape(B, Hkv, G * R, 1))
    return p.view(B, Hkv, G, R, N).sum(2).amax(2)


def _as_rows(q_row, lse_row):
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
    q_rows, lse_rows = _as_rows(q_row, lse_row)
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
    prob = _fp_row_scores(*_as_rows(q_row, lse_row), keys, sm_scale)
    return torch.where(valid, prob, -1.0).topk(k, dim=-1)


# =============================================================================================
# Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)
# =============================================================================================
@triton.jit
def _topk_chunk_kernel(q, lse, k_codes, k_lo, k_scale, k_zero, n_quant_ptr, f_idx, f_valid, f_k, scratch, cand,
                       k_ref, ref_map, qk_scale, S, S_PAD, K, D, G, FIRST, N_REF, R: tl.constexpr,
                       BITS: tl.constexpr, HIER: tl.constexpr, RB: tl.constexpr, WORDS: tl.constexpr, GROUP_K: tl.constexpr,
                       HAS_FETCH: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_G: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr):
    """Grid (B*Hkv, n_chunks). Scores one chunk of CHUNK quantized positions for the selecting query
    tokens (R of them, rows m = g*R + r): score[p] = max_r sum_g 2^(q_gr.k'_p - lse_gr) (the
    attention probability summed over the kv head's query heads, the best token's; fetched positions
    use their fp rows), and keeps the chunk's BLOCK_K best as int64 keys (score bits << 32 |
    position) for _topk_merge_kernel. Positions below FIRST are never candidates."""
    bh = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G * R
    d_ok = offs_d < D
    dt = q.dtype.element_ty
    if UPCAST:
        dt = tl.float32
    qt = tl.load(q + (bh * G * R + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                 other=0.0)
    qt = qt.to(tl.float32) * qk_scale
    lse_g = tl.load(lse + bh * G * R + offs_g, mask=g_ok, other=float("inf")).to(tl.float32) * 1.4426950408889634
    offs_k = tl.arange(0, BLOCK_K)
    offs_f = tl.arange(0, BLOCK_F)
    if HAS_FETCH:  # exact probabilities of the fetched rows (Algorithm 3's A)
        f_ok = offs_f < K
        valid = tl.load(f_valid + bh * K + offs_f, mask=f_ok, other=0) != 0
        fidx = tl.where(valid, tl.load(f_idx + bh * K + offs_f, mask=f_ok, other=-1), -1)
        fk = tl.load(f_k + (bh * K + offs_f[:, None]) * D + offs_d[None, :], mask=valid[:, None] & d_ok[None, :],
                     other=0.0).to(dt)
        fs = tl.exp2(tl.dot(qt.to(dt), tl.trans(fk), input_precision=DOT) - lse_g[:, None])
        f_exact = _best_row(fs, offs_g, g_ok, R)  # [BLOCK_F]
    lo = chunk * CHUNK
    hi = tl.minimum(tl.load(n_quant_ptr), S)
    for n0 in range(0, CHUNK, GROUP_K):
        offs_n = lo + n0 + tl.arange(0, GROUP_K)
        n_ok = (offs_n < hi) & (offs_n >= FIRST)
        rows = bh * S + offs_n
        grp_ok = offs_d < tl.where(lo + n0 < hi, D, 0)  # (block & scalar-bool masks break the interpreter)
        sk, zk, ref_rows, ref_ok = _key_group(k_scale, k_zero, ref_map, rows, n_ok, bh * (S // GROUP_K) + (lo + n0) // GROUP_K,
                                              offs_d, grp_ok, D, N_REF, HIER, RB)
        ck = _load_codes(k_codes, k_lo, rows, n_ok, offs_d, D, k_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS,
                         GROUP_K, BLOCK_D)
        s = tl.dot((qt * sk[None, :]).to(dt), tl.trans(ck.to(dt)), input_precision=DOT)
        s = s + tl.sum(qt * zk[None, :], 1)[:, None]
        prob = _best_row(tl.exp2(s - lse_g[:, None]), offs_g, g_ok, R)
        if HAS_FETCH:
            hit = offs_n[:, None] == fidx[None, :]
            exact = tl.sum(tl.where(hit, f_exact[None, :], 0.0), 1)
            prob = tl.where(tl.max(hit.to(tl.int32), 1) > 0, exact, prob)
        tl.store(scratch + bh * S_PAD + offs_n, tl.where(n_ok, prob, -1.0))
    tl.debug_barrier()  # the chunk's scores, written by all threads, are read back by all threads
    offs_c = tl.arange(0, CHUNK)
    x = tl.load(scratch + bh * S_PAD + lo + offs_c)
    key = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (lo + offs_c).to(tl.int64)
    top = tl.topk(key, BLOCK_K)
    tl.store(cand + (bh * tl.num_programs(1) + chunk) * BLOCK_K + offs_k, top)


@triton.jit
def _best_row(p, offs_g, g_ok, R: tl.constexpr):
    """p [BLOCK_G, N] probabilities of query rows m = g*R + r -> max_r sum_g p: [N]."""
    best = tl.sum(tl.where((g_ok & (offs_g % R == 0))[:, None], p, 0.0), 0)
    for r in tl.static_range(1, R):
        best = tl.maximum(best, tl.sum(tl.where((g_ok & (offs_g % R == r))[:, None], p, 0.0), 0))
    return best


@triton.jit
def _topk_merge_kernel(cand, out_keys, top_score, top_idx, N_CAND, PER_PROG, K, BLOCK_K: tl.constexpr,
                       BLOCK_C: tl.constexpr, FINAL: tl.constexpr):
    """Grid (B*Hkv, n_groups): the best BLOCK_K of candidates [g*PER_PROG, +PER_PROG) of a kv head.
    Not FINAL: -> keys out_keys[bh, g*BLOCK_K:], for another round. FINAL (one group): -> (score,
    position); slots without a valid position (fewer than K quantized) get score -1 and position 0."""
    bh = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    offs = grp * PER_PROG + tl.arange(0, BLOCK_C)
    keys = tl.load(cand + bh * N_CAND + offs, mask=(offs < N_CAND) & (offs < (grp + 1) * PER_PROG), other=-(2**62))
    top = tl.topk(keys, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    if FINAL:
        score = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        valid = score >= 0
        tl.store(top_score + bh * K + offs_k, tl.where(valid, score, -1.0), mask=offs_k < K)
        tl.store(top_idx + bh * K + offs_k, tl.where(valid, top & 0xFFFFFFFF, 0), mask=offs_k < K)
    else:
        tl.store(out_keys + (bh * tl.num_programs(1) + grp) * BLOCK_K + offs_k, top)


MERGE_FAN = 8  # candidate lists per merge program


def topk_lowbit_triton(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None,
                       first: int = 0, chunk: int = 1024, **launch):
    q_rows, lse_rows = _as_rows(q_row, lse_row)
    B, H, R, D = q_rows.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    words, BLOCK_D, k_codes, _, k_lo, _, k_ref, _ = _code_layout(store, D)
    BLOCK_K = max(16, triton.next_power_of_2(k))
    chunk = max(min(chunk, triton.next_power_of_2(S)), BLOCK_K, store.group_k)
    n_chunks = triton.cdiv(S, chunk)
    BH, G, dev = B * Hkv, H // Hkv, q_row.device
    f = fetched
    K = f.k.shape[2] if f is not None else 0
    scratch = torch.empty(BH, n_chunks * chunk, dtype=torch.float32, device=dev)
    cand = torch.empty(BH, n_chunks * BLOCK_K, dtype=torch.int64, device=dev)
    c = lambda x: x.contiguous() if x is not None else q_row  # noqa: E731
    _topk_chunk_kernel[(BH, n_chunks)](
        q_rows.contiguous(), lse_rows.contiguous(), k_codes, c(k_lo), c(store.k_scale), c(store.k_zero),
        c(store.n_quant), c(f.idx) if f else q_row, f.valid.contiguous().view(torch.uint8) if f else q_row,
        c(f.k) if f else q_row, scratch, cand, c(k_ref), c(store.ref_map), float(sm_scale) * LOG2E, S,
        n_chunks * chunk, K, D, G, first, store.n_ref, R,
        BITS=store.bits, HIER=store.k_codes_lo is not None, RB=store.ref_bits if store.k_ref is not None else 0,
        WORDS=words, GROUP_K=store.group_k, HAS_FETCH=f is not None,
        DOT=_dot_precision(q_row.dtype), UPCAST=_upcast(q_row.dtype), CHUNK=chunk,
        BLOCK_G=max(16, triton.next_power_of_2(G * R)), BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K,
        BLOCK_F=max(16, triton.next_power_of_2(max(K, 1))), **launch)
    top_score = torch.empty(B, Hkv, k, dtype=torch.float32, device=dev)
    top_idx = torch.empty(B, Hkv, k, dtype=torch.int64, device=dev)
    # merge the chunks' candidates MERGE_FAN lists at a time: one program sorting all of them (33
    # lists of 64 at 32k, padded to 4,096 keys) took 50 us per layer on an H100; lists of 512 sort fast
    n = n_chunks
    while n > MERGE_FAN:
        groups = triton.cdiv(n, MERGE_FAN)
        nxt = torch.empty(BH, groups * BLOCK_K, dtype=torch.int64, device=dev)
        _topk_merge_kernel[(BH, groups)](cand, nxt, top_score, top_idx, n * BLOCK_K, MERGE_FAN * BLOCK_K, k,
                                         BLOCK_K=BLOCK_K, BLOCK_C=MERGE_FAN * BLOCK_K, FINAL=False)
        cand, n = nxt, groups
    _topk_merge_kernel[(BH, 1)](cand, cand, top_score, top_idx, n * BLOCK_K, n * BLOCK_K, k, BLOCK_K=BLOCK_K,
                                BLOCK_C=triton.next_power_of_2(n * BLOCK_K), FINAL=True)
    return top_score, top_idx


# =============================================================================================
# the custom op (CUDA path, opaque to torch.compile) and the public dispatcher
# =============================================================================================
@torch.library.custom_op("specache::topk_lowbit", mutates_args=())
def _topk_lowbit_op(q_row: Tensor, lse_row: Tensor, tensors: list[Tensor], ints: list[int],
                    optional: list[Optional[Tensor]], k: int, sm_scale: float, first: int = 0) -> tuple[Tensor, Tensor]:
    store, _, fetched = _unflat(tensors, ints, optional)
    return topk_lowbit_triton(q_row, lse_row, store, k, sm_scale, fetched, first)


@_topk_lowbit_op.register_fake
def _(q_row, lse_row, tensors, ints, optional, k, sm_scale, first=0):
    shape = (q_row.shape[0], tensors[0].shape[1], k)
    return q_row.new_empty(shape, dtype=torch.float32), q_row.new_empty(shape, dtype=torch.int64)


def topk_lowbit(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None, first: int = 0):
    """-> (score [B,Hkv,k] fp32, idx [B,Hkv,k] int64), sorted by score; see topk_lowbit_ref for the
    GQA reduction, several selecting tokens and `first`. Slots with score < 0 are invalid (fewer
    than k candidate positions)."""
    if q_row.is_cuda or kernels._ops_on_cpu:
        tensors, ints, optional = _flat(store, Residual(None, None, None), fetched)
        return _topk_lowbit_op(q_row, lse_row, list(tensors[:7]), list(ints), list(optional), k, float(sm_scale), first)
    return topk_lowbit_ref(q_row, lse_row, store, k, sm_scale, fetched, first)
