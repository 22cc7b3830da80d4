"""The siblings' low-bit tuple and its attention: codes read through a view, beside quant.py's
plain KIVI codes. QuantSpec's INT8 view of two 4-bit planes (16*U + L - 8, scale s4/16) and ZipCache's
mixed precision (each key group's salient rows refined by 2^RB: 2^(RB+1) U + 2L, scale s_hi/2) and
channel-separable values (eq. 6: the dequantized values times a per-channel scale c).

  ViewKV            KIVI's LowBitKV (the upper codes, scales, zeros) plus the view's parts; the same
                    methods as LowBitKV, so kernels.attention_lowbit_ref is its torch reference
  attention_views   cache.LowBitCache.attend's attention for a ViewKV: with use_op the Triton launch
                    behind its custom op, `_attn_views_kernel` running the quantized programs and
                    gpu/attention.py's fp-row program and combine the rest; else the torch reference
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

import kernels
import quant
from gpu import attention
from gpu.attention import dot_precision, interpreter_upcast
from gpu.tiles import (codes_tile, fetched_hits, fetched_positions, key_scores, logits_rows, query_rows, softmax_start,
                       store_logits, store_partial, word_block)
from kernels import from_op_inputs, op_inputs
from quant import Fetched, LowBitKV, Residual, Tensor, code_logits, code_value_sum


class ViewKV(NamedTuple):
    """A low-bit store read through a view: `kv` holds what KIVI's holds (QuantSpec: the upper INT4
    planes; ZipCache: the upper codes and the scales of the salient bit-width), the rest is None or 0
    where the store has no such part."""
    kv: LowBitKV
    k_codes_lo: Optional[Tensor] = None  # QuantSpec's 8-bit view: the lower 4-bit planes
    v_codes_lo: Optional[Tensor] = None
    v_chan: Optional[Tensor] = None  # ZipCache: per-channel value scale [B,Hkv,D] (eq. 6)
    # ZipCache mixed precision (zipcache.quantize_mixed): the lower codes of each key group's n_ref
    # salient rows, and each slot's place among them (255: not salient, reads the midpoint)
    k_ref: Optional[Tensor] = None  # [B,Hkv,S/group_k*n_ref,D*ref_bits/8] uint8
    v_ref: Optional[Tensor] = None
    ref_map: Optional[Tensor] = None  # [B,Hkv,S] uint8
    ref_bits: int = 0
    n_ref: int = 0

    @property
    def k_codes(self) -> Tensor:
        return self.kv.k_codes

    @property
    def n_quant(self) -> Tensor:
        return self.kv.n_quant

    @property
    def row_start(self) -> Optional[Tensor]:
        return self.kv.row_start

    def real_slots(self) -> Tensor:
        return self.kv.real_slots()

    def unit_div(self) -> int:
        """What the stored scales are divided by for `codes`' integers: QuantSpec's s4/16, ZipCache's s_hi/2."""
        return 16 if self.k_codes_lo is not None else 2 if self.k_ref is not None else 1

    def codes(self, kv: str) -> Tensor:
        """Integer codes of the keys (kv="k") or values as fp32 [B,Hkv,S,D]: the upper codes, QuantSpec's
        INT8 view 16*U + L - 8, or ZipCache's mixed codes (each salient row's lower codes gathered from
        the compact refinement rows of its key group)."""
        s = self.kv
        lo, ref = (self.k_codes_lo, self.k_ref) if kv == "k" else (self.v_codes_lo, self.v_ref)
        c = quant.unpack_bits(s.k_codes if kv == "k" else s.v_codes, s.bits, torch.int32)
        if lo is not None:
            c = 16 * c + quant.unpack_bits(lo, 4, torch.int32) - 8
        if ref is not None:
            B, Hkv, S, D = c.shape
            has = self.ref_map != 255
            row = torch.arange(S, device=c.device) // s.group_k * self.n_ref + torch.where(has, self.ref_map.long(), 0)
            lower = quant.unpack_bits(ref, self.ref_bits, torch.int32).gather(2, row[..., None].expand(B, Hkv, S, D))
            c = (c << (self.ref_bits + 1)) + torch.where(has[..., None], 2 * lower, 2 ** self.ref_bits - 1)
        return c.float()

    def key_logits(self, qg) -> Tensor:
        return code_logits(qg, self.codes("k"), self.kv.k_scale.float() / self.unit_div(), self.kv.k_zero,
                           self.kv.group_k)

    def value_sum(self, p, keep) -> Tensor:
        out = code_value_sum(p, self.codes("v"), self.kv.v_scale.float() / self.unit_div(), self.kv.v_zero,
                             self.kv.group_v, keep)
        return out if self.v_chan is None else out * self.v_chan.float()[:, :, None, :]  # eq. 6: x' = dequant * c

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Keys and values in fp32 [B,Hkv,S,D]."""
        s, div = self.kv, self.unit_div()
        k = quant.dequantize_codes(self.codes("k"), s.k_scale.float() / div, s.k_zero, s.group_k, "tokens")
        D = s.v_codes.shape[-1] * 8 // s.bits
        v = quant.dequantize_codes(self.codes("v"), s.v_scale.float() / div, s.v_zero, min(s.group_v, D), "channels")
        return k, (v if self.v_chan is None else v * self.v_chan.float()[..., None, :])

    def first_tokens(self, n: int) -> "ViewKV":
        cut = lambda x, m=n: None if x is None else x[:, :, :m]  # noqa: E731
        refs = n // self.kv.group_k * self.n_ref
        return self._replace(kv=self.kv.first_tokens(n), k_codes_lo=cut(self.k_codes_lo), v_codes_lo=cut(self.v_codes_lo),
                             ref_map=cut(self.ref_map), k_ref=cut(self.k_ref, refs), v_ref=cut(self.v_ref, refs))

    def read_bytes(self, n_quant: int) -> int:
        total = self.kv.read_bytes(n_quant)
        total += sum(t[:, :, :n_quant].nbytes for t in (self.k_codes_lo, self.v_codes_lo, self.ref_map) if t is not None)
        refs = n_quant // self.kv.group_k * self.n_ref
        total += sum(t[:, :, :refs].nbytes for t in (self.k_ref, self.v_ref) if t is not None)
        return total + (self.v_chan.nbytes if self.v_chan is not None else 0)


@triton.jit
def refinement_rows(ref_map, rows, n_ok, grp_row, N_REF, RB: tl.constexpr):
    """ZipCache mixed precision: (compact refinement row, has one) of each of a key group's rows;
    grp_row = the group's first refinement row (flat)."""
    if RB > 0:
        slot = tl.load(ref_map + rows, mask=n_ok, other=255).to(tl.int32)
        has = n_ok & (slot != 255)
        return grp_row * N_REF + tl.where(has, slot, 0), has
    return rows, n_ok


