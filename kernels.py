"""Decode-time kernels over the low-bit device cache (SpeCache §3.2-3.4).

  attention_lowbit  attention of T new query tokens over
                      quantized slots [0, n_quant)  (codes dequantized on the fly),
                      minus the slots whose fp rows were fetched (eq. 1: C' ∪ C_K replaces C'_K),
                      plus the fetched fp rows and the fp residual window (causal among the new tokens).
  topk_lowbit       top-k quantized positions by attention probability of one (speculative) query.
  topk_exact        the same top-k from full-precision keys (oracle fetch, hit rates).

What they read is described by three small tuples: LowBitKV (the stored codes and their scales),
Residual (the fp window) and Fetched (fp rows fetched from the host and the positions they replace).

GQA: H = Hkv * G query heads, query head h reads kv head h // G. A query block of one kv head
is the G*T rows m = g*T + t, contiguous in a [B, H, T, D] tensor.

Each public function dispatches on the device: CUDA -> Triton kernel behind a torch.library
custom op (so torch.compile(fullgraph=True) can call it); CPU -> the torch reference inline,
written with static shapes (masks over all S slots, no slicing by n_quant, garbage past the valid
lengths masked out) so one compiled graph serves every step. The Triton launchers (`*_triton`)
also run on CPU tensors under TRITON_INTERPRET=1, which is how the tests check them against the
references.
"""
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

import quant

Tensor = torch.Tensor


class LowBitKV(NamedTuple):
    """The quantized tokens of a low-bit cache (cache.LowBitCache.stored()). Slots [0, n_quant) hold
    tokens; the rest is garbage the kernels never read into a result."""
    k_codes: Tensor  # [B,Hkv,S,D*bits/8] uint8; keys quantized per channel in groups of group_k tokens
    k_scale: Tensor  # [B,Hkv,S/group_k,D] (16-bit)
    k_zero: Tensor
    v_codes: Tensor  # [B,Hkv,S,D*bits/8] uint8; values quantized per token in groups of group_v channels
    v_scale: Tensor  # [B,Hkv,S,D/group_v]
    v_zero: Tensor
    n_quant: Tensor  # 0-d int64
    bits: int
    group_k: int
    group_v: int
    k_codes_lo: Optional[Tensor] = None  # QuantSpec's 8-bit view: the lower 4-bit planes (bits == 4)
    v_codes_lo: Optional[Tensor] = None
    v_chan: Optional[Tensor] = None  # ZipCache: per-channel value scale [B,Hkv,D] (eq. 6)


class Residual(NamedTuple):
    """The fp window: rows [0, length) hold the newest tokens in order; a step's T query tokens are
    its last T rows (causal among them)."""
    k: Tensor  # [B,Hkv,R,D]
    v: Tensor
    length: Tensor  # 0-d


class Fetched(NamedTuple):
    """fp rows fetched from the host store; they replace quantized positions idx where valid."""
    k: Tensor  # [B,Hkv,K,D]
    v: Tensor
    idx: Tensor  # [B,Hkv,K] int64
    valid: Tensor  # [B,Hkv,K] bool


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def dequant_keys(s: LowBitKV) -> Tensor:
    """Keys in fp32 [B,Hkv,S,D] (KIVI; QuantSpec's 8-bit view when k_codes_lo is given)."""
    if s.k_codes_lo is not None:
        return quant.dequantize_hier_keys(s.k_codes, s.k_codes_lo, s.k_scale, s.k_zero, s.group_k, view_bits=8)
    return quant.dequantize_keys(s.k_codes, s.k_scale, s.k_zero, s.bits, s.group_k)


def dequant_values(s: LowBitKV) -> Tensor:
    """Values in fp32 [B,Hkv,S,D] (KIVI; QuantSpec 8-bit view; ZipCache's channel scale)."""
    if s.v_codes_lo is not None:
        v = quant.dequantize_hier_values(s.v_codes, s.v_codes_lo, s.v_scale, s.v_zero, s.group_v, view_bits=8)
    else:
        v = quant.dequantize_values(s.v_codes, s.v_scale, s.v_zero, s.bits, s.group_v)
    if s.v_chan is not None:  # ZipCache eq. 6: x' = dequant * c
        v = v * s.v_chan.float()[..., None, :]
    return v


