"""Decode-time kernels over the low-bit device cache (SpeCache §3.2-3.4).

  attention_lowbit  attention of T new query tokens over
                      quantized slots [0, n_quant)  (KIVI codes dequantized on the fly),
                      minus the `replaced` slots whose fp rows were fetched (eq. 1: C' ∪ C_K replaces C'_K),
                      plus the fetched fp rows and the fp residual window (causal among the new tokens).
  topk_lowbit       top-k quantized positions by attention probability of one (speculative) query.
  topk_exact        the same top-k from full-precision keys (oracle fetch, hit rates).

GQA: H = Hkv * G query heads, query head h reads kv head h // G. A query block of one kv head
is the G*T rows m = g*T + t, contiguous in a [B, H, T, D] tensor.

Each public function dispatches on the device: CUDA -> Triton kernel behind a torch.library
custom op (so torch.compile(fullgraph=True) can call it); CPU -> the torch reference inline,
written with static shapes (masks over all S slots, no slicing by n_quant, garbage past the valid
lengths masked out) so one compiled graph serves every step and inductor fuses the unpack and
dequantize elementwise work (the matmuls stay library calls). The Triton launchers (`*_triton`) also run on CPU
tensors under TRITON_INTERPRET=1, which is how the tests check them against the references.
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

import quant

Tensor = torch.Tensor


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def dequant_k(k_codes, k_codes_lo, k_scale, k_zero, bits_k, group_k):
    """Keys of a low-bit cache in fp32 (KIVI, or QuantSpec's 8-bit view when k_codes_lo is given)."""
    if k_codes_lo is not None:  # QuantSpec 8-bit view (upper + lower planes)
        assert bits_k == 4, "hierarchical codes are 4-bit planes"
        return quant.dequantize_hier_keys(k_codes, k_codes_lo, k_scale, k_zero, group_k, view_bits=8)
    return quant.dequantize_keys(k_codes, k_scale, k_zero, bits_k, group_k)


def dequant_v(v_codes, v_codes_lo, v_scale, v_zero, bits_v, group_v, v_chan_scale):
    """Values in fp32 (KIVI; QuantSpec 8-bit view with v_codes_lo; ZipCache with v_chan_scale)."""
    if v_codes_lo is not None:
        assert bits_v == 4, "hierarchical codes are 4-bit planes"
        v = quant.dequantize_hier_values(v_codes, v_codes_lo, v_scale, v_zero, group_v, view_bits=8)
    else:
        v = quant.dequantize_values(v_codes, v_scale, v_zero, bits_v, group_v)
    if v_chan_scale is not None:  # ZipCache eq. 6: x' = dequant * c
        v = v * v_chan_scale.float()[..., None, :]
    return v


def attention_lowbit_ref(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant, k_res, v_res, res_len,
                         *, bits_k, bits_v, group_k, group_v, sm_scale, k_fetch=None, v_fetch=None,
                         fetch_valid=None, replaced=None, v_chan_scale=None, k_codes_lo=None, v_codes_lo=None):
    B, H, T, D = q.shape
    Hkv, S, R = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    G, dev = H // Hkv, q.device
    M = G * T
    qg = q.float().reshape(B, Hkv, M, D) * sm_scale

    keep_q = (torch.arange(S, device=dev) < n_quant).expand(B, Hkv, S)
    if replaced is not None:  # eq. 1: a fetched fp row replaces its quantized copy
        keep_q = keep_q & ~replaced
    t = torch.arange(M, device=dev) % T  # query row m = g*T + t sees residual rows < res_len - T + t + 1
    keep_res = torch.arange(R, device=dev) < res_len - T + 1 + t[:, None]  # [M, R]
    # (keys, values, keep per key row, keep per (query row, key row)) of each part
    parts = [(dequant_k(k_codes, k_codes_lo, k_scale, k_zero, bits_k, group_k),
              dequant_v(v_codes, v_codes_lo, v_scale, v_zero, bits_v, group_v, v_chan_scale),
              keep_q, keep_q[:, :, None, :]),
             (k_res, v_res, (torch.arange(R, device=dev) < res_len).expand(B, Hkv, R), keep_res)]
    if k_fetch is not None:
        fv = torch.ones(k_fetch.shape[:3], dtype=torch.bool, device=dev) if fetch_valid is None else fetch_valid
        parts.append((k_fetch, v_fetch, fv, fv[:, :, None, :]))

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


def _exact_fetched_scores(prob, q_row, lse_row, sm_scale, k_fetch, fetch_idx, fetch_valid):
    """Algorithm 3 takes ArgTopK of the attention that already used the fetched fp rows: their
    positions get exact scores, so a row that matters keeps its place whatever its low-bit copy
    scores. Invalid fetch slots write back the scratch slot's own value (position S-1 >= n_quant)."""
    B, H, D = q_row.shape
    Hkv, S = prob.shape[1], prob.shape[2]
    qg = q_row.float().reshape(B, Hkv, H // Hkv, D) * sm_scale
    exact = torch.exp(qg @ k_fetch.float().transpose(-1, -2) - lse_row.float().reshape(B, Hkv, -1, 1)).sum(2)
    safe = torch.where(fetch_valid, fetch_idx, S - 1)
    return prob.scatter(-1, safe, torch.where(fetch_valid, exact, prob.gather(-1, safe)))


def topk_lowbit_ref(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, *, bits_k, group_k, sm_scale, k,
                    k_codes_lo=None, k_fetch=None, fetch_idx=None, fetch_valid=None):
    """score[p] = sum over the G query heads of kv head j of exp(sm_scale * q_g . k'_p - lse_g): the
    attention probability kv row p would get, summed over the heads that share it (one fetch per
    kv head serves all G heads); with k_fetch, fetched positions score with their fp rows.
    Positions p >= n_quant score -1 with index 0. Sorted descending."""
    B, H, D = q_row.shape
    Hkv, S = k_codes.shape[1], k_codes.shape[2]
    G = H // Hkv
    keys = dequant_k(k_codes, k_codes_lo, k_scale, k_zero, bits_k, group_k)  # [B,Hkv,S,D]
    logits = (q_row.float().reshape(B, Hkv, G, D) * sm_scale) @ keys.transpose(-1, -2)  # [B,Hkv,G,S]
    prob = torch.exp(logits - lse_row.float().reshape(B, Hkv, G, 1)).sum(2)
    if k_fetch is not None:
        prob = _exact_fetched_scores(prob, q_row, lse_row, sm_scale, k_fetch, fetch_idx, fetch_valid)
    valid = torch.arange(S, device=q_row.device) < n_quant
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


def attention_lowbit_triton(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant, k_res, v_res, res_len,
                            *, bits_k, bits_v, group_k, group_v, sm_scale, k_fetch=None, v_fetch=None,
                            fetch_valid=None, replaced=None, v_chan_scale=None, k_codes_lo=None, v_codes_lo=None,
                            n_splits=None):
    B, H, T, D = q.shape
    Hkv, S, R = k_codes.shape[1], k_codes.shape[2], k_res.shape[2]
    M, BH = (H // Hkv) * T, B * Hkv
    group_v = min(group_v, D)
    assert k_scale.shape[2] * group_k == S, "quantized slots must be a whole number of key groups"
    assert replaced is None or replaced.shape == (B, Hkv, S), "replaced must be [B, Hkv, S]"
    BLOCK_N = _block_n(group_k)
    n_blocks = triton.cdiv(S, BLOCK_N)
    if n_splits is None:  # enough programs to fill a GPU (~128), never more splits than blocks
        n_splits = min(n_blocks, max(1, 128 // BH))
    split_len = triton.cdiv(n_blocks, max(1, n_splits)) * BLOCK_N
    n_splits = max(1, triton.cdiv(S, split_len))
    NS = n_splits + 1  # + the program for fetched and residual rows

    c = lambda x: x.contiguous() if x is not None else q  # noqa: E731 (absent inputs: any valid pointer)
    fetch = k_fetch is not None
    if fetch and fetch_valid is None:
        fetch_valid = torch.ones(k_fetch.shape[:3], dtype=torch.bool, device=q.device)
    q = q.contiguous()
    out_part = torch.empty(BH, NS, M, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(BH, NS, M, dtype=torch.float32, device=q.device)
    _attn_split_kernel[(BH, NS)](
        q, c(k_codes), c(k_codes_lo), c(k_scale), c(k_zero), c(v_codes), c(v_codes_lo), c(v_scale), c(v_zero),
        c(v_chan_scale), c(n_quant), _u8(replaced) if replaced is not None else q, c(k_res), c(v_res), c(res_len),
        c(k_fetch), c(v_fetch), _u8(fetch_valid) if fetch else q, out_part, lse_part,
        float(sm_scale), S, R, k_fetch.shape[2] if fetch else 0, D, T, M, split_len,
        BITS_K=bits_k, BITS_V=bits_v, GROUP_K=group_k, GROUP_V=group_v,
        K_HIER=k_codes_lo is not None, V_HIER=v_codes_lo is not None, HAS_FETCH=fetch,
        HAS_REPLACED=replaced is not None, HAS_CHAN=v_chan_scale is not None, DOT=_dot_precision(q.dtype),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(D)))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    _attn_combine_kernel[(BH, M)](out_part, lse_part, out, lse, NS, M, D,
                                  BLOCK_S=triton.next_power_of_2(NS), BLOCK_D=triton.next_power_of_2(D))
    return out, lse


def topk_lowbit_triton(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, *, bits_k, group_k, sm_scale, k,
                       k_codes_lo=None, k_fetch=None, fetch_idx=None, fetch_valid=None):
    B, H, D = q_row.shape
    Hkv, S = k_codes.shape[1], k_codes.shape[2]
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    BLOCK_N = _block_n(group_k)
    score = torch.empty(B, Hkv, S, dtype=torch.float32, device=q_row.device)
    _topk_score_kernel[(B * Hkv, triton.cdiv(S, BLOCK_N))](
        q_row.contiguous(), k_codes.contiguous(), (k_codes_lo if k_codes_lo is not None else k_codes).contiguous(),
        k_scale.contiguous(), k_zero.contiguous(), n_quant.contiguous(), lse_row.contiguous(), score,
        float(sm_scale), S, D, H // Hkv, BITS_K=bits_k, GROUP_K=group_k, K_HIER=k_codes_lo is not None,
        DOT=_dot_precision(q_row.dtype), BLOCK_G=max(16, triton.next_power_of_2(H // Hkv)), BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)))
    if k_fetch is not None:  # k rows per kv head: a few small torch ops between the two kernels
        score = _exact_fetched_scores(score, q_row, lse_row, sm_scale, k_fetch, fetch_idx, fetch_valid)
    top_score = torch.empty(B, Hkv, k, dtype=torch.float32, device=q_row.device)
    top_idx = torch.empty(B, Hkv, k, dtype=torch.int64, device=q_row.device)
    _topk_select_kernel[(B * Hkv,)](score, top_score, top_idx, S, k, BLOCK=min(1024, triton.next_power_of_2(S)))
    return top_score, top_idx


# =============================================================================================
# custom ops (CUDA path, opaque to torch.compile) and the public dispatchers
# =============================================================================================
@torch.library.custom_op("specache::attention_lowbit", mutates_args=())
def _attention_lowbit_op(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                         v_scale: Tensor, v_zero: Tensor, n_quant: Tensor, k_res: Tensor, v_res: Tensor,
                         res_len: Tensor, bits_k: int, bits_v: int, group_k: int, group_v: int, sm_scale: float,
                         k_fetch: Optional[Tensor] = None, v_fetch: Optional[Tensor] = None,
                         fetch_valid: Optional[Tensor] = None, replaced: Optional[Tensor] = None,
                         v_chan_scale: Optional[Tensor] = None, k_codes_lo: Optional[Tensor] = None,
                         v_codes_lo: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return attention_lowbit_triton(
        q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant, k_res, v_res, res_len, bits_k=bits_k,
        bits_v=bits_v, group_k=group_k, group_v=group_v, sm_scale=sm_scale, k_fetch=k_fetch, v_fetch=v_fetch,
        fetch_valid=fetch_valid, replaced=replaced, v_chan_scale=v_chan_scale, k_codes_lo=k_codes_lo,
        v_codes_lo=v_codes_lo)


@_attention_lowbit_op.register_fake
def _(q, *args):
    # contiguous, like the real op (which makes q contiguous first), whatever q's strides
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("specache::topk_lowbit", mutates_args=())
def _topk_lowbit_op(q_row: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, n_quant: Tensor,
                    lse_row: Tensor, bits_k: int, group_k: int, sm_scale: float, k: int,
                    k_codes_lo: Optional[Tensor] = None, k_fetch: Optional[Tensor] = None,
                    fetch_idx: Optional[Tensor] = None, fetch_valid: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return topk_lowbit_triton(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, bits_k=bits_k, group_k=group_k,
                              sm_scale=sm_scale, k=k, k_codes_lo=k_codes_lo, k_fetch=k_fetch, fetch_idx=fetch_idx,
                              fetch_valid=fetch_valid)


@_topk_lowbit_op.register_fake
def _(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, bits_k, group_k, sm_scale, k, k_codes_lo=None,
      k_fetch=None, fetch_idx=None, fetch_valid=None):
    shape = (q_row.shape[0], k_codes.shape[1], k)
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


def attention_lowbit(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant, k_res, v_res, res_len,
                     *, bits_k, bits_v, group_k, group_v, sm_scale, k_fetch=None, v_fetch=None, fetch_valid=None,
                     replaced=None, v_chan_scale=None, k_codes_lo=None, v_codes_lo=None):
    """-> (out [B,H,T,D] in q.dtype, lse [B,H,T] fp32 natural-log logsumexp of the scaled scores).
    Shapes: see the module docstring and attention_lowbit_ref; n_quant and res_len are 0-d tensors."""
    args = (q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant, k_res, v_res, res_len)
    opt = dict(k_fetch=k_fetch, v_fetch=v_fetch, fetch_valid=fetch_valid, replaced=replaced,
               v_chan_scale=v_chan_scale, k_codes_lo=k_codes_lo, v_codes_lo=v_codes_lo)
    if q.is_cuda or _ops_on_cpu:
        return _attention_lowbit_op(*args, bits_k, bits_v, group_k, group_v, float(sm_scale), **opt)
    return attention_lowbit_ref(*args, bits_k=bits_k, bits_v=bits_v, group_k=group_k, group_v=group_v,
                                sm_scale=sm_scale, **opt)


def topk_lowbit(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, *, bits_k, group_k, sm_scale, k,
                k_codes_lo=None, k_fetch=None, fetch_idx=None, fetch_valid=None):
    """-> (score [B,Hkv,k] fp32, idx [B,Hkv,k] int64); see topk_lowbit_ref for the GQA reduction.
    Optional fetched rows (k_fetch [B,Hkv,K,D] at quantized positions fetch_idx where fetch_valid)
    score exactly. Slots with score < 0 are invalid (fewer than k quantized positions). The CPU
    path returns them sorted by score, the Triton path in position order."""
    fetched = dict(k_fetch=k_fetch, fetch_idx=fetch_idx, fetch_valid=fetch_valid)
    if q_row.is_cuda or _ops_on_cpu:
        return _topk_lowbit_op(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, bits_k, group_k,
                               float(sm_scale), k, k_codes_lo, **fetched)
    return topk_lowbit_ref(q_row, k_codes, k_scale, k_zero, n_quant, lse_row, bits_k=bits_k, group_k=group_k,
                           sm_scale=sm_scale, k=k, k_codes_lo=k_codes_lo, **fetched)
