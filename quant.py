"""Low-bit KV quantization for the device copy of the cache (SpeCache §3.4).

All tensors are [B, H, T, D] (batch, kv heads, tokens, head_dim). Every variant below is built on
one asymmetric round-to-nearest quantizer, `_group_params` + `_round_clamp` + `_dequantize`:

  x' = code * s + z                                                    (SpeCache eq. 2, KIVI)
  z = min, s = (max - min) / (2^B - 1)                                 (eq. 2, any bits)
  z = (3 min + max) / 4, s = (max - min) / 2                           (eq. 3, improved 1-bit)

Layouts (KIVI): keys are quantized per channel over groups of `group` consecutive tokens, values
per token over groups of `group` consecutive channels. Codes are bit-packed along D; scale/zero
are stored in `meta_dtype` (fp16 by default) and the codes are computed against the *stored*
scale/zero, so every error bound holds for what the cache actually keeps.

`fit="lsq"` refines eq. 2/3's zero and scale (same bytes) by Lloyd's iterations on the uniform
grid (`_lsq_refit`): lower squared error, hence better low-bit ranking for SpeCache's top-k.

Variants on the same core:
  ZipCache channel-separable values (zipcache.txt §4.1, eq. 6): v / c per channel, then tokenwise.
  ZipCache mixed precision (§4.2-4.3): one quantizer at the salient bit-width; every token keeps the
    upper `bits` of its code, salient tokens also the lower bits.
  QuantSpec hierarchical INT8 = upper INT4 + lower INT4 (quantspec.txt §4.2).
"""
import math

import torch

BITS = (1, 2, 4, 8)
ONE_BIT_MODES = ("improved", "kivi")
FITS = ("range", "lsq")  # zero/scale: from min and max (eq. 2/3), or least-squares refit of that
LSQ_ITERS = 3  # measured on the default model's keys: 1 iteration gets most of it, 3 nearly all


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


def _round_clamp(y, lo, hi):
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


def _safe(x, meta_dtype):
    """fp32 copy with NaN -> 0 and values clipped so that scale/zero stay finite in meta_dtype."""
    big = torch.finfo(meta_dtype).max / 4
    return torch.nan_to_num(x.float(), nan=0.0, posinf=big, neginf=-big).clamp(-big, big)


def _lsq_refit(xg, axis, lo, hi, codes, s, z, bits, meta_dtype, iters=LSQ_ITERS):
    """Lloyd's iterations restricted to the uniform grid z + s * code: alternately the least-squares
    (z, s) for the codes (a line fit of x on the code) and the nearest code for (z, s). Neither step
    raises the squared error (up to the 16-bit rounding of the stored z, s); at 1 bit this is exactly
    2-means on each group. The min/max start wastes levels on the group's extremes (at 1 bit eq. 3 puts
    the levels at +-range/4, where most values are not); the refit may clip an outlier instead.
    The sums run on x in units of the group's range [lo, hi] from its min, so they cannot overflow."""
    width = torch.where(hi > lo, hi - lo, 1.0)
    xn = (xg - lo) / width
    codes0, s0, z0 = codes, s, z
    for _ in range(iters):
        c_mean, x_mean = codes.mean(axis, keepdim=True), xn.mean(axis, keepdim=True)
        var = ((codes - c_mean) ** 2).mean(axis, keepdim=True)
        cov = ((codes - c_mean) * (xn - x_mean)).mean(axis, keepdim=True)
        s_fit = cov / torch.where(var > 0, var, 1.0) * width
        s = torch.where((var > 0) & (s_fit > 0), s_fit, s)  # all codes equal: keep s, move z to the mean
        s = s.to(meta_dtype).float()
        z = (lo + x_mean * width - s * c_mean).to(meta_dtype).float()
        codes = _round_clamp((xg - z) / torch.where(s == 0, 1.0, s), 0, 2**bits - 1)
    ok = torch.isfinite(s) & torch.isfinite(z)  # 16-bit overflow near the clipped extremes: keep eq. 2/3
    return torch.where(ok, codes, codes0), torch.where(ok, s, s0), torch.where(ok, z, z0)


