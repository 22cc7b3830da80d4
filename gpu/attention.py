"""The low-bit decode attention in Triton (CUDA; CPU tensors under TRITON_INTERPRET=1): its kernels, one per path
over the quantized slots (words, planes; the Gluon kernel in attn_gluon.py), the fp rows' program and the combine,
their launcher, and the layout rules that pick a tile layout. What they compute, in torch, is
kernels.attention_lowbit_ref; kernels.py's custom op launches them on CUDA.

GQA: H = Hkv * G query heads, query head h reads kv head h // G. A query block of one kv head is the G*T rows
m = g*T + t, contiguous in a [B, H, T, D] tensor.
"""
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from config import DEFAULT_ATTN_PATH, check_attn_path
from gpu.tiles import (LOG2E, codes_tile, fetched_hits, fetched_mask, fetched_positions, key_scores, logits_rows,
                       online_softmax, plane_codes, plane_key_scores, query_rows, softmax_start, store_logits, store_partial,
                       tile_channels, word_block)
from quant import Fetched, LowBitKV, Residual


# =============================================================================================
# layout rules: words or bytes, bit planes, dot precision
# =============================================================================================
def dot_precision(dtype):
    """fp32 is the reference precision: IEEE dots (Triton's default for fp32 is TF32, ~1e-3 off).
    16-bit models keep tensor-core dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_upcast(dtype) -> bool:
    """The interpreter computes bf16 dots wrongly (silently): there, bf16 operands go up to fp32.
    Compiled kernels always take the model's dtype (the compile gate and the GPU checks cover them)."""
    return dtype == torch.bfloat16 and interpreted()


def code_layout(store: LowBitKV, D: int):
    """(WORDS, block_d, k_codes, v_codes): 32-bit words of the codes when each row is whole words
    and D a power of two (the fast path), else the bytes."""
    if store.group_k & (store.group_k - 1) or store.group_k < 16:
        raise ValueError(f"Triton kernels need a power-of-two key group >= 16, got {store.group_k}")
    words = D & (D - 1) == 0 and (D * store.bits) % 32 == 0
    view = (lambda t: t.contiguous().view(torch.int32)) if words else (lambda t: t.contiguous())
    return words, triton.next_power_of_2(D), view(store.k_codes), view(store.v_codes)


