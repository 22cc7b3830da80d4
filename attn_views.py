"""The attention's quantized slots for codes read through a view, beside kernels.py's plain-code
kernel: QuantSpec's INT8 view of two 4-bit planes (16*U + L - 8, scale s4/16) and ZipCache's mixed
precision (each key group's salient rows refined by 2^RB: 2^(RB+1) U + 2L, scale s_hi/2).
kernels.attention_lowbit_triton launches `_attn_views_kernel` for the programs over quantized slots
where `lowbit.has_views(store)` holds, and its own kernel's fp-row program and combine beside it (as
for attn_gluon.py); it also applies ZipCache's channel scale to the partials. The torch reference is
kernels.attention_lowbit_ref (lowbit.key_logits / value_sum); tests/test_kernels.py checks them.
"""
import torch
import triton
import triton.language as tl

from lowbit import code_layout, dot_precision, interpreter_upcast
from tiles import (fetched_hits, fetched_positions, key_group, key_scores, load_codes, query_rows,
                   logits_rows, softmax_start, store_logits, store_partial,
                   word_block)


@triton.jit
def _attn_views_kernel(q, k_codes, k_lo, k_scale, k_zero, v_codes, v_lo, v_scale, v_zero, n_quant_ptr,
                       f_idx, f_valid, out_part, lse_part, logits, k_ref, v_ref, ref_map, qk_scale, S, K, D, T, M,
                       SPLIT_LEN, N_REF, NPARTS, BITS: tl.constexpr, HIER: tl.constexpr, RB: tl.constexpr, WORDS: tl.constexpr,
                       GROUP_K: tl.constexpr, NGV: tl.constexpr, HAS_FETCH: tl.constexpr, DOT: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_K: tl.constexpr, SEL: tl.constexpr = 0):
    """Grid (B*Hkv, n_splits): program `split` attends to quantized slots [split*SPLIT_LEN, +SPLIT_LEN)
    below n_quant and writes (out, lse) partial `split` of NPARTS, as kernels._attn_split_kernel's
    quantized programs do, reading the codes with tiles.load_codes (HIER: the INT8 view; RB > 0: the
    refinement rows of ref_map); SEL > 0: the selecting rows' scores to `logits`, as that kernel does."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < M
    d_ok = offs_d < D
    qt = query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale)
    dt = q.dtype.element_ty
    if UPCAST:
        dt = tl.float32
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_D)
    if HAS_FETCH:
        fidx = fetched_positions(f_idx, f_valid, bh, K, BLOCK_K)
    if SEL > 0:
        lrows, lrows_ok = logits_rows(logits, bh, offs_m, m_ok, T, M, S, SEL)
    lo = split * SPLIT_LEN
    hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, tl.load(n_quant_ptr)), S)
    UNITS: tl.constexpr = 16 if HIER else 2 if RB > 0 else 1  # (integer_units, for the value scales)
    for n0 in range(lo, hi, GROUP_K):
        offs_n = n0 + tl.arange(0, GROUP_K)
        n_ok = offs_n < hi
        rows = bh * S + offs_n
        sk, zk, ref_rows, ref_ok = key_group(k_scale, k_zero, ref_map, rows, n_ok, bh * (S // GROUP_K) + n0 // GROUP_K,
                                              offs_d, d_ok, D, N_REF, HIER, RB)
        ck = load_codes(k_codes, k_lo, rows, n_ok, offs_d, D, k_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS, GROUP_K,
                        BLOCK_D)
        keep = n_ok
        if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy
            keep = keep & (fetched_hits(offs_n, fidx) == 0)
        cv = load_codes(v_codes, v_lo, rows, n_ok, offs_d, D, v_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS, GROUP_K,
                        BLOCK_D).to(dt)
        s = key_scores(qt, sk, zk, ck, dt, DOT)
        if SEL > 0:
            store_logits(lrows, lrows_ok, offs_n, keep, s)
        m_i, l_i, acc = word_block(s, keep, cv, m_i, l_i, acc, v_scale, v_zero, rows, n_ok, offs_d, D, dt, NGV, DOT, UNITS)
    store_partial(out_part, lse_part, (bh * NPARTS + split) * M + offs_m, m_ok, offs_d, d_ok, D, acc, m_i, l_i)


def launch(q, store, fetched, out_part, lse_part, logits, qk_scale, n_splits: int, split_len: int, NS: int, BLOCK_M: int,
           BLOCK_K: int, select: int = 0, **launch):
    """The quantized programs (bh, split < n_splits) of one attention step; kernels.py launches the rest."""
    B, H, T, D = q.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    words, BLOCK_D, k_codes, v_codes, k_lo, v_lo, k_ref, v_ref = code_layout(store, D)
    c = lambda x: x.contiguous() if x is not None else q  # noqa: E731 (absent inputs: any valid pointer)
    f = fetched
    _attn_views_kernel[(B * Hkv, n_splits)](
        q, k_codes, c(k_lo), c(store.k_scale), c(store.k_zero), v_codes, c(v_lo), c(store.v_scale), c(store.v_zero),
        c(store.n_quant), c(f.idx) if f else q, f.valid.contiguous().view(torch.uint8) if f else q,
        out_part, lse_part, logits, c(k_ref), c(v_ref), c(store.ref_map), qk_scale, S, f.k.shape[2] if f else 0, D,
        T, (H // Hkv) * T, split_len, store.n_ref, NS,
        BITS=store.bits, HIER=store.k_codes_lo is not None, RB=store.ref_bits if store.k_ref is not None else 0,
        WORDS=words, GROUP_K=store.group_k, NGV=D // min(store.group_v, D), HAS_FETCH=f is not None,
        DOT=dot_precision(q.dtype), UPCAST=interpreter_upcast(q.dtype), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
        BLOCK_K=BLOCK_K, SEL=select, **launch)