def _quantize(x, bits, group, along, one_bit="improved", meta_dtype=torch.float16, fit="range", keep_range=None):
    """The core: x [B,H,T,D] -> (unpacked codes uint8 [B,H,T,D], scale, zero [meta shape]).
    keep_range: optional bool [T//group] (keys): token groups that keep eq. 2/3 under fit="lsq"."""
    assert 1 <= bits <= 8, bits  # any width: packed widths are BITS, mixed precision splits its codes
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
    xg, axis = _grouped(_safe(x, meta_dtype), group, along)
    lo, hi = xg.amin(axis, keepdim=True), xg.amax(axis, keepdim=True)
    scale, zero = _group_params(lo, hi, bits, one_bit, meta_dtype)
    s, z = scale.float(), zero.float()
    codes = _round_clamp((xg - z) / torch.where(s == 0, 1.0, s), 0, 2**bits - 1)  # codes vs STORED s, z
    if fit == "lsq":
        c_fit, s_fit, z_fit = _lsq_refit(xg, axis, lo, hi, codes, s, z, bits, meta_dtype)
        if keep_range is not None:
            keep = keep_range.view(-1, 1, 1)  # [T//group, 1, 1] against [B, H, T//group, group, D]
            c_fit, s_fit, z_fit = torch.where(keep, codes, c_fit), torch.where(keep, s, s_fit), torch.where(keep, z, z_fit)
        codes, scale, zero = c_fit, s_fit.to(meta_dtype), z_fit.to(meta_dtype)
    return codes.to(torch.uint8).reshape(x.shape), scale.squeeze(axis), zero.squeeze(axis)


def _expand(meta, group, along):
    """Broadcast per-group meta back to [B,H,T,D] (a view-then-reshape inductor can fuse)."""
    if along == "tokens":
        B, H, NG, D = meta.shape
        return meta.float().unsqueeze(3).expand(B, H, NG, group, D).reshape(B, H, NG * group, D)
    B, H, T, NG = meta.shape
    return meta.float().unsqueeze(4).expand(B, H, T, NG, group).reshape(B, H, T, NG * group)


def _dequantize(codes, scale, zero, group, along, dtype=torch.float32):
    """x' = code * s + z for unpacked codes [B,H,T,D] (any numeric dtype)."""
    return (codes.float() * _expand(scale, group, along) + _expand(zero, group, along)).to(dtype)


dequantize_codes = _dequantize  # integer codes of any of the variants below, with their scale and zero


def _value_group(group, head_dim):
    return min(group, head_dim)


# ---- KIVI keys (per channel) and values (per token) ------------------------------------------------
def quantize_keys(k, bits, group, one_bit="improved", meta_dtype=torch.float16, fit="range", keep_range=None):
    """k [B,H,T,D] -> codes uint8 [B,H,T,D*bits//8], scale/zero [B,H,T//group,D] (meta_dtype).
    keep_range [T//group] bool: groups that keep min/max under fit="lsq" (the cache: the sinks' group)."""
    codes, scale, zero = _quantize(k, bits, group, "tokens", one_bit, meta_dtype, fit, keep_range)
    return pack_bits(codes, bits), scale, zero


def dequantize_keys(codes, scale, zero, bits, group, dtype=torch.float32):
    return _dequantize(unpack_bits(codes, bits, torch.int32), scale, zero, group, "tokens", dtype)


def quantize_values(v, bits, group, one_bit="improved", meta_dtype=torch.float16, fit="range"):
    """v [B,H,T,D] -> codes uint8 [B,H,T,D*bits//8], scale/zero [B,H,T,D//group] (group clamped to D)."""
    group = _value_group(group, v.shape[-1])
    codes, scale, zero = _quantize(v, bits, group, "channels", one_bit, meta_dtype, fit)
    return pack_bits(codes, bits), scale, zero


