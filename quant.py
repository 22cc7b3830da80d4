"""Low-bit KV quantization for the device copy of the cache (SpeCache §3.4).

All tensors are [B, H, T, D] (batch, kv heads, tokens, head_dim). Every variant below is built on
one asymmetric round-to-nearest quantizer, `_group_params` + `round_clamp` + `dequantize_codes`:

  x' = code * s + z                                                    (SpeCache eq. 2, KIVI)
  z = min, s = (max - min) / (2^B - 1)                                 (eq. 2, any bits)
  z = (3 min + max) / 4, s = (max - min) / 2                           (eq. 3, improved 1-bit)

Layouts (KIVI): keys are quantized per channel over groups of `group` consecutive tokens, values
per token over groups of `group` consecutive channels. Codes are bit-packed along D; scale/zero
are stored in `meta_dtype` (fp16 by default) and the codes are computed against the *stored*
scale/zero, so every error bound holds for what the cache actually keeps.

`fit="lsq"` refines eq. 2/3's zero and scale (same bytes) by Lloyd's iterations on the uniform
grid (`_lsq_refit`): lower squared error, hence better low-bit ranking for SpeCache's top-k.

Other quantizers build on the same core (quantize_codes, dequantize_codes) in their own modules.

What a low-bit cache stores, as the kernels read it (kernels.py, gpu/): `LowBitKV` (codes, scales and zeros,
with their torch references as methods: key_logits, value_sum, dequantized), `Residual` (the fp window) and
`Fetched` (fp rows fetched from the host and the quantized positions they replace, eq. 1). The references
dequantize or score every slot with static shapes (garbage past n_quant is masked by the callers); the
Triton kernels fold the same scales and zeros into the query and the probabilities (docs/design.md).

What the caches hold, in bytes: `deployed_nbytes` (a 16-bit deployment's, whatever dtype the run computes in),
`MemoryMeter` (the device bytes over time) and `kv_fp16_bytes` (the 16-bit cache every low-bit figure is compared
with). cache.py's caches and the baselines' count their own buffers with these.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

Tensor = torch.Tensor

BITS = (1, 2, 4, 8)
ONE_BIT_MODES = ("improved", "kivi")
FITS = ("range", "lsq")  # zero/scale: from min and max (eq. 2/3), or least-squares refit of that
LSQ_ITERS = 3  # Lloyd's iterations: the first gets most of the fit's gain, three nearly all (docs/policies.md)


# ---- bit packing ----------------------------------------------------------------------------------
def _shifts(bits, device, dtype=torch.int32):
    return torch.arange(0, 8, bits, dtype=dtype, device=device)  # code i of a byte at bit i*bits


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., N] (each < 2**bits) -> uint8 [..., N*bits//8]; code i of a byte sits at
    bit offset (i % (8//bits)) * bits, lowest first."""
    assert bits in BITS, bits
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_byte} ({bits}-bit codes)")
    if bits == 8:
        return codes.to(torch.uint8)
    c = (codes.to(torch.int32) & (2**bits - 1)).unflatten(-1, (-1, per_byte))
    return (c << _shifts(bits, codes.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, dtype=torch.uint8) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., M] -> codes [..., M*8//bits] (uint8, or `dtype`). The bytes
    are little-endian 32-bit words of codes (code j of a word at bit j*bits), which is how rows of
    whole words are read: through a float32 view, because inductor's CPU code loads float32 vectors
    several times faster than int32 or uint8 ones (same bits, then a free bitcast); and the codes
    stay int32 on their way to float (uint8 vector conversions are slow there too)."""
    assert bits in BITS, bits
    if packed.shape[-1] % 4 == 0 and packed.stride(-1) == 1:
        words = packed.view(torch.float32).view(torch.int32)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        return ((words[..., None] >> shifts) & (2**bits - 1)).flatten(-2).to(dtype)
    if bits == 8:
        return packed.to(dtype)
    return ((packed[..., None] >> _shifts(bits, packed.device, torch.uint8)) & (2**bits - 1)).flatten(-2).to(dtype)


# ---- the one quantizer core -----------------------------------------------------------------------
# Groups are formed by a view that puts each group on its own axis:
#   keys   ("tokens"):   [B, H, T//g, g, D], reduce over axis -2, meta [B, H, T//g, D]
#   values ("channels"): [B, H, T, D//g, g], reduce over axis -1, meta [B, H, T, D//g]
def _grouped(x, group, along):
    B, H, T, D = x.shape
    if along == "tokens":
        if T % group:
            raise ValueError(f"key quantization needs T ({T}) to be a multiple of the token group ({group})")
        return x.reshape(B, H, T // group, group, D), -2
    if D % group:
        raise ValueError(f"value quantization needs head_dim ({D}) to be a multiple of the channel group ({group})")
    return x.reshape(B, H, T, D // group, group), -1


def round_clamp(y, lo, hi):
    """Round to nearest (half up) and clip to the code range."""
    return torch.clamp(torch.floor(y + 0.5), lo, hi)


def _group_params(lo, hi, bits, one_bit, meta_dtype):
    """(scale, zero) of each group per eq. 2 / eq. 3 from its min and max, rounded to meta_dtype."""
    if one_bit not in ONE_BIT_MODES:
        raise ValueError(f"one_bit must be one of {ONE_BIT_MODES}, got {one_bit!r}")
    if bits == 1 and one_bit == "improved":  # eq. 3: codes land on the midpoints of the two half-ranges
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:  # eq. 2
        zero, scale = lo, (hi - lo) / (2**bits - 1)
    return scale.to(meta_dtype), zero.to(meta_dtype)


def finite_fp32(x, meta_dtype):
    """fp32 copy with NaN -> 0 and values clipped so that scale/zero stay finite in meta_dtype."""
    big = torch.finfo(meta_dtype).max / 4
    return torch.nan_to_num(x.float(), nan=0.0, posinf=big, neginf=-big).clamp(-big, big)


def _lsq_refit(xg, axis, lo, hi, codes, s, z, bits, meta_dtype, iters=LSQ_ITERS, weight=None):
    """Lloyd's iterations restricted to the uniform grid z + s * code: alternately the least-squares
    (z, s) for the codes (a line fit of x on the code) and the nearest code for (z, s). Neither step
    raises the squared error (up to the 16-bit rounding of the stored z, s); at 1 bit this is exactly
    2-means on each group. The min/max start wastes levels on the group's extremes (at 1 bit eq. 3 puts
    the levels at +-range/4, where most values are not); the refit may clip an outlier instead.
    The sums run on x in units of the group's range [lo, hi] from its min, so they cannot overflow.
    weight (0 or 1, broadcast against xg): the rows that count (a left-padded row's padding counts 0)."""
    width = torch.where(hi > lo, hi - lo, 1.0)
    xn = (xg - lo) / width
    codes0, s0, z0 = codes, s, z
    if weight is None:
        mean = lambda x: x.mean(axis, keepdim=True)  # noqa: E731
    else:
        n = weight.sum(axis, keepdim=True).clamp(min=1)
        mean = lambda x: (x * weight).sum(axis, keepdim=True) / n  # noqa: E731
    for _ in range(iters):
        c_mean, x_mean = mean(codes), mean(xn)
        var = mean((codes - c_mean) ** 2)
        cov = mean((codes - c_mean) * (xn - x_mean))
        s_fit = cov / torch.where(var > 0, var, 1.0) * width
        s = torch.where((var > 0) & (s_fit > 0), s_fit, s)  # all codes equal: keep s, move z to the mean
        s = s.to(meta_dtype).float()
        z = (lo + x_mean * width - s * c_mean).to(meta_dtype).float()
        codes = round_clamp((xg - z) / torch.where(s == 0, 1.0, s), 0, 2**bits - 1)
    ok = torch.isfinite(s) & torch.isfinite(z)  # 16-bit overflow near the clipped extremes: keep eq. 2/3
    return torch.where(ok, codes, codes0), torch.where(ok, s, s0), torch.where(ok, z, z0)


def quantize_codes(x, bits, group, along, one_bit="improved", meta_dtype=torch.float16, fit="range", keep_range=None,
                   real=None):
    """The core: x [B,H,T,D] -> (unpacked codes uint8 [B,H,T,D], scale, zero [meta shape]).
    keep_range: optional bool [T//group] or [B, T//group] (keys): token groups that keep eq. 2/3 under fit="lsq".
    real: optional bool [B,T] (keys): the rows that are not padding; the least-squares fit weighs only them
    (fill_padding has already made min/max theirs)."""
    assert 1 <= bits <= 8, bits  # any width: packed widths are BITS; others are split by their callers
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    xg, axis = _grouped(finite_fp32(x, meta_dtype), group, along)
    lo, hi = xg.amin(axis, keepdim=True), xg.amax(axis, keepdim=True)
    scale, zero = _group_params(lo, hi, bits, one_bit, meta_dtype)
    s, z = scale.float(), zero.float()
    codes = round_clamp((xg - z) / torch.where(s == 0, 1.0, s), 0, 2**bits - 1)  # codes vs STORED s, z
    if fit == "lsq":
        weight = None if real is None else real.float().view(x.shape[0], 1, x.shape[2] // group, group, 1)
        c_fit, s_fit, z_fit = _lsq_refit(xg, axis, lo, hi, codes, s, z, bits, meta_dtype, weight=weight)
        if keep_range is not None:
            keep = keep_range.view(-1, 1, keep_range.shape[-1], 1, 1)  # against [B, H, T//group, group, D]
            c_fit, s_fit, z_fit = torch.where(keep, codes, c_fit), torch.where(keep, s, s_fit), torch.where(keep, z, z_fit)
        codes, scale, zero = c_fit, s_fit.to(meta_dtype), z_fit.to(meta_dtype)
    return codes.to(torch.uint8).reshape(x.shape), scale.squeeze(axis), zero.squeeze(axis)


def expand_groups(meta, group, along):
    """Broadcast per-group meta back to [B,H,T,D] (a view-then-reshape inductor can fuse)."""
    if along == "tokens":
        B, H, NG, D = meta.shape
        return meta.float().unsqueeze(3).expand(B, H, NG, group, D).reshape(B, H, NG * group, D)
    B, H, T, NG = meta.shape
    return meta.float().unsqueeze(4).expand(B, H, T, NG, group).reshape(B, H, T, NG * group)


def dequantize_codes(codes, scale, zero, group, along, dtype=torch.float32):
    """x' = code * s + z for unpacked codes [B,H,T,D] (any numeric dtype)."""
    return (codes.float() * expand_groups(scale, group, along) + expand_groups(zero, group, along)).to(dtype)


def value_group(group, head_dim):
    return min(group, head_dim)


# ---- KIVI keys (per channel) and values (per token) ------------------------------------------------
def fill_padding(k, pad, group):
    """k [B,H,T,D] whose rows [0, pad[b]) are a left-padded row's padding ([B] int64) -> k with each padding row
    replaced by its key group's first real row, so a group that straddles the padding quantizes (per channel, by
    min/max) as if the padding were not there. A group of padding only keeps its rows (never attended)."""
    T = k.shape[2]
    i = torch.arange(T, device=k.device)
    group_last = i // group * group + group - 1
    src = torch.where(i < pad[:, None], torch.minimum(pad[:, None], group_last), i)  # [B, T]
    return k.gather(2, src[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3]))


def quantize_keys(k, bits, group, one_bit="improved", meta_dtype=torch.float16, fit="range", keep_range=None, pad=None):
    """k [B,H,T,D] -> codes uint8 [B,H,T,D*bits//8], scale/zero [B,H,T//group,D] (meta_dtype).
    keep_range [T//group] or [B, T//group] bool: groups that keep min/max under fit="lsq" (the cache: the sinks'
    group, each row's first).
    pad [B] int64: each row's leading padding rows of this block (a left-padded batch): they never widen a
    group's range or weigh in its fit (fill_padding); their own codes are garbage, never attended."""
    real = None
    if pad is not None:
        k = fill_padding(k, pad, group)
        real = torch.arange(k.shape[2], device=k.device) >= pad[:, None]
    codes, scale, zero = quantize_codes(k, bits, group, "tokens", one_bit, meta_dtype, fit, keep_range, real)
    return pack_bits(codes, bits), scale, zero


def dequantize_keys(codes, scale, zero, bits, group, dtype=torch.float32):
    return dequantize_codes(unpack_bits(codes, bits, torch.int32), scale, zero, group, "tokens", dtype)


def quantize_values(v, bits, group, one_bit="improved", meta_dtype=torch.float16, fit="range"):
    """v [B,H,T,D] -> codes uint8 [B,H,T,D*bits//8], scale/zero [B,H,T,D//group] (group clamped to D)."""
    group = value_group(group, v.shape[-1])
    codes, scale, zero = quantize_codes(v, bits, group, "channels", one_bit, meta_dtype, fit)
    return pack_bits(codes, bits), scale, zero


def dequantize_values(codes, scale, zero, bits, group, dtype=torch.float32):
    codes = unpack_bits(codes, bits, torch.int32)
    return dequantize_codes(codes, scale, zero, value_group(group, codes.shape[-1]), "channels", dtype)


# ---- memory accounting: what the codes cost, the one place a 16-bit deployment's bytes are counted -------
def quantized_bytes(kind, bits, group, head_dim, meta_dtype=torch.float16):
    """Bytes per token per kv head of the quantized copy: packed codes + amortized scale and zero.

    kind "key": meta is per (token group, channel); "value": per (token, channel group). Two 4-bit
    planes with one scale/zero count as bits=8. The fp16 residual window and fetched rows are extra:
    2 * head_dim bytes per row each for K and V."""
    meta = 2 * torch.empty((), dtype=meta_dtype).element_size()  # scale + zero
    if kind == "key":
        return head_dim * bits / 8 + meta * head_dim / group
    if kind == "value":
        return head_dim * bits / 8 + meta * head_dim / value_group(group, head_dim)
    raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")


def deployed_nbytes(*tensors) -> int:
    """Bytes of the tensors in a 16-bit deployment, whatever dtype this run computes in: a floating-point
    element is 2 bytes (fp32 on CPU stands in for fp16/bf16 on a GPU); codes, positions and counters as stored."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors)


@dataclass
class MemoryMeter:
    """Device-side KV bytes over time, by the caches' own accounting (CPU has no allocator stats).
    Prefill registers each layer's transient fp KV, so `peak` shows Algorithm 1's layer-by-layer bound."""
    current: int = 0
    peak: int = 0

    def alloc(self, n: int):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int):
        self.current -= n

    @contextmanager
    def holding(self, *tensors):
        """The tensors' bytes count while the block runs (a layer's transient fp K/V during prefill)."""
        n = sum(t.nbytes for t in tensors)
        self.alloc(n)
        try:
            yield
        finally:
            self.free(n)


def kv_fp16_bytes(args, batch: int, seq_len: int) -> int:
    """What a 16-bit cache of every layer would hold: the reference the low-bit caches are compared with."""
    return 2 * args.n_layers * batch * args.n_kv_heads * seq_len * args.head_dim * 2


# ---- what a cache stores, as the kernels read it ---------------------------------------------------
class LowBitKV(NamedTuple):
    """The quantized tokens of a KIVI cache (cache.LowBitCache.stored()). Slots [0, n_quant) hold
    tokens; the rest is garbage the kernels never read into a result. The torch references are its
    methods, so any tuple with the same methods runs the same reference attention
    (kernels.attention_lowbit_ref)."""
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
    # [B] int64: each row's first real slot (a left-padded batch); slots before it are padding, never attended
    row_start: Optional[Tensor] = None

    def starts(self) -> Tensor:
        """row_start, or zeros (a batch without padding)."""
        return self.row_start if self.row_start is not None else \
            torch.zeros(self.k_codes.shape[0], dtype=torch.int64, device=self.k_codes.device)

    def real_slots(self) -> Tensor:
        """[B,1,S] bool: the slots at or after each row's start (what a row may attend)."""
        S = self.k_codes.shape[2]
        return torch.arange(S, device=self.k_codes.device) >= self.starts()[:, None, None]

    def codes(self, kv: str) -> Tensor:
        """Integer codes of the keys (kv="k") or values as fp32 [B,Hkv,S,D]."""
        return unpack_bits(self.k_codes if kv == "k" else self.v_codes, self.bits, torch.int32).float()

    def key_logits(self, qg) -> Tensor:
        """qg [B,Hkv,M,D] (fp32, pre-scaled) -> q.k' [B,Hkv,M,S] over every slot (garbage past n_quant)."""
        return code_logits(qg, self.codes("k"), self.k_scale.float(), self.k_zero, self.group_k)

    def value_sum(self, p, keep) -> Tensor:
        """sum_n p[.., n] v'_n for p [B,Hkv,M,S] (zero where not keep [B,Hkv,S]) -> [B,Hkv,M,D]."""
        return code_value_sum(p, self.codes("v"), self.v_scale.float(), self.v_zero, self.group_v, keep)

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Keys and values in fp32 [B,Hkv,S,D]."""
        return (dequantize_keys(self.k_codes, self.k_scale, self.k_zero, self.bits, self.group_k),
                dequantize_values(self.v_codes, self.v_scale, self.v_zero, self.bits, self.group_v))

    def first_tokens(self, n: int) -> "LowBitKV":
        """The tuple cut to quantized tokens [0, n) (n a multiple of the key group)."""
        g = n // self.group_k
        return self._replace(k_codes=self.k_codes[:, :, :n], k_scale=self.k_scale[:, :, :g], k_zero=self.k_zero[:, :, :g],
                             v_codes=self.v_codes[:, :, :n], v_scale=self.v_scale[:, :, :n], v_zero=self.v_zero[:, :, :n])

    def read_bytes(self, n_quant: int) -> int:
        """Bytes of the codes and scales of tokens [0, n_quant) (what the attention reads of them)."""
        per_row = sum(t[:, :, :n_quant].nbytes for t in (self.k_codes, self.v_codes, self.v_scale, self.v_zero))
        return per_row + sum(t[:, :, :n_quant // self.group_k].nbytes for t in (self.k_scale, self.k_zero))


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


def code_logits(qg, c, k_scale, k_zero, g: int) -> Tensor:
    """qg [B,Hkv,M,D] . keys whose integer codes c [B,Hkv,S,D] (fp32) dequantize as c * scale + zero per
    channel and group of g tokens (scale [B,Hkv,S/g,D] fp32, in the codes' units) -> [B,Hkv,M,S]. The
    scale and zero fold into the query, as in the Triton kernel: q.k' = (q*s_g).c + q.z_g, so only the
    integer codes are expanded to [S, D]."""
    B, Hkv, M, D = qg.shape
    S = c.shape[2]
    qs = qg[:, :, None] * k_scale[:, :, :, None, :]  # [B,Hkv,S/g,M,D]
    logits = qs @ c.view(B, Hkv, S // g, g, D).transpose(-1, -2) + \
        (qg @ k_zero.float().transpose(-1, -2)).transpose(-1, -2)[..., None]
    return logits.permute(0, 1, 3, 2, 4).reshape(B, Hkv, M, S)


def code_value_sum(p, c, v_scale, v_zero, group_v: int, keep) -> Tensor:
    """sum_n p[.., n] v'_n for p [B,Hkv,M,S] over values whose integer codes c [B,Hkv,S,D] dequantize as
    c * scale + zero per token and group of channels (v_scale [B,Hkv,S,D/group_v] fp32, in the codes'
    units); rows where not keep [B,Hkv,S] count zero. The scale and zero fold into the probabilities, as
    in the Triton kernel: sum_n p_n (c_n s_n + z_n) = (p*s).c + sum_n p_n z_n."""
    D = c.shape[-1]
    gv = min(group_v, D)
    zero = torch.zeros((), device=p.device)
    scale = torch.where(keep[..., None], v_scale, zero)  # garbage rows (NaN/inf) -> 0
    zeros = torch.where(keep[..., None], v_zero.float(), zero)
    return torch.cat([(p * scale[:, :, None, :, j]) @ c[..., j * gv:(j + 1) * gv] + p @ zeros[..., j:j + 1]
                      for j in range(D // gv)], -1)
