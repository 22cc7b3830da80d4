"""Decode-time kernels over the low-bit device cache (SpeCache §3.2-3.4).

  attention_lowbit  attention of T new query tokens over
                      quantized slots [0, n_quant)  (codes dequantized on the fly),
                      minus the slots whose fp rows were fetched (eq. 1: C' ∪ C_K replaces C'_K),
                      plus the fetched fp rows and the fp residual window (causal among the new tokens).
(topk.py selects the rows to fetch from the same stored codes; its Triton kernel shares the code
loads below.)

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
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

import quant
from config import ATTN_PATHS
from tiles import (fetched_hits, fetched_mask, integer_units, key_group, load_codes, online_softmax, plane_codes,
                   tile_channels)

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
    # ZipCache mixed precision (quant.quantize_mixed): the lower codes of each key group's n_ref
    # salient rows, and each slot's place among them (255: not salient, reads the midpoint)
    k_ref: Optional[Tensor] = None  # [B,Hkv,S/group_k*n_ref,D*ref_bits/8] uint8
    v_ref: Optional[Tensor] = None
    ref_map: Optional[Tensor] = None  # [B,Hkv,S] uint8
    ref_bits: int = 0
    n_ref: int = 0


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
    """Keys in fp32 [B,Hkv,S,D] (KIVI; QuantSpec's 8-bit view when k_codes_lo is given; ZipCache mixed)."""
    if s.k_codes_lo is not None:
        return quant.dequantize_hier_keys(s.k_codes, s.k_codes_lo, s.k_scale, s.k_zero, s.group_k, view_bits=8)
    if s.k_ref is not None:
        return quant.dequantize_codes(_codes(s, "k"), s.k_scale.float() / 2, s.k_zero, s.group_k, "tokens")
    return quant.dequantize_keys(s.k_codes, s.k_scale, s.k_zero, s.bits, s.group_k)


def dequant_values(s: LowBitKV) -> Tensor:
    """Values in fp32 [B,Hkv,S,D] (KIVI; QuantSpec 8-bit view; ZipCache's mixed codes and channel scale)."""
    if s.v_codes_lo is not None:
        v = quant.dequantize_hier_values(s.v_codes, s.v_codes_lo, s.v_scale, s.v_zero, s.group_v, view_bits=8)
    elif s.v_ref is not None:
        D = s.v_codes.shape[-1] * 8 // s.bits
        v = quant.dequantize_codes(_codes(s, "v"), s.v_scale.float() / 2, s.v_zero, min(s.group_v, D), "channels")
    else:
        v = quant.dequantize_values(s.v_codes, s.v_scale, s.v_zero, s.bits, s.group_v)
    if s.v_chan is not None:  # ZipCache eq. 6: x' = dequant * c
        v = v * s.v_chan.float()[..., None, :]
    return v


def first_tokens(s: LowBitKV, n: int) -> LowBitKV:
    """The stored tuple cut to quantized tokens [0, n) (n a multiple of the key group)."""
    cut = lambda x, m=n: None if x is None else x[:, :, :m]  # noqa: E731
    return s._replace(k_codes=cut(s.k_codes), k_scale=cut(s.k_scale, n // s.group_k), k_zero=cut(s.k_zero, n // s.group_k),
                      v_codes=cut(s.v_codes), v_scale=cut(s.v_scale), v_zero=cut(s.v_zero), k_codes_lo=cut(s.k_codes_lo),
                      v_codes_lo=cut(s.v_codes_lo), ref_map=cut(s.ref_map), k_ref=cut(s.k_ref, n // s.group_k * s.n_ref),
                      v_ref=cut(s.v_ref, n // s.group_k * s.n_ref))


def replaced_mask(fetched: Fetched, S: int) -> Tensor:
    """[B,Hkv,S] bool: quantized slots whose fp row was fetched. Unused fetch slots point at S-1,
    a scratch slot that is never attended."""
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return torch.zeros(*fetched.idx.shape[:2], S, dtype=torch.bool, device=fetched.idx.device).scatter(2, safe, fetched.valid)


def _codes(s: LowBitKV, kv: str) -> Tensor:
    """Integer codes of the keys (kv="k") or values as fp32 [B,Hkv,S,D]: KIVI's c, QuantSpec's INT8
    view 16*U + L - 8, or ZipCache's mixed codes (each salient row's lower codes gathered from the
    compact refinement rows of its key group); `_code_div(s)` divides the stored scale to match."""
    codes, lo, ref = (s.k_codes, s.k_codes_lo, s.k_ref) if kv == "k" else (s.v_codes, s.v_codes_lo, s.v_ref)
    c = quant.unpack_bits(codes, s.bits, torch.int32)
    if lo is not None:
        c = 16 * c + quant.unpack_bits(lo, 4, torch.int32) - 8
    if ref is not None:
        B, Hkv, S, D = c.shape
        has = s.ref_map != 255
        row = torch.arange(S, device=c.device) // s.group_k * s.n_ref + torch.where(has, s.ref_map.long(), 0)
        lower = quant.unpack_bits(ref, s.ref_bits, torch.int32).gather(2, row[..., None].expand(B, Hkv, S, D))
        c = quant.mixed_codes(c, lower, has, s.ref_bits)
    return c.float()


def _code_div(s: LowBitKV) -> int:
    """What the stored scales are divided by for `_codes`' integers: QuantSpec's s4/16, ZipCache's s_hi/2."""
    return 16 if s.k_codes_lo is not None else 2 if s.k_ref is not None else 1


def key_logits(qg, s: LowBitKV) -> Tensor:
    """qg [B,Hkv,M,D] (fp32, pre-scaled) -> q.k' [B,Hkv,M,S] over every slot (garbage past n_quant).
    The keys' per-channel scale and zero of each token group fold into the query, as in the Triton
    kernel: q.k' = (q*s_g).c + q.z_g, so only the integer codes are expanded to [S, D]."""
    B, Hkv, M, D = qg.shape
    S, g = s.k_codes.shape[2], s.group_k
    c = _codes(s, "k").view(B, Hkv, S // g, g, D)
    scale = s.k_scale.float() / _code_div(s)  # [B,Hkv,S/g,D]
    qs = qg[:, :, None] * scale[:, :, :, None, :]  # [B,Hkv,S/g,M,D]
    logits = qs @ c.transpose(-1, -2) + (qg @ s.k_zero.float().transpose(-1, -2)).transpose(-1, -2)[..., None]
    return logits.permute(0, 1, 3, 2, 4).reshape(B, Hkv, M, S)


def value_sum(p, s: LowBitKV, keep) -> Tensor:
    """sum_n p[.., n] v'_n for p [B,Hkv,M,S] (zero where not keep [B,Hkv,S]) -> [B,Hkv,M,D]. The
    values' per-token scale and zero of each channel group fold into the probabilities, as in the
    Triton kernel: sum_n p_n (c_n s_n + z_n) = (p*s).c + sum_n p_n z_n."""
    D = s.v_codes.shape[-1] * 8 // s.bits
    c = _codes(s, "v")
    gv = min(s.group_v, D)
    div = _code_div(s)
    zero = torch.zeros((), device=p.device)
    scale = torch.where(keep[..., None], s.v_scale.float() / div, zero)  # garbage rows (NaN/inf) -> 0
    zeros = torch.where(keep[..., None], s.v_zero.float(), zero)
    out = torch.cat([(p * scale[:, :, None, :, j]) @ c[..., j * gv:(j + 1) * gv] + p @ zeros[..., j:j + 1]
                     for j in range(D // gv)], -1)
    if s.v_chan is not None:  # ZipCache eq. 6: x' = dequant * c
        out = out * s.v_chan.float()[:, :, None, :]
    return out


def attention_lowbit_ref(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale):
    """Softmax attention of the T query tokens over three parts: the quantized slots [0, n_quant)
    without the fetched positions, the fetched fp rows, and the residual rows (causal)."""
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    M, dev = (H // Hkv) * T, q.device
    qg = q.float().reshape(B, Hkv, M, D) * sm_scale

    keep_q = (torch.arange(S, device=dev) < store.n_quant).expand(B, Hkv, S)
    if fetched is not None:  # eq. 1: a fetched fp row replaces its quantized copy
        keep_q = keep_q & ~replaced_mask(fetched, S)
    t = torch.arange(M, device=dev) % T  # query row m = g*T + t sees residual rows < length - T + t + 1
    keep_res = torch.arange(R, device=dev) < residual.length - T + 1 + t[:, None]  # [M, R]
    fp_parts = [(residual.k, residual.v, keep_res)]
    if fetched is not None:
        fp_parts.append((fetched.k, fetched.v, fetched.valid[:, :, None, :]))
    # scores of each part, masked; one softmax over all of them
    scores = [torch.where(keep_q[:, :, None, :], key_logits(qg, store), -math.inf)]
    scores += [torch.where(keep, qg @ k.float().transpose(-1, -2), -math.inf) for k, _, keep in fp_parts]
    m = torch.stack([x.amax(-1) for x in scores], -1).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = [torch.exp(x - m) for x in scores]
    l = sum(x.sum(-1, keepdim=True) for x in p)
    out = value_sum(p[0], store, keep_q)
    for pi, (_, v, keep) in zip(p[1:], fp_parts):  # garbage rows are zeroed: NaN would leak through p = 0
        rows_ok = keep.any(-2) if keep.shape[-2] > 1 else keep[..., 0, :]
        out = out + pi @ torch.where(rows_ok.expand(B, Hkv, -1)[..., None], v.float(), 0.0)
    out = out / torch.where(l > 0, l, 1.0)
    lse = (m + torch.log(l)).squeeze(-1)
    return out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)


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
# (flash-decoding). Rows that are not whole 32-bit words take a byte-wise path (WORDS=False). The
# bit-plane path (PLANES, plain KIVI codes) orders a tile's channels plane-major, so each code
# shifts out of its own byte with no reshape (no shared-memory round trip), makes 16-bit codes under
# a magic exponent, and serves every value group with one dot (docs/kernels.md has the costs).
LOG2E = 1.4426950408889634


@triton.jit
def _attn_split_kernel(q, k_codes, k_lo, k_scale, k_zero, v_codes, v_lo, v_scale, v_zero, v_chan, n_quant_ptr,
                       f_idx, f_valid, f_k, f_v, r_k, r_v, res_len_ptr, out_part, lse_part, k_ref, v_ref, ref_map,
                       qk_scale, S, R, K, D, T, M, SPLIT_LEN, N_REF, SPLIT0, NPARTS,
                       BITS: tl.constexpr, HIER: tl.constexpr, RB: tl.constexpr, WORDS: tl.constexpr, GROUP_K: tl.constexpr,
                       NGV: tl.constexpr, HAS_FETCH: tl.constexpr, HAS_CHAN: tl.constexpr, DOT: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr,
                       PLANES: tl.constexpr = False, RG: tl.constexpr = 1, CODES: tl.constexpr = 0,
                       CODE_OFF: tl.constexpr = 0.0, QUANT: tl.constexpr = True):
    """Grid (B*Hkv, n_splits + 1). Program `split` < n_splits attends to quantized slots
    [split*SPLIT_LEN, +SPLIT_LEN) below n_quant; the last one to the fetched and residual fp rows.
    Each writes (out, lse) partial `split` of NPARTS for the kv head's G*T query rows m = g*T + t.
    SPLIT0 offsets the program index (grid (B*Hkv, 1) with SPLIT0 = n_splits: the fp-row program
    alone, beside attn_gluon's quantized programs); QUANT=False compiles the fp-row program only.
    PLANES (the bit-plane path, for the quantized slots): the tile's columns are channels in
    plane-major order (tiles.plane_codes), and its rows hold RG copies of the query rows, copy g taking
    the values' channel group g: one value dot serves every channel group (each with its own
    per-token scale), and the copies fill the MMA's 16 rows that M = 8 query rows would leave empty."""
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1) + SPLIT0
    n_splits = NPARTS - 1
    MR: tl.constexpr = BLOCK_M // RG
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = offs_r % MR  # the query row of each tile row
    offs_c = tl.arange(0, BLOCK_D)
    offs_d = tile_channels(offs_c, BLOCK_D, BITS, PLANES)
    m_ok = offs_m < M
    d_ok = offs_d < D
    qt = tl.load(q + (bh * M + offs_m[:, None]) * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    qt = qt.to(tl.float32) * qk_scale  # scores in log2 units: exp2 below
    dt = q.dtype.element_ty  # the dots' input type: the model's (fp32 with IEEE dots)
    if UPCAST:
        dt = tl.float32
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_FETCH:
        k_ok = offs_k < K
        fidx = tl.load(f_idx + bh * K + offs_k, mask=k_ok, other=-1)
        fidx = tl.where(tl.load(f_valid + bh * K + offs_k, mask=k_ok, other=0) != 0, fidx, -1)
    if QUANT and split < n_splits:
        lo = split * SPLIT_LEN
        hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, tl.load(n_quant_ptr)), S)
        if PLANES:
            grp_r = offs_r // MR
            for n0 in range(lo, hi, GROUP_K):
                offs_n = n0 + tl.arange(0, GROUP_K)
                n_ok = offs_n < hi
                rows = bh * S + offs_n
                grp = bh * (S // GROUP_K) + n0 // GROUP_K
                # keys: q.k' = (q*s_k).c + q.z_k; codes read as CODE_OFF + c, whose extra CODE_OFF * sum(q*s_k)
                # is taken off with the zero term (from the same rounded q*s_k the dot saw)
                qs = (qt * tl.load(k_scale + grp * D + offs_d).to(tl.float32)[None, :]).to(dt)
                zk = tl.load(k_zero + grp * D + offs_d).to(tl.float32)
                ck = plane_codes(k_codes, rows[None, :], offs_c[:, None], dt, BITS, BLOCK_D, CODES)
                s = tl.dot(qs, ck, input_precision=DOT) + tl.sum(qt * zk[None, :] - CODE_OFF * qs.to(tl.float32), 1)[:, None]
                keep = n_ok
                if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy
                    keep = keep & ~fetched_mask(n0, fidx, GROUP_K)
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
            if HAS_CHAN:  # ZipCache eq. 6: every dequantized value row is multiplied by c
                acc = acc * tl.load(v_chan + bh * D + offs_d).to(tl.float32)[None, :]
        else:
            for n0 in range(lo, hi, GROUP_K):
                offs_n = n0 + tl.arange(0, GROUP_K)
                n_ok = offs_n < hi
                rows = bh * S + offs_n
                # keys: this block is one key group; its scale/zero fold into the query
                sk, zk, ref_rows, ref_ok = key_group(k_scale, k_zero, ref_map, rows, n_ok, bh * (S // GROUP_K) + n0 // GROUP_K,
                                                      offs_d, d_ok, D, N_REF, HIER, RB)
                ck = load_codes(k_codes, k_lo, rows, n_ok, offs_d, D, k_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS,
                                 GROUP_K, BLOCK_D)
                s = tl.dot((qt * sk[None, :]).to(dt), tl.trans(ck.to(dt)), input_precision=DOT)
                s = s + tl.sum(qt * zk[None, :], 1)[:, None]
                keep = n_ok
                if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy
                    keep = keep & (fetched_hits(offs_n, fidx) == 0)
                s = tl.where(keep[None, :], s, -float("inf"))
                m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
                # values: per-token scale/zero of each channel group fold into p
                cv = load_codes(v_codes, v_lo, rows, n_ok, offs_d, D, v_ref, ref_rows, ref_ok, BITS, HIER, RB, WORDS,
                                 GROUP_K, BLOCK_D).to(dt)
                for j in tl.static_range(NGV):
                    sv = integer_units(tl.load(v_scale + rows * NGV + j, mask=n_ok, other=0.0).to(tl.float32), HIER, RB)
                    zv = tl.load(v_zero + rows * NGV + j, mask=n_ok, other=0.0).to(tl.float32)
                    part = tl.dot((p * sv[None, :]).to(dt), cv, input_precision=DOT) + tl.sum(p * zv[None, :], 1)[:, None]
                    if NGV == 1:
                        acc += part
                    else:
                        acc += tl.where((offs_d // (D // NGV) == j)[None, :], part, 0.0)
            if HAS_CHAN:  # ZipCache eq. 6: every dequantized value row is multiplied by c
                acc = acc * tl.load(v_chan + bh * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    else:
        if PLANES:  # fp rows: channels in their own order (masks and loads of contiguous, aligned
            offs_d = offs_c  # channels: vectorized); the store follows offs_d
            d_ok = offs_d < D
            qt = tl.load(q + (bh * M + offs_m[:, None]) * D + offs_d[None, :], mask=m_ok[:, None], other=0.0)
            qt = qt.to(tl.float32) * qk_scale
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
                m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
                acc += tl.dot(p.to(dt), vt, input_precision=DOT)
        # residual rows [0, res_len); query row m (token t = m % T) sees rows < res_len - T + t + 1
        res_len = tl.minimum(tl.load(res_len_ptr), R)
        limit = res_len - T + 1 + offs_m % T
        for r0 in range(0, res_len, BLOCK_F):
            r = r0 + offs_f
            r_ok = r < res_len
            ptr = (bh * R + r[:, None]) * D + offs_d[None, :]
            kt = tl.load(r_k + ptr, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
            vt = tl.load(r_v + ptr, mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(dt)
            causal = r_ok[None, :] & (r[None, :] < limit[:, None])
            s = tl.where(causal, tl.dot(qd, tl.trans(kt), input_precision=DOT), -float("inf"))
            m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
            acc += tl.dot(p.to(dt), vt, input_precision=DOT)
    if RG > 1:  # each row copy keeps its own channel group (their softmax statistics are the same)
        acc = tl.sum(tl.reshape(tl.where(offs_r[:, None] // MR == offs_d[None, :] // (D // NGV), acc, 0.0),
                                (RG, MR, BLOCK_D)), 0)
        m_i = tl.max(tl.reshape(m_i, (RG, MR)), 0)
        l_i = tl.max(tl.reshape(l_i, (RG, MR)), 0)
        offs_m = tl.arange(0, MR)
        m_ok = offs_m < M
    has = l_i > 0
    part = (bh * NPARTS + split) * M + offs_m
    tl.store(out_part + part[:, None] * D + offs_d[None, :], acc / tl.where(has, l_i, 1.0)[:, None],
             mask=m_ok[:, None] & d_ok[None, :])
    # natural-log lse (scores were in log2 units)
    tl.store(lse_part + part, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                                       -float("inf")), mask=m_ok)


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
def dot_precision(dtype):
    """fp32 is the reference precision: IEEE dots (Triton's default for fp32 is TF32, ~1e-3 off).
    16-bit models keep tensor-core dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_upcast(dtype) -> bool:
    """The interpreter computes bf16 dots wrongly (silently): there, bf16 operands go up to fp32.
    Compiled kernels always take the model's dtype (the compile gate and the GPU checks cover them)."""
    return dtype == torch.bfloat16 and _interpreted()


def code_layout(store: LowBitKV, D: int):
    """(WORDS, block_d, k_codes, v_codes, k_lo, v_lo, k_ref, v_ref): 32-bit word views of the codes
    when every row is whole words and D a power of two (the fast path), else the bytes."""
    if store.group_k & (store.group_k - 1) or store.group_k < 16:
        raise ValueError(f"Triton kernels need a power-of-two key group >= 16, got {store.group_k}")
    words = D & (D - 1) == 0 and (D * store.bits) % 32 == 0 and (D * store.ref_bits) % 32 == 0
    view = (lambda t: None if t is None else t.contiguous().view(torch.int32)) if words else \
        (lambda t: None if t is None else t.contiguous())
    return (words, triton.next_power_of_2(D), view(store.k_codes), view(store.v_codes), view(store.k_codes_lo),
            view(store.v_codes_lo), view(store.k_ref), view(store.v_ref))


def programs_target(device) -> int:
    """About four programs per SM on a GPU; a handful under the interpreter."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


# 16-bit decode shapes (G*T <= 16 query rows): 2 warps, no software pipelining. On an H100
# (Llama-3.1-8B shapes, 32k, bf16) this took the 1-bit attention from 110.7 to 96.4 us and the 2-bit
# from 112.8 to 100.7 (Triton's default 4 warps / 3 stages; results/gpu-h100-2026-11-22/
# sweep-launch-configs.txt). fp32 (the reference precision, unmeasured on a GPU) keeps the defaults.
# `launch` (num_warps, num_stages) overrides either, for tuning sweeps.
DECODE_LAUNCH = dict(num_warps=2, num_stages=1)
FP_ROWS_LAUNCH = dict(num_warps=4, num_stages=2)  # the fp-row program alone: <= 128 registers (not timed)


# Attention paths over the quantized slots: "words" (32-bit words unpacked by shifts), "planes" (bit-plane tiles),
# "gluon" (plane tiles in attn_gluon's kernel, compiled 16-bit launches). One default for the interpreter and a GPU
# (tests check what ships): words, until planes/Gluon pass tests/test_cuda.py and win a GPU run (`make gpu-check`).
DEFAULT_ATTN_PATH = "words"  # (config.ATTN_PATHS names them)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _plane_keys_fit(store: LowBitKV, D: int) -> bool:
    """Plain KIVI codes (no INT8 view, no mixed codes), whole 32-bit words per row, D a power of two."""
    return store.k_codes_lo is None and store.k_ref is None and D & (D - 1) == 0 and (D * store.bits) % 32 == 0


def planes_fit(store: LowBitKV, D: int, M: int) -> bool:
    """Whether the bit-plane path takes this layout (M query rows of head_dim D per KV head)."""
    NGV = D // min(store.group_v, D)
    return _plane_keys_fit(store, D) and NGV & (NGV - 1) == 0 and triton.next_power_of_2(M) * NGV <= 32


def _take_planes(fits: bool, attn_path: Optional[str], what: str) -> bool:
    """Whether a launch reads bit-plane tiles (planes and Gluon paths); a path named must fit the layout."""
    path = attn_path or DEFAULT_ATTN_PATH
    if path not in ATTN_PATHS:
        raise ValueError(f"unknown attention path {path!r} ({', '.join(ATTN_PATHS)})")
    if attn_path not in (None, "words") and not fits:
        raise ValueError(f"the bit-plane {what} does not take this cache layout")
    return fits and path != "words"


def _planes_layout(store: LowBitKV, D: int, M: int, dtype, attn_path=None):
    """(RG, BLOCK_M, CODES, CODE_OFF) of the bit-plane path, or None (words; QuantSpec's INT8 view, ZipCache's
    mixed codes, rows not whole 32-bit words, D or value groups not powers of two, or > 32 tile rows)."""
    NGV = D // min(store.group_v, D)
    rows = triton.next_power_of_2(M) * NGV
    if not _take_planes(planes_fit(store, D, M), attn_path, "attention path"):
        return None
    return (NGV, max(16, rows)) + plane_codes_mode(store, D, dtype)


def plane_codes_mode(store: LowBitKV, D: int, dtype) -> tuple[int, float]:
    """(CODES, CODE_OFF) of tiles.plane_codes for the model's dtype."""
    dot16 = dtype != torch.float32 and not interpreter_upcast(dtype)
    # 16-bit dots read codes as MAGIC + c (exact: c < 128 in bf16, < 1024 in fp16); fp32 converts
    # (the PTX unpacks four elements with one shift: they must share a bit plane, which holds wherever a
    # plane's W bytes are a multiple of the 16 columns a dot-operand layout groups; else Triton's ops)
    codes = 0 if not dot16 or (dtype == torch.bfloat16 and store.bits == 8) else \
        1 if _interpreted() or (D * store.bits // 8) % 16 else 2
    return codes, (128.0 if dtype == torch.bfloat16 else 1024.0) if codes else 0.0


def planes_for_keys(store: LowBitKV, D: int, dtype, attn_path=None) -> Optional[tuple[int, float]]:
    """(CODES, CODE_OFF) where a kernel that reads only the keys (topk.py's scores) takes the bit-plane
    tiles, else None: plain KIVI codes of whole 32-bit words per row, D a power of two, on the planes and
    Gluon paths (the scores have no Gluon kernel: both read the plane tiles)."""
    return plane_codes_mode(store, D, dtype) if _take_planes(_plane_keys_fit(store, D), attn_path, "path") else None


def attention_lowbit_triton(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale,
                            n_splits=None, attn_path=None, **launch):
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    M, BH, G = (H // Hkv) * T, B * Hkv, H // Hkv
    group_v = min(store.group_v, D)
    assert store.k_scale.shape[2] * store.group_k == S, "quantized slots must be a whole number of key groups"
    words, BLOCK_D, k_codes, v_codes, k_lo, v_lo, k_ref, v_ref = code_layout(store, D)
    plane = _planes_layout(store, D, M, q.dtype, attn_path)
    if plane is not None:  # bytes, not words
        k_codes, v_codes = store.k_codes.contiguous(), store.v_codes.contiguous()
    RG, BLOCK_M, CODES, CODE_OFF = plane or (1, max(16, triton.next_power_of_2(M)), 0, 0.0)
    n_blocks = triton.cdiv(S, store.group_k)
    if n_splits is None:
        n_splits = min(n_blocks, max(1, programs_target(q.device) // BH))
    # Gluon: attn_gluon runs the quantized programs (a split: whole warps' key groups); imported here: only Gluon needs it
    gluon = plane is not None and (attn_path or DEFAULT_ATTN_PATH) == "gluon"
    if gluon:
        import attn_gluon
        gluon = not _interpreted() and attn_gluon.fits(store, D, M, q.dtype)
        if attn_path and not gluon:
            raise ValueError("the Gluon path takes compiled 16-bit launches that attn_gluon.fits")
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
    qk_scale = float(sm_scale) * LOG2E
    if gluon:
        attn_gluon.launch(q, store, k_codes, v_codes, f, out_part, lse_part, qk_scale, n_splits, split_len, NS)
    _attn_split_kernel[(BH, 1 if gluon else NS)](
        q, k_codes, c(k_lo), c(store.k_scale), c(store.k_zero), v_codes, c(v_lo), c(store.v_scale), c(store.v_zero),
        c(store.v_chan), c(store.n_quant), c(f.idx) if f else q, f.valid.contiguous().view(torch.uint8) if f else q,
        c(f.k) if f else q, c(f.v) if f else q, c(residual.k), c(residual.v), c(residual.length), out_part, lse_part,
        c(k_ref), c(v_ref), c(store.ref_map), qk_scale, S, R, K, D, T, M, split_len, store.n_ref,
        n_splits if gluon else 0, NS,
        BITS=store.bits, HIER=store.k_codes_lo is not None, RB=store.ref_bits if store.k_ref is not None else 0,
        WORDS=words, GROUP_K=store.group_k, NGV=D // group_v,
        HAS_FETCH=f is not None, HAS_CHAN=store.v_chan is not None, DOT=dot_precision(q.dtype),
        UPCAST=interpreter_upcast(q.dtype), BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_K=max(16, triton.next_power_of_2(max(K, 1))),
        BLOCK_F=64, PLANES=plane is not None, RG=RG, CODES=CODES, CODE_OFF=CODE_OFF, QUANT=not gluon,
        **{**(DECODE_LAUNCH if M <= 16 and q.dtype != torch.float32 else {}), **(FP_ROWS_LAUNCH if gluon else {}), **launch})
    out = torch.empty_like(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    _attn_combine_kernel[(BH, M)](out_part, lse_part, out, lse, NS, M, D,
                                  BLOCK_S=triton.next_power_of_2(NS), BLOCK_D=BLOCK_D)
    return out, lse


# =============================================================================================
# custom ops (CUDA path, opaque to torch.compile) and the public dispatchers
# =============================================================================================
# The ops take the tuples' tensors flat (custom ops take tensors, not tuples): `op_inputs` / `from_op_inputs`.
def op_inputs(store: LowBitKV, residual: Residual, fetched: Optional[Fetched]):
    f = fetched or Fetched(None, None, None, None)
    tensors = (store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero, store.n_quant,
               residual.k, residual.v, residual.length)
    optional = (store.k_codes_lo, store.v_codes_lo, store.v_chan, store.k_ref, store.v_ref, store.ref_map,
                f.k, f.v, f.idx, f.valid)
    return tensors, (store.bits, store.group_k, store.group_v, store.ref_bits, store.n_ref), optional


def from_op_inputs(tensors, ints, optional):
    k_lo, v_lo, v_chan, k_ref, v_ref, ref_map, f_k, f_v, f_idx, f_valid = optional
    store = LowBitKV(*tensors[:7], *ints[:3], k_lo, v_lo, v_chan, k_ref, v_ref, ref_map, *ints[3:])
    residual = Residual(*tensors[7:10]) if len(tensors) == 10 else None  # (top-k reads no residual)
    return store, residual, (Fetched(f_k, f_v, f_idx, f_valid) if f_k is not None else None)


@torch.library.custom_op("specache::attention_lowbit", mutates_args=())
def _attention_lowbit_op(q: Tensor, tensors: list[Tensor], ints: list[int], optional: list[Optional[Tensor]],
                         sm_scale: float, attn_path: Optional[str] = None) -> tuple[Tensor, Tensor]:
    return attention_lowbit_triton(q, *from_op_inputs(tensors, ints, optional), sm_scale, attn_path=attn_path)


@_attention_lowbit_op.register_fake
def _(q, tensors, ints, optional, sm_scale, attn_path=None):
    # contiguous, like the real op (which makes q contiguous first), whatever q's strides
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def attention_lowbit(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale, use_op=None, attn_path=None):
    """-> (out [B,H,T,D] in q.dtype, lse [B,H,T] fp32 natural-log logsumexp of the scaled scores).
    use_op: run the Triton kernel behind its custom op (default: on CUDA); True on CPU tensors gives a
    compiled CPU step the CUDA step's graph, the kernel interpreted (TRITON_INTERPRET=1, tests). attn_path: ATTN_PATHS."""
    if q.is_cuda if use_op is None else use_op:
        tensors, ints, optional = op_inputs(store, residual, fetched)
        return _attention_lowbit_op(q, list(tensors), list(ints), list(optional), float(sm_scale), attn_path)
    return attention_lowbit_ref(q, store, residual, fetched, sm_scale)


def lowbit_read_bytes(store: LowBitKV, n_quant: int) -> int:
    """Bytes of the stored codes and scales of tokens [0, n_quant) (absent tensors count 0)."""
    per_row = [store.k_codes, store.v_codes, store.v_scale, store.v_zero, store.k_codes_lo, store.v_codes_lo]
    per_group = [store.k_scale, store.k_zero]
    total = sum(t[:, :, :n_quant].nbytes for t in per_row if t is not None)
    total += sum(t[:, :, :n_quant // store.group_k].nbytes for t in per_group if t is not None)
    if store.ref_map is not None:  # ZipCache mixed: the slot map and the groups' refinement rows
        total += store.ref_map[:, :, :n_quant].nbytes
        total += sum(t[:, :, :n_quant // store.group_k * store.n_ref].nbytes for t in (store.k_ref, store.v_ref))
    return total + (store.v_chan.nbytes if store.v_chan is not None else 0)