def dequantize_values(codes, scale, zero, bits, group, dtype=torch.float32):
    codes = unpack_bits(codes, bits, torch.int32)
    return _dequantize(codes, scale, zero, _value_group(group, codes.shape[-1]), "channels", dtype)


# ---- ZipCache channel-separable tokenwise values (zipcache.txt eq. 6) -----------------------------
def channel_scale(v, meta_dtype=torch.float16):
    """c [B,H,D] = sqrt(max_t |v|) (eq. 6); all-zero channels get c = 1."""
    c = _safe(v, meta_dtype).abs().amax(dim=2).sqrt()
    return torch.where(c > 0, c, 1.0).to(meta_dtype)


def channel_separated(v, chan_scale, meta_dtype=torch.float16):
    """v / c (eq. 6): what ZipCache quantizes tokenwise, in fp32."""
    return _safe(v, meta_dtype) / chan_scale.float()[..., None, :]


def quantize_values_zip(v, bits, group, chan_scale, one_bit="improved", meta_dtype=torch.float16, fit="range"):
    """Tokenwise quantization of v / c; dequantize with dequantize_values_zip (x' = dequant * c)."""
    return quantize_values(channel_separated(v, chan_scale, meta_dtype), bits, group, one_bit, meta_dtype, fit)


def dequantize_values_zip(codes, scale, zero, bits, group, chan_scale, dtype=torch.float32):
    v = dequantize_values(codes, scale, zero, bits, group) * chan_scale.float()[..., None, :]
    return v.to(dtype)


# ---- ZipCache mixed precision (zipcache.txt §4.2-4.3) -------------------------------------------
# A block is quantized once at the salient bit-width b_hi (eq. 2). Its code c = 2^r U + L (r = b_hi - bits)
# splits into the upper `bits` U, kept for every token, and the lower r bits L, kept only for the
# salient tokens. A salient token reads c; any other reads U with L at the middle of its range,
# (2^r - 1) / 2: the midpoints of 2^bits equal bins over the same range, a `bits`-bit quantizer whose
# error, at most 2^(r-1) s_hi = 2^(r-1) range / (2^b_hi - 1), is below eq. 2's range / (2 (2^bits - 1)).
# As integers: C = 2^(r+1) U + (2L or 2^r - 1), value = C * s_hi / 2 + z (both exact in 16-bit floats).
def quantize_mixed(x, bits, bits_hi, group, along, meta_dtype=torch.float16):
    """x [B,H,T,D] -> (upper codes packed at `bits` [B,H,T,D*bits/8], lower codes uint8 [B,H,T,D]
    (unpacked: the caller keeps the salient rows), scale (s_hi), zero). Keys: along="tokens"."""
    if along == "channels":
        group = _value_group(group, x.shape[-1])
    c, scale, zero = _quantize(x, bits_hi, group, along, meta_dtype=meta_dtype)
    r = bits_hi - bits
    return pack_bits(c >> r, bits), c & (2**r - 1), scale, zero


def mixed_codes(upper, lower, has, r: int):
    """Integer codes C (int32 [B,H,T,D]) from upper codes U and lower codes L (unpacked) where `has`
    [B,H,T] marks the rows that kept L; value = C * s_hi / 2 + z."""
    return (upper.to(torch.int32) << (r + 1)) + torch.where(has[..., None], 2 * lower.to(torch.int32), 2**r - 1)


def dequantize_mixed(upper_packed, lower, has, scale, zero, bits, bits_hi, group, along, dtype=torch.float32):
    """Inverse of quantize_mixed with the lower codes of the rows `has` marks (others: the midpoint)."""
    upper = unpack_bits(upper_packed, bits, torch.int32)
    if along == "channels":
        group = _value_group(group, upper.shape[-1])
    return _dequantize(mixed_codes(upper, lower, has, bits_hi - bits), scale.float() / 2, zero, group, along, dtype)


