"""What the low-bit caches and their kernels share (kernels.py's attention, topk.py's selection,
the caches of cache.py, zipcache.py and quantspec.py): the tuples a kernel reads, the torch
references of the stored codes, and the rules that pick a tile layout.

  LowBitKV   the quantized tokens of a cache (LowBitCache.stored()): codes, scales, zeros, and the
             siblings' extra parts (QuantSpec's lower planes, ZipCache's channel scale and
             refinement rows), None where a cache has none
  Residual   the fp window (the newest tokens), Fetched: fp rows fetched from the host store and the
             quantized positions they replace (eq. 1)

The references dequantize or score every slot with static shapes (garbage past n_quant is masked
by the callers); the Triton kernels fold the same scales and zeros into the query and the
probabilities (docs/design.md). Layout rules: 32-bit words or bytes (`code_layout`), and the
bit-plane tiles (`planes_fit`, `take_planes`: DEFAULT_ATTN_PATH, `plane_codes_mode`).
"""
import os
from typing import NamedTuple, Optional

import torch
import triton

import quant
from config import ATTN_PATHS

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
# torch references
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
    """(WORDS, block_d, k_codes, v_codes, k_lo, v_lo, k_ref, v_ref): 32-bit word views of the codes
    when every row is whole words and D a power of two (the fast path), else the bytes."""
    if store.group_k & (store.group_k - 1) or store.group_k < 16:
        raise ValueError(f"Triton kernels need a power-of-two key group >= 16, got {store.group_k}")
    words = D & (D - 1) == 0 and (D * store.bits) % 32 == 0 and (D * store.ref_bits) % 32 == 0
    view = (lambda t: None if t is None else t.contiguous().view(torch.int32)) if words else \
        (lambda t: None if t is None else t.contiguous())
    return (words, triton.next_power_of_2(D), view(store.k_codes), view(store.v_codes), view(store.k_codes_lo),
            view(store.v_codes_lo), view(store.k_ref), view(store.v_ref))


# Attention paths over the quantized slots: "words" (32-bit words unpacked by shifts), "planes" (bit-plane tiles),
# "gluon" (plane tiles in attn_gluon's kernel, compiled 16-bit launches). One default for the interpreter and a GPU
# (tests check what ships): words, until planes/Gluon pass tests/test_cuda.py and win a GPU run (`make gpu-check`).
DEFAULT_ATTN_PATH = "words"  # (config.ATTN_PATHS names them)


def interpreted() -> bool:
    """Triton kernels run in the interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def has_views(store: LowBitKV) -> bool:
    """Whether the codes are read through a view (QuantSpec's INT8 view of two planes, ZipCache's mixed
    codes): attn_views.py's kernel attends to them, kernels.py's to plain codes."""
    return store.k_codes_lo is not None or store.k_ref is not None


def _plane_keys_fit(store: LowBitKV, D: int) -> bool:
    """Plain KIVI codes (no INT8 view, no mixed codes), whole 32-bit words per row, D a power of two."""
    return store.k_codes_lo is None and store.k_ref is None and D & (D - 1) == 0 and (D * store.bits) % 32 == 0


def planes_fit(store: LowBitKV, D: int, M: int) -> bool:
    """Whether the bit-plane path takes this layout (M query rows of head_dim D per KV head)."""
    NGV = D // min(store.group_v, D)
    return _plane_keys_fit(store, D) and NGV & (NGV - 1) == 0 and triton.next_power_of_2(M) * NGV <= 32


def take_planes(fits: bool, attn_path: Optional[str], what: str) -> bool:
    """Whether a launch reads bit-plane tiles (planes and Gluon paths); a path named must fit the layout."""
    path = attn_path or DEFAULT_ATTN_PATH
    if path not in ATTN_PATHS:
        raise ValueError(f"unknown attention path {path!r} ({', '.join(ATTN_PATHS)})")
    if attn_path not in (None, "words") and not fits:
        raise ValueError(f"the bit-plane {what} does not take this cache layout")
    return fits and path != "words"


def plane_codes_mode(store: LowBitKV, D: int, dtype) -> tuple[int, float]:
    """(CODES, CODE_OFF) of tiles.plane_codes for the model's dtype."""
    dot16 = dtype != torch.float32 and not interpreter_upcast(dtype)
    # 16-bit dots read codes as MAGIC + c (exact: c < 128 in bf16, < 1024 in fp16); fp32 converts
    # (the PTX unpacks four elements with one shift: they must share a bit plane, which holds wherever a
    # plane's W bytes are a multiple of the 16 columns a dot-operand layout groups; else Triton's ops)
    codes = 0 if not dot16 or (dtype == torch.bfloat16 and store.bits == 8) else \
        1 if interpreted() or (D * store.bits // 8) % 16 else 2
    return codes, (128.0 if dtype == torch.bfloat16 else 1024.0) if codes else 0.0


def planes_for_keys(store: LowBitKV, D: int, dtype, attn_path=None) -> Optional[tuple[int, float]]:
    """(CODES, CODE_OFF) where a kernel that reads only the keys (topk.py's scores) takes the bit-plane
    tiles, else None: plain KIVI codes of whole 32-bit words per row, D a power of two, on the planes and
    Gluon paths (the scores have no Gluon kernel: both read the plane tiles)."""
    return plane_codes_mode(store, D, dtype) if take_planes(_plane_keys_fit(store, D), attn_path, "path") else None


# =============================================================================================
# custom ops' inputs, bytes read
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


def lowbit_read_bytes(store: LowBitKV, n_quant: int, values: bool = True) -> int:
    """Bytes of the stored codes and scales of tokens [0, n_quant) (absent tensors count 0); values=False:
    the keys' only (what the top-k pass reads)."""
    if not values:
        store = store._replace(v_codes=None, v_scale=None, v_zero=None, v_codes_lo=None, v_chan=None)
    per_row = [store.k_codes, store.v_codes, store.v_scale, store.v_zero, store.k_codes_lo, store.v_codes_lo]
    per_group = [store.k_scale, store.k_zero]
    total = sum(t[:, :, :n_quant].nbytes for t in per_row if t is not None)
    total += sum(t[:, :, :n_quant // store.group_k].nbytes for t in per_group if t is not None)
    if store.ref_map is not None:  # ZipCache mixed: the slot map and the groups' refinement rows
        total += store.ref_map[:, :, :n_quant].nbytes
        total += sum(t[:, :, :n_quant // store.group_k * store.n_ref].nbytes for t in (store.k_ref, store.v_ref))
    return total + (store.v_chan.nbytes if store.v_chan is not None else 0)