def replaced_mask(fetched: Fetched, S: int) -> Tensor:
    """[B,Hkv,S] bool: quantized slots whose fp row was fetched. Unused fetch slots point at S-1,
    a scratch slot that is never attended."""
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return torch.zeros(*fetched.idx.shape[:2], S, dtype=torch.bool, device=fetched.idx.device).scatter(2, safe, fetched.valid)


def attention_lowbit_ref(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale):
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    G, dev = H // Hkv, q.device
    M = G * T
    qg = q.float().reshape(B, Hkv, M, D) * sm_scale

    keep_q = (torch.arange(S, device=dev) < store.n_quant).expand(B, Hkv, S)
    if fetched is not None:  # eq. 1: a fetched fp row replaces its quantized copy
        keep_q = keep_q & ~replaced_mask(fetched, S)
    t = torch.arange(M, device=dev) % T  # query row m = g*T + t sees residual rows < length - T + t + 1
    res_len = residual.length
    keep_res = torch.arange(R, device=dev) < res_len - T + 1 + t[:, None]  # [M, R]
    # (keys, values, keep per key row, keep per (query row, key row)) of each part
    parts = [(dequant_keys(store), dequant_values(store), keep_q, keep_q[:, :, None, :]),
             (residual.k, residual.v, (torch.arange(R, device=dev) < res_len).expand(B, Hkv, R), keep_res)]
    if fetched is not None:
        parts.append((fetched.k, fetched.v, fetched.valid, fetched.valid[:, :, None, :]))

    scores = torch.cat([torch.where(keep, qg @ k.float().transpose(-1, -2), -math.inf)
                        for k, _, _, keep in parts], -1)  # [B, Hkv, M, S + R (+ K)]
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(scores - m)
    l = p.sum(-1, keepdim=True)
    out, col = 0.0, 0
    for _, v, keep_rows, _ in parts:  # garbage rows are zeroed: NaN would leak through p = 0
        n = v.shape[2]
        out = out + p[..., col:col + n] @ torch.where(keep_rows[..., None], v.float(), 0.0)
        col += n
    out = out / torch.where(l > 0, l, 1.0)
    lse = (m + torch.log(l)).squeeze(-1)
    return out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)