def compact_refinement(lower_k, lower_v, saliency, group: int, n_ref: int, r: int):
    """Keep the lower codes (unpacked [B,H,T,D]) of the n_ref most salient tokens (`saliency`
    [B,H,T]) of each key group of `group` tokens, in position order -> (k_ref, v_ref packed at r bits
    [B,H,T/group*n_ref,D*r/8], ref_map uint8 [B,H,T]: a token's row among its group's, 255 = none)."""
    B, H, T, D = lower_k.shape
    top = saliency.float().reshape(B, H, T // group, group).topk(n_ref, dim=-1).indices.sort(-1).values
    rows = (top + group * torch.arange(T // group, device=top.device)[:, None]).reshape(B, H, -1)
    pick = lambda low: pack_bits(low.gather(2, rows[..., None].expand(-1, -1, -1, D)), r)  # noqa: E731
    slot = torch.arange(n_ref, device=top.device, dtype=torch.uint8).repeat(T // group).expand(B, H, -1)
    ref_map = torch.full((B, H, T), 255, dtype=torch.uint8, device=top.device).scatter(2, rows, slot)
    return pick(lower_k), pick(lower_v), ref_map


# ---- ZipCache's saliency: which tokens keep more bits (zipcache.txt §4.2-4.3, eq. 8-9) -------------
PROBE_RECENT, PROBE_RANDOM = 0.05, 0.05  # §4.3: probes are 5% recent + 5% random tokens of the prompt


def probe_positions(L: int, seed: int = 0) -> torch.Tensor:
    """Eq. 9's probe tokens of an L-token chunk: the last 5% and a random 5% of the rest (sorted)."""
    n_recent = max(1, round(PROBE_RECENT * L))
    n_rand = min(L - n_recent, round(PROBE_RANDOM * L))
    rand = torch.randperm(L - n_recent, generator=torch.Generator().manual_seed(seed))[:n_rand]
    return torch.cat([rand.sort().values, torch.arange(L - n_recent, L)])


def normalized_attention(q, keys, q_pos, sm_scale):
    """Eq. 8's sums: q [B,H,P,D] at positions q_pos [P], keys [B,Hkv,L,D] at positions 0..L-1 ->
    (acc, cnt) [B,Hkv,L]: the causal attention each key receives, summed over the P queries and the
    kv head's H/Hkv query heads, and how many such (query, head) rows can see it. acc / cnt is the
    normalized attention score; acc alone is H2O's accumulated score (eq. 7)."""
    B, H, P, D = q.shape
    Hkv, L = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q.float().reshape(B, Hkv, G * P, D)
    pos = q_pos.to(q.device).repeat(G)  # row g*P + j
    sees = torch.arange(L, device=q.device)[None, :] <= pos[:, None]  # [G*P, L]
    a = torch.softmax(torch.where(sees, qg @ keys.float().transpose(-1, -2) * sm_scale, -math.inf), -1)
    return a.sum(2), sees.sum(0).float().expand(B, Hkv, L).contiguous()


def residual_attention(q, lse, k_res, res_len, sm_scale):
    """Eq. 8's sums while decoding: the attention q [B,H,1,D] (its logsumexp lse [B,H,1]) pays each
    residual row k_res [B,Hkv,R,D] it sees (rows <= res_len, its own included), summed over the kv
    head's query heads -> (acc [B,Hkv,R], cnt [R]) to add to the rows' sums."""
    B, H, _, D = q.shape
    Hkv = k_res.shape[1]
    logits = (q.float().reshape(B, Hkv, H // Hkv, D) @ k_res.float().transpose(-1, -2)) * sm_scale
    p = torch.exp(logits - lse.float().reshape(B, Hkv, H // Hkv, 1))
    sees = torch.arange(k_res.shape[2], device=q.device) <= res_len
    return torch.where(sees, p.sum(2), 0.0), sees.float() * (H // Hkv)


# ---- QuantSpec hierarchical INT8 = upper INT4 + lower INT4 (quantspec.txt §4.2) ------------------
# Upper U in [0,15]: 4-bit asymmetric RTN, x ~ U*s4 + z. Lower L in [-8,7]: symmetric RTN of the
# error x - (U*s4 + z) with s8 = s4/16, stored as L + 8. INT8 view: (16U + L)*s8 + z.
def _quantize_hier(x, group, along, meta_dtype):
    upper, scale, zero = _quantize(x, 4, group, along, meta_dtype=meta_dtype)
    err = _safe(x, meta_dtype) - _dequantize(upper, scale, zero, group, along)
    s8 = _expand(scale, group, along) / 16
    lower = _round_clamp(err / torch.where(s8 == 0, 1.0, s8), -8, 7) + 8
    return pack_bits(upper, 4), pack_bits(lower.to(torch.uint8), 4), scale, zero


def _dequantize_hier(codes_hi, codes_lo, scale, zero, group, along, view_bits, dtype):
    upper = unpack_bits(codes_hi, 4, torch.int32)
    if view_bits == 4:
        return _dequantize(upper, scale, zero, group, along, dtype)
    assert view_bits == 8, view_bits
    int8 = 16 * upper.float() + unpack_bits(codes_lo, 4, torch.int32).float() - 8
    return _dequantize(int8, scale.float() / 16, zero, group, along, dtype)


def quantize_hier_keys(k, group, meta_dtype=torch.float16):
    """-> (codes_hi, codes_lo) uint8 [B,H,T,D//2] each, scale (= s4) / zero [B,H,T//group,D]."""
    return _quantize_hier(k, group, "tokens", meta_dtype)


def quantize_hier_values(v, group, meta_dtype=torch.float16):
    return _quantize_hier(v, _value_group(group, v.shape[-1]), "channels", meta_dtype)


def dequantize_hier_keys(codes_hi, codes_lo, scale, zero, group, view_bits=8, dtype=torch.float32):
    return _dequantize_hier(codes_hi, codes_lo, scale, zero, group, "tokens", view_bits, dtype)


def dequantize_hier_values(codes_hi, codes_lo, scale, zero, group, view_bits=8, dtype=torch.float32):
    group = _value_group(group, codes_hi.shape[-1] * 2)
    return _dequantize_hier(codes_hi, codes_lo, scale, zero, group, "channels", view_bits, dtype)


# ---- QuantSpec's draft weights: group-wise INT4, weight-only (quantspec.txt §4.1) -------------------
def quantize_weight_int4(w: torch.Tensor, group: int):
    """w [N, K] -> (codes uint8 [N, K] in [0, 15], scale, zero [N, K // group] fp32) with
    w ~ code * scale + zero per group of `group` input features (eq. 2 at 4 bits, asymmetric RTN)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"in_features {K} is not a multiple of the weight group {group}")
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    codes = _round_clamp((wg - lo) / torch.where(scale == 0, 1.0, scale), 0, 15)
    return codes.to(torch.uint8).reshape(N, K), scale.squeeze(-1), lo.squeeze(-1)


def dequantize_weight_int4(codes, scale, zero, group, dtype=torch.float32):
    N, K = codes.shape
    w = codes.float().reshape(N, K // group, group) * scale[..., None] + zero[..., None]
    return w.reshape(N, K).to(dtype)


# ---- memory accounting ----------------------------------------------------------------------------
def quantized_bytes(kind, bits, group, head_dim, meta_dtype=torch.float16):
    """Bytes per token per kv head of the quantized copy: packed codes + amortized scale and zero.

    kind "key": meta is per (token group, channel); "value": per (token, channel group). For the
    hierarchical cache pass bits=8 (two 4-bit planes, one 4-bit scale/zero). ZipCache adds a
    fixed head_dim * meta bytes per head (the channel scale), not per token. The fp16 residual
    window and fetched rows are extra: 2 * head_dim bytes per row each for K and V."""
    meta = 2 * torch.empty((), dtype=meta_dtype).element_size()  # scale + zero
    if kind == "key":
        return head_dim * bits / 8 + meta * head_dim / group
    if kind == "value":
        return head_dim * bits / 8 + meta * head_dim / _value_group(group, head_dim)
    raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