@triton.jit
def integer_units(scale, HIER: tl.constexpr, RB: tl.constexpr):
    """A stored scale in the units of load_codes' integers: QuantSpec's INT8 view counts sixteenths
    of the upper plane's step, ZipCache's mixed codes halves of the salient step."""
    if HIER:
        scale = scale / 16
    if RB > 0:
        scale = scale / 2
    return scale


@triton.jit
def key_group(k_scale, k_zero, ref_map, rows, n_ok, grp, offs_d, d_ok, D, N_REF, HIER: tl.constexpr, RB: tl.constexpr):
    """A key group's constants for the key dot: its per-channel scale (divided to match load_codes'
    integers) and zero, and its rows' refinement rows (ZipCache). grp: the flat group index."""
    sk = integer_units(tl.load(k_scale + grp * D + offs_d, mask=d_ok, other=0.0).to(tl.float32), HIER, RB)
    zk = tl.load(k_zero + grp * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    ref_rows, ref_ok = refinement_rows(ref_map, rows, n_ok, grp, N_REF, RB)
    return sk, zk, ref_rows, ref_ok


@triton.jit
def load_codes(codes, lo, rows, n_ok, offs_d, D, ref, ref_rows, ref_ok, BITS: tl.constexpr, HIER: tl.constexpr,
                RB: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """codes_tile for every store: KIVI's c, QuantSpec's INT8 view 16*U + L - 8 (its scale is s4/16),
    or ZipCache's mixed codes 2^(RB+1) U + (2L where the row has refinement row `ref_rows`, else
    2^RB - 1) (scale s_hi/2). `codes`/`lo`/`ref` point at int32 words (WORDS) or bytes."""
    c = codes_tile(codes, rows, n_ok, offs_d, D, BITS, WORDS, BLOCK_N, BLOCK_D)
    if HIER:  # (both planes have 4 bits)
        c = 16 * c + codes_tile(lo, rows, n_ok, offs_d, D, BITS, WORDS, BLOCK_N, BLOCK_D) - 8
    if RB > 0:
        low = codes_tile(ref, ref_rows, ref_ok, offs_d, D, RB, WORDS, BLOCK_N, BLOCK_D)
        c = (c << (RB + 1)) + tl.where(ref_ok[:, None], 2 * low, (1 << RB) - 1)
    return c


@triton.jit
def _attn_views_kernel(q, k_codes, k_lo, k_scale, k_zero, v_codes, v_lo, v_scale, v_zero, n_quant_ptr,
                       f_idx, f_valid, out_part, lse_part, logits, k_ref, v_ref, ref_map, qk_scale, S, K, D, T, M,
                       SPLIT_LEN, N_REF, NPARTS, BITS: tl.constexpr, HIER: tl.constexpr, RB: tl.constexpr, WORDS: tl.constexpr,
                       GROUP_K: tl.constexpr, NGV: tl.constexpr, HAS_FETCH: tl.constexpr, DOT: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_K: tl.constexpr, SEL: tl.constexpr = 0):
    """Grid (B*Hkv, n_splits): program `split` attends to quantized slots [split*SPLIT_LEN, +SPLIT_LEN)
    below n_quant and writes (out, lse) partial `split` of NPARTS, as gpu/attention.py's _attn_words_kernel
    quantized programs do, reading the codes with load_codes (HIER: the INT8 view; RB > 0: the
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


def _code_view(store: ViewKV, D: int):
    """(WORDS, k_lo, v_lo, k_ref, v_ref): 32-bit word views of the view's parts where the plain codes are
    words (gpu/attention.py's code_layout) and the refinement rows whole words too, else the bytes."""
    words = D & (D - 1) == 0 and (D * store.kv.bits) % 32 == 0 and (D * store.ref_bits) % 32 == 0
    view = (lambda t: None if t is None else t.contiguous().view(torch.int32)) if words else \
        (lambda t: None if t is None else t.contiguous())
    return (words, view(store.kv.k_codes), view(store.kv.v_codes), view(store.k_codes_lo), view(store.v_codes_lo),
            view(store.k_ref), view(store.v_ref))


def launch(store: ViewKV, q, fetched, out_part, lse_part, logits, qk_scale, n_splits: int, split_len: int, NS: int,
           BLOCK_M: int, BLOCK_K: int, select: int = 0, **launch):
    """The quantized programs (bh, split < n_splits) of one attention step (gpu/attention.py's attention_lowbit_triton
    launches the rest), then ZipCache's channel scale on their partials (eq. 6)."""
    B, H, T, D = q.shape
    s = store.kv
    Hkv, S = s.k_codes.shape[1], s.k_codes.shape[2]
    words, k_codes, v_codes, k_lo, v_lo, k_ref, v_ref = _code_view(store, D)
    c = lambda x: x.contiguous() if x is not None else q  # noqa: E731 (absent inputs: any valid pointer)
    f = fetched
    _attn_views_kernel[(B * Hkv, n_splits)](
        q, k_codes, c(k_lo), c(s.k_scale), c(s.k_zero), v_codes, c(v_lo), c(s.v_scale), c(s.v_zero),
        c(s.n_quant), c(f.idx) if f else q, f.valid.contiguous().view(torch.uint8) if f else q,
        out_part, lse_part, logits, c(k_ref), c(v_ref), c(store.ref_map), qk_scale, S, f.k.shape[2] if f else 0, D,
        T, (H // Hkv) * T, split_len, store.n_ref, NS,
        BITS=s.bits, HIER=store.k_codes_lo is not None, RB=store.ref_bits if store.k_ref is not None else 0,
        WORDS=words, GROUP_K=s.group_k, NGV=D // min(s.group_v, D), HAS_FETCH=f is not None,
        DOT=dot_precision(q.dtype), UPCAST=interpreter_upcast(q.dtype), BLOCK_M=BLOCK_M, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_K=BLOCK_K, SEL=select, **launch)
    if store.v_chan is not None:  # zipcache.txt eq. 6: the quantized values times c
        out_part[:, :n_splits] *= store.v_chan.float().reshape(B * Hkv, 1, 1, D)


def attention_views_triton(q, store: ViewKV, residual: Residual, fetched: Optional[Fetched], sm_scale, select=0,
                           **launch_kw):
    """gpu/attention.py's attention_lowbit_triton with this module's quantized programs."""
    def quantized(*args, **kw):
        return launch(store, *args, **kw)
    return attention.attention_lowbit_triton(q, store.kv, residual, fetched, sm_scale, select=select,
                                           quantized=quantized, **launch_kw)


# The op takes the tuples' tensors flat (kernels.op_inputs), the view's parts after them.
@torch.library.custom_op("specache::attention_views", mutates_args=())
def _attention_views_op(q: Tensor, tensors: list[Tensor], ints: list[int], optional: list[Optional[Tensor]],
                        view: list[Optional[Tensor]], view_ints: list[int], sm_scale: float,
                        select: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    kv, residual, fetched = from_op_inputs(tensors, ints, optional)
    out = attention_views_triton(q, ViewKV(kv, *view, *view_ints), residual, fetched, sm_scale, select=select)
    return out if select else (*out, q.new_empty(0, dtype=torch.float32))


@_attention_views_op.register_fake
def _(q, tensors, ints, optional, view, view_ints, sm_scale, select=0):
    return kernels.attention_fake(q, tensors, select)


def attention_views(q, store: ViewKV, residual: Residual, fetched: Optional[Fetched], sm_scale, use_op: bool,
                    select=0):
    """cache.LowBitCache.attend's attention for a store read through a view (same results, same arguments):
    use_op, the Triton kernel behind its custom op (the cache's custom_ops), else the torch reference."""
    if use_op:
        tensors, ints, optional = op_inputs(store.kv, residual, fetched)
        view = [store.k_codes_lo, store.v_codes_lo, store.v_chan, store.k_ref, store.v_ref, store.ref_map]
        out = _attention_views_op(q, tensors, ints, optional, view, [store.ref_bits, store.n_ref], float(sm_scale),
                                  select)
        return out if select else out[:2]
    return kernels.attention_lowbit_ref(q, store, residual, fetched, sm_scale, select)