def _exact_fetched_scores(prob, q_row, lse_row, sm_scale, fetched: Fetched):
    """Algorithm 3 takes ArgTopK of the attention that already used the fetched fp rows: their
    positions get exact scores, so a row that matters keeps its place whatever its low-bit copy
    scores. Invalid fetch slots write back the scratch slot's own value (position S-1 >= n_quant)."""
    B, H, D = q_row.shape
    Hkv, S = prob.shape[1], prob.shape[2]
    qg = q_row.float().reshape(B, Hkv, H // Hkv, D) * sm_scale
    exact = torch.exp(qg @ fetched.k.float().transpose(-1, -2) - lse_row.float().reshape(B, Hkv, -1, 1)).sum(2)
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return prob.scatter(-1, safe, torch.where(fetched.valid, exact, prob.gather(-1, safe)))


def topk_lowbit_ref(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None):
    """score[p] = sum over the G query heads of kv head j of exp(sm_scale * q_g . k'_p - lse_g): the
    attention probability kv row p would get, summed over the heads that share it (one fetch per
    kv head serves all G heads); with `fetched`, fetched positions score with their fp rows.
    Positions p >= n_quant score -1 with index 0. Sorted descending."""
    B, H, D = q_row.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    G = H // Hkv
    keys = dequant_keys(store)  # [B,Hkv,S,D]
    logits = (q_row.float().reshape(B, Hkv, G, D) * sm_scale) @ keys.transpose(-1, -2)  # [B,Hkv,G,S]
    prob = torch.exp(logits - lse_row.float().reshape(B, Hkv, G, 1)).sum(2)
    if fetched is not None:
        prob = _exact_fetched_scores(prob, q_row, lse_row, sm_scale, fetched)
    valid = torch.arange(S, device=q_row.device) < store.n_quant
    score, idx = torch.where(valid, prob, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


def topk_exact(q_row, keys, n_quant, k, sm_scale):
    """Top-k of quantized positions [0, n_quant) by exact fp attention of q_row [B,H,D] against
    full-precision keys [B,Hkv,S,D], probabilities summed over each kv head's query heads (the
    reduction of topk_lowbit). The oracle fetch and the hit-rate measurement use it."""
    B, H, D = q_row.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    qg = q_row.float().view(B, Hkv, H // Hkv, D)
    scores = torch.einsum("bhgd,bhsd->bhgs", qg, keys.float()) * sm_scale
    valid = torch.arange(S, device=q_row.device) < n_quant
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).sum(2)  # [B,Hkv,S]
    return torch.where(valid, probs, -1.0).topk(k, dim=-1)


# =============================================================================================
# Triton kernels
# =============================================================================================
@triton.jit
def _dequant_tile(codes, codes_lo, scale, zero, rows, offs_d, mask, D,
                  BITS: tl.constexpr, GROUP_T: tl.constexpr, GROUP_D: tl.constexpr, HIER: tl.constexpr):
    """x' = code * s + z of a [BLOCK_N, BLOCK_D] tile, in registers. `rows` are flat row indices
    (bh * S + n) of a contiguous [B, Hkv, S, D*BITS//8] code tensor; the meta tensor has one
    entry per GROUP_T rows and GROUP_D channels (keys: GROUP_T = g_k, values: GROUP_D = g_v)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    byte = rows[:, None] * (D // PER_BYTE) + offs_d[None, :] // PER_BYTE
    shift = ((offs_d % PER_BYTE) * BITS)[None, :]
    code = (tl.load(codes + byte, mask=mask, other=0).to(tl.int32) >> shift) & (2**BITS - 1)
    meta = (rows[:, None] // GROUP_T) * (D // GROUP_D) + offs_d[None, :] // GROUP_D
    s = tl.load(scale + meta, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zero + meta, mask=mask, other=0.0).to(tl.float32)
    if HIER:  # QuantSpec 8-bit view: (16 U + L - 8) * s4/16 + z
        lower = (tl.load(codes_lo + byte, mask=mask, other=0).to(tl.int32) >> shift) & 15
        code = 16 * code + lower - 8
        s = s / 16
    return code.to(tl.float32) * s + z


@triton.jit
def _softmax_step(scores, v, m_i, l_i, acc, DOT: tl.constexpr):
    """One online-softmax update (flash attention); masked scores are -inf, masked v rows 0."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)


@triton.jit
def _attn_split_kernel(q, k_codes, k_codes_lo, k_scale, k_zero, v_codes, v_codes_lo, v_scale, v_zero, v_chan,
                       n_quant_ptr, replaced, k_res, v_res, res_len_ptr, k_fetch, v_fetch, fetch_valid,
                       out_part, lse_part, sm_scale, S, R, K_FETCH, D, T, M, SPLIT_LEN,
                       BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP_K: tl.constexpr, GROUP_V: tl.constexpr,
                       K_HIER: tl.constexpr, V_HIER: tl.constexpr, HAS_FETCH: tl.constexpr,
                       HAS_REPLACED: tl.constexpr, HAS_CHAN: tl.constexpr, DOT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, n_splits + 1). Programs 0..n_splits-1 each take SPLIT_LEN quantized slots
    (flash-decoding); the last program takes the fetched rows and the residual window. Each
    writes a partial (out, lse) for its G*T query rows; _attn_combine_kernel merges them."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_programs = tl.num_programs(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_b = tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    d_ok = offs_d < D
    md_ok = m_ok[:, None] & d_ok[None, :]
    qt = tl.load(q + (bh * M + offs_m[:, None]) * D + offs_d[None, :], mask=md_ok, other=0.0).to(tl.float32)
    qt = qt * sm_scale
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    is_fp = split == n_programs - 1

    # quantized slots [lo, hi) of this split; blocks at or past n_quant are never visited
    lo = split * SPLIT_LEN
    hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, tl.load(n_quant_ptr)), S)
    hi = tl.where(is_fp, lo, hi)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_b
        n_ok = offs_n < hi
        if HAS_REPLACED:
            n_ok = n_ok & (tl.load(replaced + bh * S + offs_n, mask=n_ok, other=1) == 0)
        nd_ok = n_ok[:, None] & d_ok[None, :]
        rows = bh * S + offs_n
        kt = _dequant_tile(k_codes, k_codes_lo, k_scale, k_zero, rows, offs_d, nd_ok, D, BITS_K, GROUP_K, 1, K_HIER)
        vt = _dequant_tile(v_codes, v_codes_lo, v_scale, v_zero, rows, offs_d, nd_ok, D, BITS_V, 1, GROUP_V, V_HIER)
        if HAS_CHAN:
            vt = vt * tl.load(v_chan + bh * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        scores = tl.where(n_ok[None, :], tl.dot(qt, tl.trans(kt), input_precision=DOT), -float("inf"))
        m_i, l_i, acc = _softmax_step(scores, vt, m_i, l_i, acc, DOT)

    if HAS_FETCH:  # fetched fp rows (only the last program)
        f_hi = tl.where(is_fp, K_FETCH, 0)
        for f0 in range(0, f_hi, BLOCK_N):
            offs_f = f0 + offs_b
            f_ok = offs_f < K_FETCH
            f_ok = f_ok & (tl.load(fetch_valid + bh * K_FETCH + offs_f, mask=f_ok, other=0) != 0)
            fd_ok = f_ok[:, None] & d_ok[None, :]
            ptr = (bh * K_FETCH + offs_f[:, None]) * D + offs_d[None, :]
            kt = tl.load(k_fetch + ptr, mask=fd_ok, other=0.0).to(tl.float32)
            vt = tl.load(v_fetch + ptr, mask=fd_ok, other=0.0).to(tl.float32)
            scores = tl.where(f_ok[None, :], tl.dot(qt, tl.trans(kt), input_precision=DOT), -float("inf"))
            m_i, l_i, acc = _softmax_step(scores, vt, m_i, l_i, acc, DOT)

    # fp residual rows [0, res_len); query row m (token t = m % T) sees rows < res_len - T + t + 1
    res_len = tl.load(res_len_ptr)
    r_hi = tl.where(is_fp, tl.minimum(res_len, R), 0)
    limit = res_len - T + 1 + offs_m % T
    for r0 in range(0, r_hi, BLOCK_N):
        offs_r = r0 + offs_b
        r_ok = offs_r < r_hi
        rd_ok = r_ok[:, None] & d_ok[None, :]
        ptr = (bh * R + offs_r[:, None]) * D + offs_d[None, :]
        kt = tl.load(k_res + ptr, mask=rd_ok, other=0.0).to(tl.float32)
        vt = tl.load(v_res + ptr, mask=rd_ok, other=0.0).to(tl.float32)
        causal = r_ok[None, :] & (offs_r[None, :] < limit[:, None])
        scores = tl.where(causal, tl.dot(qt, tl.trans(kt), input_precision=DOT), -float("inf"))
        m_i, l_i, acc = _softmax_step(scores, vt, m_i, l_i, acc, DOT)

    has = l_i > 0
    part = (bh * n_programs + split) * M + offs_m
    tl.store(out_part + part[:, None] * D + offs_d[None, :], acc / tl.where(has, l_i, 1.0)[:, None], mask=md_ok)
    tl.store(lse_part + part, tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -float("inf")), mask=m_ok)