def interpreted() -> bool:
    """Triton kernels run in the interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def planes_fit(store: LowBitKV, D: int, M: int) -> bool:
    """Whether the bit-plane path takes this layout (M query rows of head_dim D per KV head): whole
    32-bit words per row, D and the value groups powers of two, at most 32 tile rows."""
    NGV = D // min(store.group_v, D)
    return D & (D - 1) == 0 and (D * store.bits) % 32 == 0 and NGV & (NGV - 1) == 0 and \
        triton.next_power_of_2(M) * NGV <= 32


def plane_codes_mode(store: LowBitKV, D: int, dtype) -> tuple[int, float]:
    """(CODES, CODE_OFF) of tiles.plane_codes for the model's dtype."""
    dot16 = dtype != torch.float32 and not interpreter_upcast(dtype)
    # 16-bit dots read codes as MAGIC + c (exact: c < 128 in bf16, < 1024 in fp16); fp32 converts
    # (the PTX unpacks four elements with one shift: they must share a bit plane, which holds wherever a
    # plane's W bytes are a multiple of the 16 columns a dot-operand layout groups; else Triton's ops)
    codes = 0 if not dot16 or (dtype == torch.bfloat16 and store.bits == 8) else \
        1 if interpreted() or (D * store.bits // 8) % 16 else 2
    return codes, (128.0 if dtype == torch.bfloat16 else 1024.0) if codes else 0.0


# =============================================================================================
# Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)
# =============================================================================================
# How the low-bit tiles are read (designed from byte counts: docs/design.md, kernels as designed):
# codes as 32-bit words (16 bytes per row at 1 bit, D 128) unpacked by shifts; a block is one key
# group, whose per-channel scale and zero fold into the query, q.k' = (q*s_k).c + q.z_k, and the
# values' per-token scale and zero into the probabilities, sum_n p_n (c_n s_n + z_n) = (p*s).c +
# sum_n p_n z_n, so the dots run on exact integer codes; fetched positions are dropped by comparing
# with the <= k fetched indices in registers; the sequence is split over programs, the last of each
# kv head takes the fetched and residual fp rows, and a small kernel combines the partials
# (flash-decoding). Rows that are not whole 32-bit words take a byte-wise read (WORDS=False). One
# kernel per path (config.ATTN_PATHS): _attn_words_kernel; _attn_planes_kernel orders a tile's
# channels plane-major, so each code shifts out of its own byte with no reshape (no shared-memory
# round trip), makes 16-bit codes under a magic exponent, and serves every value group with one dot
# (docs/kernels.md); attn_gluon.py's kernel, with _attn_fp_rows_kernel beside it. fp_rows is the
# fp rows' part every path shares.


@triton.jit
def fp_rows(qt, m_i, l_i, acc, n_quant_ptr, start, f_idx, f_valid, f_k, f_v, r_k, r_v, res_len_ptr, logits, bh, offs_m,
            sel_ok, offs_d, d_ok, S, R, K, D, T, M, dt: tl.constexpr, HAS_FETCH: tl.constexpr, DOT: tl.constexpr,
            BLOCK_F: tl.constexpr, SEL: tl.constexpr):
    """The fp rows of a kv head into the online softmax of its query tile qt (channels offs_d in their own
    order): the fetched rows (eq. 1) and the residual window, causal among the step's T tokens, from the row's
    first real slot `start` on (a left-padded row's padding is never attended). SEL > 0:
    their scores go to `logits` too (rows sel_ok): a fetched row's exact score at its position (Algorithm
    3's A), residual row r's at position n_quant + r (where a flush after this step quantizes it)."""
    if SEL > 0:
        lrows, lrows_ok = logits_rows(logits, bh, offs_m, sel_ok, T, M, S, SEL)
    offs_f = tl.arange(0, BLOCK_F)
    qd = qt.to(dt)
    if HAS_FETCH:
        for f0 in range(0, K, BLOCK_F):
            f = f0 + offs_f
            f_ok = (f < K) & (tl.load(f_valid + bh * K + f, mask=f < K, other=0) != 0)
            ptr = (bh * K + f[:, None]) * D + offs_d[None, :]
            kt = tl.load(f_k + ptr, mask=f_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
            vt = tl.load(f_v + ptr, mask=f_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
            s = tl.where(f_ok[None, :], tl.dot(qd, tl.trans(kt), input_precision=DOT), -float("inf"))
            if SEL > 0:
                fpos = tl.load(f_idx + bh * K + f, mask=f_ok, other=0)
                store_logits(lrows, lrows_ok, fpos, f_ok, s)
            m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
            acc += tl.dot(p.to(dt), vt, input_precision=DOT)
    # residual rows [0, res_len); query row m (token t = m % T) sees rows < res_len - T + t + 1
    res_len = tl.minimum(tl.load(res_len_ptr), R)
    limit = res_len - T + 1 + offs_m % T
    n_quant = tl.load(n_quant_ptr)
    for r0 in range(0, res_len, BLOCK_F):
        r = r0 + offs_f
        r_ok = (r < res_len) & (n_quant + r >= start)
        ptr = (bh * R + r[:, None]) * D + offs_d[None, :]
        kt = tl.load(r_k + ptr, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
        vt = tl.load(r_v + ptr, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
        causal = r_ok[None, :] & (r[None, :] < limit[:, None])
        s = tl.where(causal, tl.dot(qd, tl.trans(kt), input_precision=DOT), -float("inf"))
        if SEL > 0:
            pos = n_quant + r
            store_logits(lrows, lrows_ok, pos, r_ok & (pos < S), s)
        m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
        acc += tl.dot(p.to(dt), vt, input_precision=DOT)
    return m_i, l_i, acc


@triton.jit
def _attn_words_kernel(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant_ptr, row_start, f_idx, f_valid,
                       f_k, f_v, r_k, r_v, res_len_ptr, out_part, lse_part, logits, qk_scale, S, R, K, D, T, M, Hkv,
                       SPLIT_LEN, NPARTS,
                       BITS: tl.constexpr, WORDS: tl.constexpr, GROUP_K: tl.constexpr, NGV: tl.constexpr,
                       HAS_FETCH: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr, SEL: tl.constexpr = 0):
    """The word path. Grid (B*Hkv, n_splits + 1). Program `split` < n_splits attends to quantized slots
    [split*SPLIT_LEN, +SPLIT_LEN) below n_quant, the codes unpacked from 32-bit words (WORDS) or bytes;
    the last one to the fetched and residual fp rows (fp_rows). Each writes (out, lse) partial `split` of
    NPARTS for the kv head's G*T query rows m = g*T + t. SEL > 0: the last SEL tokens select the next
    step's rows (Algorithm 3's ArgTopK over the attention they just computed): their scores go to `logits`
    (tiles.store_logits) for every position the step attended that can be fetched; a quantized slot's is
    its low-bit score. row_start [B]: each row's first real slot (left padding: the key groups before it
    are skipped, the slots before it in its group masked)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = tl.load(row_start + bh // Hkv)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < D
    qt = query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale)  # scores in log2 units: exp2 below
    dt = q.dtype.element_ty  # the dots' input type: the model's (fp32 with IEEE dots)
    if UPCAST:
        dt = tl.float32
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    if split < NPARTS - 1:
        if HAS_FETCH:
            fidx = fetched_positions(f_idx, f_valid, bh, K, BLOCK_K)
        if SEL > 0:
            lrows, lrows_ok = logits_rows(logits, bh, offs_m, m_ok, T, M, S, SEL)
        lo = split * SPLIT_LEN
        hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, tl.load(n_quant_ptr)), S)
        lo += tl.maximum(start - lo, 0) // GROUP_K * GROUP_K  # (whole key groups of padding)
        for n0 in range(lo, hi, GROUP_K):
            offs_n = n0 + tl.arange(0, GROUP_K)
            n_ok = (offs_n < hi) & (offs_n >= start)
            rows = bh * S + offs_n
            # keys: this block is one key group; its scale/zero fold into the query
            grp = bh * (S // GROUP_K) + n0 // GROUP_K
            sk = tl.load(k_scale + grp * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            zk = tl.load(k_zero + grp * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            ck = codes_tile(k_codes, rows, n_ok, offs_d, D, BITS, WORDS, GROUP_K, BLOCK_D)
            s = key_scores(qt, sk, zk, ck, dt, DOT)
            keep = n_ok
            if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy
                keep = keep & (fetched_hits(offs_n, fidx) == 0)
            if SEL > 0:
                store_logits(lrows, lrows_ok, offs_n, keep, s)
            cv = codes_tile(v_codes, rows, n_ok, offs_d, D, BITS, WORDS, GROUP_K, BLOCK_D).to(dt)
            m_i, l_i, acc = word_block(s, keep, cv, m_i, l_i, acc, v_scale, v_zero, rows, n_ok, offs_d, D, dt, NGV, DOT)
    else:
        m_i, l_i, acc = fp_rows(qt, m_i, l_i, acc, n_quant_ptr, start, f_idx, f_valid, f_k, f_v, r_k, r_v, res_len_ptr,
                                logits, bh, offs_m, m_ok, offs_d, d_ok, S, R, K, D, T, M, dt, HAS_FETCH, DOT, BLOCK_F, SEL)
    store_partial(out_part, lse_part, (bh * NPARTS + split) * M + offs_m, m_ok, offs_d, d_ok, D, acc, m_i, l_i)


@triton.jit
def _attn_planes_kernel(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant_ptr, row_start, f_idx, f_valid,
                        f_k, f_v, r_k, r_v, res_len_ptr, out_part, lse_part, logits, qk_scale, S, R, K, D, T, M, Hkv,
                        SPLIT_LEN, NPARTS, BITS: tl.constexpr, GROUP_K: tl.constexpr, NGV: tl.constexpr, HAS_FETCH: tl.constexpr,
                        DOT: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr, RG: tl.constexpr, CODES: tl.constexpr,
                        CODE_OFF: tl.constexpr, SEL: tl.constexpr = 0):
    """The bit-plane path: _attn_words_kernel's grid and partials, the quantized slots read as bit-plane
    tiles. A tile's columns are channels in plane-major order (tiles.plane_codes), and its rows hold RG
    copies of the query rows, copy g taking the values' channel group g: one value dot serves every
    channel group (each with its own per-token scale), and the copies fill the MMA's 16 rows that M = 8
    query rows would leave empty. CODES / CODE_OFF: how 16-bit dots read the codes (plane_codes)."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = tl.load(row_start + bh // Hkv)
    MR: tl.constexpr = BLOCK_M // RG
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = offs_r % MR  # the query row of each tile row
    offs_c = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    dt = q.dtype.element_ty
    if UPCAST:
        dt = tl.float32
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    if split < NPARTS - 1:
        offs_d = tile_channels(offs_c, BLOCK_D, BITS, True)
        d_ok = offs_d < D
        qt = query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale)
        if HAS_FETCH:
            fidx = fetched_positions(f_idx, f_valid, bh, K, BLOCK_K)
        if SEL > 0:  # (row copy 0 of each query row: the copies hold the same scores)
            lrows, lrows_ok = logits_rows(logits, bh, offs_m, m_ok & (offs_r < MR), T, M, S, SEL)
        lo = split * SPLIT_LEN
        hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, tl.load(n_quant_ptr)), S)
        lo += tl.maximum(start - lo, 0) // GROUP_K * GROUP_K  # (whole key groups of padding)
        grp_r = offs_r // MR
        for n0 in range(lo, hi, GROUP_K):
            offs_n = n0 + tl.arange(0, GROUP_K)
            n_ok = (offs_n < hi) & (offs_n >= start)
            rows = bh * S + offs_n
            grp = bh * (S // GROUP_K) + n0 // GROUP_K
            s = plane_key_scores(qt, k_codes, k_scale, k_zero, rows, grp, offs_c, offs_d, D, dt, BITS, BLOCK_D, CODES,
                                 CODE_OFF, DOT)
            keep = n_ok
            if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy
                keep = keep & ~fetched_mask(n0, fidx, GROUP_K)
            if SEL > 0:
                store_logits(lrows, lrows_ok, offs_n, keep, s)
            s = tl.where(keep[None, :], s, -float("inf"))
            m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
            # values: row copy g folds channel group g's per-token scale/zero into p
            cv = plane_codes(v_codes, rows[:, None], offs_c[None, :], dt, BITS, BLOCK_D, CODES)
            sv = tl.zeros([BLOCK_M, GROUP_K], tl.float32)
            zv = tl.zeros([BLOCK_M, GROUP_K], tl.float32)
            for g in tl.static_range(RG):
                sv = tl.where((grp_r == g)[:, None], tl.load(v_scale + rows * NGV + g, mask=n_ok, other=0.0).to(tl.float32)[None, :], sv)
                zv = tl.where((grp_r == g)[:, None], tl.load(v_zero + rows * NGV + g, mask=n_ok, other=0.0).to(tl.float32)[None, :], zv)
            ps = (p * sv).to(dt)
            acc += tl.dot(ps, cv, input_precision=DOT) + tl.sum(p * zv - CODE_OFF * ps.to(tl.float32), 1)[:, None]
    else:  # fp rows: channels in their own order (masks and loads of contiguous, aligned channels: vectorized)
        offs_d = offs_c
        d_ok = offs_d < D
        qt = query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale)
        m_i, l_i, acc = fp_rows(qt, m_i, l_i, acc, n_quant_ptr, start, f_idx, f_valid, f_k, f_v, r_k, r_v, res_len_ptr,
                                logits, bh, offs_m, m_ok & (offs_r < MR), offs_d, d_ok, S, R, K, D, T, M, dt, HAS_FETCH,
                                DOT, BLOCK_F, SEL)
    if RG > 1:  # each row copy keeps its own channel group (their softmax statistics are the same)
        acc = tl.sum(tl.reshape(tl.where(offs_r[:, None] // MR == offs_d[None, :] // (D // NGV), acc, 0.0),
                                (RG, MR, BLOCK_D)), 0)
        m_i = tl.max(tl.reshape(m_i, (RG, MR)), 0)
        l_i = tl.max(tl.reshape(l_i, (RG, MR)), 0)
    offs_m = tl.arange(0, MR)
    store_partial(out_part, lse_part, (bh * NPARTS + split) * M + offs_m, offs_m < M, offs_d, d_ok, D, acc, m_i, l_i)


@triton.jit
def _attn_fp_rows_kernel(q, n_quant_ptr, row_start, f_idx, f_valid, f_k, f_v, r_k, r_v, res_len_ptr, out_part, lse_part,
                         logits, qk_scale, S, R, K, D, T, M, Hkv, NPARTS, HAS_FETCH: tl.constexpr, DOT: tl.constexpr,
                         UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_F: tl.constexpr,
                         SEL: tl.constexpr = 0):
    """Grid (B*Hkv,): the fp rows' program alone (fp_rows), writing the last of NPARTS partials, beside
    another kernel's quantized programs (attn_gluon's, or a store read through its own kernel)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < D
    qt = query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale)
    dt = q.dtype.element_ty
    if UPCAST:
        dt = tl.float32
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    m_i, l_i, acc = fp_rows(qt, m_i, l_i, acc, n_quant_ptr, tl.load(row_start + bh // Hkv), f_idx, f_valid, f_k, f_v, r_k,
                            r_v, res_len_ptr, logits, bh, offs_m, m_ok, offs_d, d_ok, S, R, K, D, T, M, dt, HAS_FETCH,
                            DOT, BLOCK_F, SEL)
    store_partial(out_part, lse_part, (bh * NPARTS + NPARTS - 1) * M + offs_m, m_ok, offs_d, d_ok, D, acc, m_i, l_i)


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


# =============================================================================================
# Triton launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)
# =============================================================================================
def programs_target(device) -> int:
    """About four programs per SM on a GPU; a handful under the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


# 16-bit decode shapes (G*T <= 16 query rows): 2 warps, no software pipelining: a decode program's tile is
# small, and fewer warps hold more of it in registers (docs/gpu.md's launch sweep). fp32 keeps the defaults.
# `launch` (num_warps, num_stages) overrides either, for tuning sweeps.
DECODE_LAUNCH = dict(num_warps=2, num_stages=1)
FP_ROWS_LAUNCH = dict(num_warps=4, num_stages=2)  # the fp-row program alone: <= 128 registers, no spills


def _planes_layout(store: LowBitKV, D: int, M: int, dtype):
    """(RG, BLOCK_M, CODES, CODE_OFF) of the bit-plane tiles: RG row copies of the M query rows, one per
    value channel group."""
    NGV = D // min(store.group_v, D)
    return (NGV, max(16, triton.next_power_of_2(M) * NGV)) + plane_codes_mode(store, D, dtype)


def launch_path(path: str, q, store: LowBitKV, M: int) -> str:
    """A named path as is; "auto" (the default): Gluon where this launch fits it (a compiled 16-bit launch on a
    GPU that attn_gluon.fits), else words."""
    if path != "auto":
        return path
    if not q.is_cuda or interpreted():
        return "words"
    try:
        from gpu import attn_gluon
    except ImportError:  # (a Triton without Gluon)
        return "words"
    return "gluon" if attn_gluon.fits(store, q.shape[-1], M, q.dtype) else "words"


def attention_lowbit_triton(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale,
                            attn_path=DEFAULT_ATTN_PATH, n_splits=None, select=0, quantized=None, **launch):
    """The Triton attention on one path (config.ATTN_PATHS; the planes and Gluon paths need a layout
    planes_fit takes). `quantized`: a launcher of the quantized programs in place of this module's (a
    store read through its own kernel); this module then launches the fp-row program and the combine."""
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    M, BH, G = (H // Hkv) * T, B * Hkv, H // Hkv
    assert store.k_scale.shape[2] * store.group_k == S, "quantized slots must be a whole number of key groups"
    path = "words" if quantized is not None else launch_path(check_attn_path(attn_path), q, store, M)  # (its own programs)
    if path != "words" and not planes_fit(store, D, M):
        raise ValueError(f"the {path} attention path does not take this cache layout (planes_fit)")
    gluon = path == "gluon"
    if gluon:  # attn_gluon runs the quantized programs (a split: whole warps' key groups); imported here: only Gluon needs it
        from gpu import attn_gluon
        if interpreted() or not attn_gluon.fits(store, D, M, q.dtype):
            raise ValueError("the Gluon path takes compiled 16-bit launches that attn_gluon.fits")
    words, BLOCK_D, k_codes, v_codes = code_layout(store, D)
    plane = _planes_layout(store, D, M, q.dtype) if path != "words" else None
    if plane is not None:  # bytes, not words
        k_codes, v_codes = store.k_codes.contiguous(), store.v_codes.contiguous()
    RG, BLOCK_M, CODES, CODE_OFF = plane or (1, max(16, triton.next_power_of_2(M)), 0, 0.0)
    n_blocks = triton.cdiv(S, store.group_k)
    if n_splits is None:
        n_splits = min(n_blocks, max(1, programs_target(q.device) // BH))
    per_split = attn_gluon.WARPS if gluon else 1
    split_len = triton.cdiv(triton.cdiv(n_blocks, max(1, n_splits)), per_split) * per_split * store.group_k
    n_splits = max(1, triton.cdiv(S, split_len))
    NS = n_splits + 1  # + the program for fetched and residual rows
    q = q.contiguous()
    c = lambda x: x.contiguous() if x is not None else q  # noqa: E731 (absent inputs: any valid pointer)
    f = fetched
    K = f.k.shape[2] if f is not None else 0
    out_part = torch.empty(BH, NS, M, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(BH, NS, M, dtype=torch.float32, device=q.device)
    logits = torch.empty(B, Hkv, G * select, S, dtype=torch.float32, device=q.device) if select else out_part
    qk_scale = float(sm_scale) * LOG2E.value
    BLOCK_K = max(16, triton.next_power_of_2(max(K, 1)))
    decode = DECODE_LAUNCH if M <= 16 and q.dtype != torch.float32 else {}
    fp = (c(store.n_quant), store.starts().contiguous(), c(f.idx) if f else q,
          f.valid.contiguous().view(torch.uint8) if f else q, c(f.k) if f else q, c(f.v) if f else q, c(residual.k),
          c(residual.v), c(residual.length))
    dims = dict(HAS_FETCH=f is not None, DOT=dot_precision(q.dtype), UPCAST=interpreter_upcast(q.dtype), BLOCK_D=BLOCK_D,
                BLOCK_F=64, SEL=select)
    if gluon or quantized is not None:  # another kernel's quantized programs, then the fp rows' program alone
        if gluon:  # the quantized programs (bh, split < n_splits): each warp its own key groups
            attn_gluon.attn_planes_gluon[(BH, n_splits)](
                q, k_codes, c(store.k_scale), c(store.k_zero), v_codes, c(store.v_scale), c(store.v_zero), *fp[:4],
                out_part, lse_part, logits, qk_scale, S, D, T, M, K, Hkv, split_len, NS, BITS=store.bits,
                GROUP_K=store.group_k, NGV=D // min(store.group_v, D), HAS_FETCH=f is not None, BLOCK_M=8 if M <= 8 else 16,
                BLOCK_D=D, BLOCK_K=max(32, BLOCK_K), NW=attn_gluon.WARPS, SEL=select, num_warps=attn_gluon.WARPS)
        else:
            quantized(q, f, out_part, lse_part, logits, qk_scale, n_splits, split_len, NS, BLOCK_M, BLOCK_K, select,
                      **{**decode, **launch})
        _attn_fp_rows_kernel[(BH,)](q, *fp, out_part, lse_part, logits, qk_scale, S, R, K, D, T, M, Hkv, NS,
                                    BLOCK_M=max(16, triton.next_power_of_2(M)), **dims,
                                    **{**decode, **(FP_ROWS_LAUNCH if gluon else {}), **launch})
    else:
        quant = (q, k_codes, c(store.k_scale), c(store.k_zero), v_codes, c(store.v_scale), c(store.v_zero))
        args = (*quant, *fp, out_part, lse_part, logits, qk_scale, S, R, K, D, T, M, Hkv, split_len, NS)
        shape = dict(BITS=store.bits, GROUP_K=store.group_k, NGV=D // min(store.group_v, D), BLOCK_M=BLOCK_M,
                     BLOCK_K=BLOCK_K, **dims, **decode, **launch)
        if plane is not None:
            _attn_planes_kernel[(BH, NS)](*args, RG=RG, CODES=CODES, CODE_OFF=CODE_OFF, **shape)
        else:
            _attn_words_kernel[(BH, NS)](*args, WORDS=words, **shape)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    _attn_combine_kernel[(BH, M)](out_part, lse_part, out, lse, NS, M, D,
                                  BLOCK_S=triton.next_power_of_2(NS), BLOCK_D=BLOCK_D)
    return (out, lse, logits) if select else (out, lse)