@triton.jit
def _attn_combine_kernel(out_part, lse_part, out, lse, NS, M, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, G*T): out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s."""
    bh = tl.program_id(0)
    m = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NS
    d_ok = offs_d < D
    part = (bh * NS + offs_s) * M + m
    lse_s = tl.load(lse_part + part, mask=s_ok, other=-float("inf"))
    mx = tl.max(lse_s, 0)
    mx = tl.where(mx == -float("inf"), 0.0, mx)
    w = tl.exp(lse_s - mx)
    o = tl.load(out_part + part[:, None] * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    has = total > 0  # false only if nothing at all was attended: out 0, lse -inf (as the reference)
    safe_total = tl.where(has, total, 1.0)
    res = tl.sum(w[:, None] * o, 0) / safe_total
    tl.store(out + (bh * M + m) * D + offs_d, res.to(out.dtype.element_ty), mask=d_ok)
    tl.store(lse + bh * M + m, tl.where(has, mx + tl.log(safe_total), -float("inf")))


@triton.jit
def _topk_score_kernel(q, k_codes, k_codes_lo, k_scale, k_zero, n_quant_ptr, lse, score, sm_scale, S, D, G,
                       BITS_K: tl.constexpr, GROUP_K: tl.constexpr, K_HIER: tl.constexpr, DOT: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, cdiv(S, BLOCK_N)): score[bh, p] = sum_g exp(sm_scale q_g.k'_p - lse_g), -1 past n_quant."""
    bh = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_ok = offs_d < D
    n_ok = offs_n < tl.minimum(tl.load(n_quant_ptr), S)
    qt = tl.load(q + (bh * G + offs_g[:, None]) * D + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    qt = qt.to(tl.float32) * sm_scale
    lse_g = tl.load(lse + bh * G + offs_g, mask=g_ok, other=0.0).to(tl.float32)
    kt = _dequant_tile(k_codes, k_codes_lo, k_scale, k_zero, bh * S + offs_n, offs_d, n_ok[:, None] & d_ok[None, :],
                       D, BITS_K, GROUP_K, 1, K_HIER)
    p = tl.exp(tl.dot(qt, tl.trans(kt), input_precision=DOT) - lse_g[:, None])
    prob = tl.sum(tl.where(g_ok[:, None], p, 0.0), 0)
    tl.store(score + bh * S + offs_n, tl.where(n_ok, prob, -1.0), mask=offs_n < S)


@triton.jit
def _score_keys(score, row, offs, S):
    """Scores as int32 keys ordered like the scores: a non-negative fp32 orders like its bit
    pattern; invalid (-1 or NaN) -> -1; padding past S -> -2 (never selected)."""
    x = tl.load(score + row * S + offs, mask=offs < S, other=-1.0)
    key = tl.where(x >= 0, tl.minimum(x.to(tl.int32, bitcast=True), 0x7F800000), -1)
    return x, tl.where(offs < S, key, -2)


@triton.jit
def _topk_select_kernel(score, top_score, top_idx, S, K, BLOCK: tl.constexpr):
    """Grid (rows,): threshold selection. Binary search for the largest key thr with
    #(key >= thr) >= K, then write every key > thr and the first (K - #(key > thr)) keys == thr.
    Output order: the > thr entries by position, then the ties. Needs K <= S."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    lo = tl.full([], -1, tl.int32)
    hi = tl.full([], 0x7F800000, tl.int32)
    for _step in range(32):  # (not `_`: it is reassigned below, which the compiler rejects)
        mid = lo + (hi - lo + 1) // 2
        count = tl.zeros([], tl.int32)
        for s0 in range(0, S, BLOCK):
            _x, key = _score_keys(score, row, s0 + offs, S)
            count += tl.sum((key >= mid).to(tl.int32), 0)
        lo = tl.where(count >= K, mid, lo)
        hi = tl.where(count >= K, hi, mid - 1)
    n_above = tl.zeros([], tl.int32)
    for s0 in range(0, S, BLOCK):
        _x, key = _score_keys(score, row, s0 + offs, S)
        n_above += tl.sum((key > lo).to(tl.int32), 0)
    seen_above = tl.zeros([], tl.int32)
    seen_tie = tl.zeros([], tl.int32)
    for s0 in range(0, S, BLOCK):
        x, key = _score_keys(score, row, s0 + offs, S)
        above = key > lo
        tie = key == lo
        slot = tl.where(above, seen_above + tl.cumsum(above.to(tl.int32), 0),
                        n_above + seen_tie + tl.cumsum(tie.to(tl.int32), 0)) - 1
        take = (above | tie) & (slot < K)
        valid = key >= 0
        tl.store(top_score + row * K + slot, tl.where(valid, x, -1.0), mask=take)
        tl.store(top_idx + row * K + slot, tl.where(valid, s0 + offs, 0).to(tl.int64), mask=take)
        seen_above += tl.sum(above.to(tl.int32), 0)
        seen_tie += tl.sum(tie.to(tl.int32), 0)


# =============================================================================================
# Triton launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)
# =============================================================================================
def _block_n(group_k):
    if group_k & (group_k - 1):
        raise ValueError(f"Triton kernels need a power-of-two key group, got {group_k}")
    return max(64, group_k)  # a multiple of the key group


def _dot_precision(dtype):
    """fp32 is the reference precision: IEEE dots (Triton's default for fp32 is TF32, ~1e-3 off).
    16-bit models keep tensor-core dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _u8(mask):  # bool -> uint8 view (same bytes), the pointer type every Triton version loads
    return mask.contiguous().view(torch.uint8)


def attention_lowbit_triton(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale,
                            n_splits=None):
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    M, BH = (H // Hkv) * T, B * Hkv
    group_v = min(store.group_v, D)
    assert store.k_scale.shape[2] * store.group_k == S, "quantized slots must be a whole number of key groups"
    BLOCK_N = _block_n(store.group_k)
    n_blocks = triton.cdiv(S, BLOCK_N)
    if n_splits is None:  # enough programs to fill a GPU (~128), never more splits than blocks
        n_splits = min(n_blocks, max(1, 128 // BH))
    split_len = triton.cdiv(n_blocks, max(1, n_splits)) * BLOCK_N
    n_splits = max(1, triton.cdiv(S, split_len))
    NS = n_splits + 1  # + the program for fetched and residual rows

    c = lambda x: x.contiguous() if x is not None else q  # noqa: E731 (absent inputs: any valid pointer)
    fetch = fetched is not None
    replaced = replaced_mask(fetched, S) if fetch else None
    q = q.contiguous()
    out_part = torch.empty(BH, NS, M, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(BH, NS, M, dtype=torch.float32, device=q.device)
    _attn_split_kernel[(BH, NS)](
        q, c(store.k_codes), c(store.k_codes_lo), c(store.k_scale), c(store.k_zero), c(store.v_codes),
        c(store.v_codes_lo), c(store.v_scale), c(store.v_zero), c(store.v_chan), c(store.n_quant),
        _u8(replaced) if fetch else q, c(residual.k), c(residual.v), c(residual.length),
        c(fetched.k) if fetch else q, c(fetched.v) if fetch else q, _u8(fetched.valid) if fetch else q, out_part, lse_part,
        float(sm_scale), S, R, fetched.k.shape[2] if fetch else 0, D, T, M, split_len,
        BITS_K=store.bits, BITS_V=store.bits, GROUP_K=store.group_k, GROUP_V=group_v,
        K_HIER=store.k_codes_lo is not None, V_HIER=store.v_codes_lo is not None, HAS_FETCH=fetch,
        HAS_REPLACED=fetch, HAS_CHAN=store.v_chan is not None, DOT=_dot_precision(q.dtype),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    _attn_combine_kernel[(BH, M)](out_part, lse_part, out, lse, NS, M, D,
                                  BLOCK_S=triton.next_power_of_2(NS), BLOCK_D=triton.next_power_of_2(D))
    return out, lse


def topk_lowbit_triton(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None):
    B, H, D = q_row.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    BLOCK_N = _block_n(store.group_k)
    score = torch.empty(B, Hkv, S, dtype=torch.float32, device=q_row.device)
    lo = store.k_codes_lo
    _topk_score_kernel[(B * Hkv, triton.cdiv(S, BLOCK_N))](
        q_row.contiguous(), store.k_codes.contiguous(), (lo if lo is not None else store.k_codes).contiguous(),
        store.k_scale.contiguous(), store.k_zero.contiguous(), store.n_quant.contiguous(), lse_row.contiguous(), score,
        float(sm_scale), S, D, H // Hkv, BITS_K=store.bits, GROUP_K=store.group_k, K_HIER=lo is not None,
        DOT=_dot_precision(q_row.dtype), BLOCK_G=max(16, triton.next_power_of_2(H // Hkv)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)))
    if fetched is not None:  # k rows per kv head: a few small torch ops between the two kernels
        score = _exact_fetched_scores(score, q_row, lse_row, sm_scale, fetched)
    top_score = torch.empty(B, Hkv, k, dtype=torch.float32, device=q_row.device)
    top_idx = torch.empty(B, Hkv, k, dtype=torch.int64, device=q_row.device)
    _topk_select_kernel[(B * Hkv,)](score, top_score, top_idx, S, k, BLOCK=min(1024, triton.next_power_of_2(S)))
    return top_score, top_idx


# =============================================================================================
# custom ops (CUDA path, opaque to torch.compile) and the public dispatchers
# =============================================================================================
# The ops take the tuples' tensors flat (custom ops take tensors, not tuples): `_flat` / `_unflat`.
def _flat(store: LowBitKV, residual: Residual, fetched: Optional[Fetched]):
    f = fetched or Fetched(None, None, None, None)
    tensors = (store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero, store.n_quant,
               residual.k, residual.v, residual.length)
    optional = (store.k_codes_lo, store.v_codes_lo, store.v_chan, f.k, f.v, f.idx, f.valid)
    return tensors, (store.bits, store.group_k, store.group_v), optional


def _unflat(tensors, ints, optional):
    k_lo, v_lo, v_chan, f_k, f_v, f_idx, f_valid = optional
    store = LowBitKV(*tensors[:7], *ints, k_lo, v_lo, v_chan)
    residual = Residual(*tensors[7:10]) if len(tensors) == 10 else None  # (top-k reads no residual)
    return store, residual, (Fetched(f_k, f_v, f_idx, f_valid) if f_k is not None else None)


@torch.library.custom_op("specache::attention_lowbit", mutates_args=())
def _attention_lowbit_op(q: Tensor, tensors: list[Tensor], ints: list[int], optional: list[Optional[Tensor]],
                         sm_scale: float) -> tuple[Tensor, Tensor]:
    return attention_lowbit_triton(q, *_unflat(tensors, ints, optional), sm_scale)


@_attention_lowbit_op.register_fake
def _(q, tensors, ints, optional, sm_scale):
    # contiguous, like the real op (which makes q contiguous first), whatever q's strides
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("specache::topk_lowbit", mutates_args=())
def _topk_lowbit_op(q_row: Tensor, lse_row: Tensor, tensors: list[Tensor], ints: list[int],
                    optional: list[Optional[Tensor]], k: int, sm_scale: float) -> tuple[Tensor, Tensor]:
    store, _, fetched = _unflat(tensors, ints, optional)
    return topk_lowbit_triton(q_row, lse_row, store, k, sm_scale, fetched)


@_topk_lowbit_op.register_fake
def _(q_row, lse_row, tensors, ints, optional, k, sm_scale):
    shape = (q_row.shape[0], tensors[0].shape[1], k)
    return q_row.new_empty(shape, dtype=torch.float32), q_row.new_empty(shape, dtype=torch.int64)


_ops_on_cpu = False


class custom_ops_on_cpu:
    """Tests: route CPU tensors through the custom ops too (their Triton launchers, interpreted),
    so a compiled CPU step has the CUDA step's graph: opaque ops around the caches' buffers."""

    def __enter__(self):
        global _ops_on_cpu
        _ops_on_cpu = True

    def __exit__(self, *exc):
        global _ops_on_cpu
        _ops_on_cpu = False


def attention_lowbit(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale):
    """-> (out [B,H,T,D] in q.dtype, lse [B,H,T] fp32 natural-log logsumexp of the scaled scores)."""
    if q.is_cuda or _ops_on_cpu:
        tensors, ints, optional = _flat(store, residual, fetched)
        return _attention_lowbit_op(q, list(tensors), list(ints), list(optional), float(sm_scale))
    return attention_lowbit_ref(q, store, residual, fetched, sm_scale)


def topk_lowbit(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None):
    """-> (score [B,Hkv,k] fp32, idx [B,Hkv,k] int64); see topk_lowbit_ref for the GQA reduction.
    Slots with score < 0 are invalid (fewer than k quantized positions). The CPU path returns them
    sorted by score, the Triton path in position order."""
    if q_row.is_cuda or _ops_on_cpu:
        tensors, ints, optional = _flat(store, Residual(None, None, None), fetched)
        return _topk_lowbit_op(q_row, lse_row, list(tensors[:7]), list(ints), list(optional), k, float(sm_scale))
    return topk_lowbit_ref(q_row, lse_row, store, k, sm_scale, fetched)


def lowbit_read_bytes(store: LowBitKV, n_quant: int) -> int:
    """Bytes of the stored codes and scales of tokens [0, n_quant) (absent tensors count 0)."""
    per_row = [store.k_codes, store.v_codes, store.v_scale, store.v_zero, store.k_codes_lo, store.v_codes_lo]
    per_group = [store.k_scale, store.k_zero]
    total = sum(t[:, :, :n_quant].nbytes for t in per_row if t is not None)
    total += sum(t[:, :, :n_quant // store.group_k].nbytes for t in per_group if t is not None)
    return total + (store.v_chan.nbytes if store.v_chan is not None else 0)
