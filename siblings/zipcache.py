"""ZipCache (zipcache.txt §4) as a quantizer of the low-bit cache: `--quant zipcache`, cache names
kivi-...-zipcache and specache-...-zipcache (SpeCache's fetch over these codes).

    python generate.py --cache kivi --quant zipcache --bits 2 --salient-ratio 0.4 --bits-salient 4 ...

Keys are quantized as KIVI's; values channel-separably tokenwise (eq. 6): divided by a per-channel
scale c, then quantized per token, and read back as dequant * c. With `salient` > 0, mixed precision
(§4.2-4.3, quantize_mixed): each key group's n_ref most salient tokens keep bits_salient bits,
the rest `bits`. Saliency is the normalized attention of eq. 8: at prefill from probe queries (eq. 9:
5% recent + 5% random of the chunk), while decoding from every real token's attention to the residual
rows, accumulated until they are quantized. The kernels read these codes through attn_views.ViewKV's
v_chan, k_ref, v_ref and ref_map (attn_views.attention_views, attn_views.load_codes).
"""
import math
from typing import Optional

import torch

import quant
from cache import LowBitCache
from config import CacheConfig
from quant import Fetched
from siblings.attn_views import ViewKV, attention_views


# ---- ZipCache channel-separable tokenwise values (zipcache.txt eq. 6) -----------------------------
def channel_scale(v, meta_dtype=torch.float16):
    """c [B,H,D] = sqrt(max_t |v|) (eq. 6); all-zero channels get c = 1."""
    c = quant.finite_fp32(v, meta_dtype).abs().amax(dim=2).sqrt()
    return torch.where(c > 0, c, 1.0).to(meta_dtype)


def channel_separated(v, chan_scale, meta_dtype=torch.float16):
    """v / c (eq. 6): what ZipCache quantizes tokenwise, in fp32."""
    return quant.finite_fp32(v, meta_dtype) / chan_scale.float()[..., None, :]


def quantize_values_zip(v, bits, group, chan_scale, one_bit="improved", meta_dtype=torch.float16, fit="range"):
    """Tokenwise quantization of v / c; dequantize with dequantize_values_zip (x' = dequant * c)."""
    return quant.quantize_values(channel_separated(v, chan_scale, meta_dtype), bits, group, one_bit, meta_dtype, fit)


def dequantize_values_zip(codes, scale, zero, bits, group, chan_scale, dtype=torch.float32):
    v = quant.dequantize_values(codes, scale, zero, bits, group) * chan_scale.float()[..., None, :]
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
        group = quant.value_group(group, x.shape[-1])
    c, scale, zero = quant.quantize_codes(x, bits_hi, group, along, meta_dtype=meta_dtype)
    r = bits_hi - bits
    return quant.pack_bits(c >> r, bits), c & (2**r - 1), scale, zero


def mixed_codes(upper, lower, has, r: int):
    """Integer codes C (int32 [B,H,T,D]) from upper codes U and lower codes L (unpacked) where `has`
    [B,H,T] marks the rows that kept L; value = C * s_hi / 2 + z."""
    return (upper.to(torch.int32) << (r + 1)) + torch.where(has[..., None], 2 * lower.to(torch.int32), 2**r - 1)


def dequantize_mixed(upper_packed, lower, has, scale, zero, bits, bits_hi, group, along, dtype=torch.float32):
    """Inverse of quantize_mixed with the lower codes of the rows `has` marks (others: the midpoint)."""
    upper = quant.unpack_bits(upper_packed, bits, torch.int32)
    if along == "channels":
        group = quant.value_group(group, upper.shape[-1])
    return quant.dequantize_codes(mixed_codes(upper, lower, has, bits_hi - bits), scale.float() / 2, zero, group, along, dtype)


def compact_refinement(lower_k, lower_v, saliency, group: int, n_ref: int, r: int):
    """Keep the lower codes (unpacked [B,H,T,D]) of the n_ref most salient tokens (`saliency`
    [B,H,T]) of each key group of `group` tokens, in position order -> (k_ref, v_ref packed at r bits
    [B,H,T/group*n_ref,D*r/8], ref_map uint8 [B,H,T]: a token's row among its group's, 255 = none)."""
    B, H, T, D = lower_k.shape
    top = saliency.float().reshape(B, H, T // group, group).topk(n_ref, dim=-1).indices.sort(-1).values
    rows = (top + group * torch.arange(T // group, device=top.device)[:, None]).reshape(B, H, -1)
    pick = lambda low: quant.pack_bits(low.gather(2, rows[..., None].expand(-1, -1, -1, D)), r)  # noqa: E731
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


class ZipCache(LowBitCache):
    """LowBitCache with ZipCache's quantizer. Its buffers besides KIVI's:
      v_chan_scale [B,Hkv,D]                      eq. 6's c, set by the first quantized block, then fixed
    and with mixed precision (r = bits_salient - bits):
      k_ref/v_ref [B,Hkv,(S+R)/group*n_ref,D*r/8]  lower r bits of the salient rows
      ref_map [B,Hkv,S+R] u8                      a slot's row among its group's (255: none)
      sal_acc/sal_cnt [B,Hkv,R+max_step_tokens]   eq. 8's sums for the residual rows: attention
                                                  received, and from how many query rows
    """
    scheme = "zipcache"
    one_attn_path = "words"  # (attn_views has one kernel: the word path's)

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig,
                 max_step_tokens=2, meter=None, row_start=None):
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, max_step_tokens, meter,
                         row_start)
        B, H, D, n_slots = batch, n_kv_heads, head_dim, self.k_codes.shape[2]
        self.zeros_buffer("v_chan_scale", (B, H, D), dtype=self.k_scale.dtype)
        self.mixed = config.salient > 0
        if self.mixed:
            self.bits_hi, self.ref_bits, self.n_ref = config.bits_salient, config.bits_salient - config.bits, config.n_ref
            n_ref_rows = n_slots // self.group * self.n_ref
            self.zeros_buffer("k_ref", (B, H, n_ref_rows, D * self.ref_bits // 8), dtype=torch.uint8)
            self.zeros_buffer("v_ref", (B, H, n_ref_rows, D * self.ref_bits // 8), dtype=torch.uint8)
            self.zeros_buffer("ref_map", (B, H, n_slots), dtype=torch.uint8, fill=255)
            self.zeros_buffer("sal_acc", (B, H, self.residual + max_step_tokens), dtype=torch.float32)
            self.zeros_buffer("sal_cnt", (B, H, self.residual + max_step_tokens), dtype=torch.float32)

    def stored(self) -> ViewKV:
        mixed = dict(k_ref=self.k_ref, v_ref=self.v_ref, ref_map=self.ref_map, ref_bits=self.ref_bits,
                     n_ref=self.n_ref) if self.mixed else {}
        return ViewKV(super().stored(), v_chan=self.v_chan_scale, **mixed)

    # ---- the quantizer ---------------------------------------------------------------------------
    def channel_scale(self, v):
        """Eq. 6's c: the first quantized block sets it (n_quant == 0), later blocks keep it."""
        self.v_chan_scale.copy_(torch.where(self.n_quant == 0, channel_scale(v, self.k_scale.dtype),
                                            self.v_chan_scale))
        return self.v_chan_scale

    def quantize_values(self, v):
        return quantize_values_zip(v, self.bits, self.group_v, self.channel_scale(v), self.one_bit,
                                         self.k_scale.dtype, self.fit)

    def quantize(self, k, v, row0, first_group, saliency=None):
        """Mixed precision: quantize at bits_hi; keep every token's upper `bits` and the lower bits of each
        key group's n_ref most salient tokens (static shapes: a fixed count per group), whose compact
        refinement rows are written here. `saliency` [B,H,n]; None: eq. 8 from the decode sums."""
        if not self.mixed:
            return super().quantize(k, v, row0, first_group)
        n, G, meta = k.shape[2], self.group, self.k_scale.dtype
        if saliency is None:  # a decode flush of the residual: eq. 8 from the accumulated sums
            saliency = self.sal_acc[:, :, :n] / self.sal_cnt[:, :, :n].clamp(min=1)
        kc, kl, ks, kz = quantize_mixed(k, self.bits, self.bits_hi, G, "tokens", meta)
        v_sep = channel_separated(v, self.channel_scale(v), meta)  # eq. 6
        vc, vl, vs, vz = quantize_mixed(v_sep, self.bits, self.bits_hi, self.group_v, "channels", meta)
        k_ref, v_ref, ref_map = compact_refinement(kl, vl, saliency, G, self.n_ref, self.ref_bits)
        ref_rows = row0 // G * self.n_ref + torch.arange(k_ref.shape[2], device=k.device)
        self.k_ref.index_copy_(2, ref_rows, k_ref)
        self.v_ref.index_copy_(2, ref_rows, v_ref)
        return dict(k_codes=kc, v_codes=vc, v_scale=vs, v_zero=vz, ref_map=ref_map), dict(k_scale=ks, k_zero=kz)

    # ---- saliency (zipcache.txt eq. 8-9) ----------------------------------------------------------
    def prefill_args(self, q, k, input_pos, n_q: int) -> dict:
        """Mixed precision picks salient tokens with the chunk's queries `q` (eq. 9): the saliency of
        the n_q tokens quantized now; the residual rows' sums carry over."""
        if not self.mixed:
            return {}
        if q is None:
            raise ValueError("ZipCache mixed precision picks salient tokens with the prefill's queries: pass q")
        nr = int(self.res_len)
        n = nr + k.shape[2]
        acc, cnt = self.probe_saliency(q, k, input_pos)
        acc = torch.cat([self.sal_acc[:, :, :nr], acc], 2)
        cnt = torch.cat([self.sal_cnt[:, :, :nr], cnt], 2)
        self.sal_acc[:, :, :n - n_q], self.sal_cnt[:, :, :n - n_q] = acc[:, :, n_q:], cnt[:, :, n_q:]
        return dict(saliency=(acc / cnt.clamp(min=1))[:, :, :n_q])

    def probe_saliency(self, q, k, input_pos, probes=None):
        """Eq. 9 then eq. 8 for a prefill chunk: the attention of probe queries (`probe_positions`,
        or the chunk positions `probes`) over every position so far -> (acc, cnt) [B,Hkv,res_len + L]
        for the residual rows and the chunk's tokens (normalized_attention)."""
        L, p0, nr = q.shape[2], int(input_pos[0]), int(self.res_len)
        probes = (probe_positions(L, seed=p0) if probes is None else probes).to(q.device)
        keys = torch.cat([self.earlier_kv(p0)[0], k], 2)  # positions [0, p0 + L)
        acc, cnt = normalized_attention(q[:, :, probes], keys, p0 + probes, self.sm_scale)
        return acc[:, :, p0 - nr:], cnt[:, :, p0 - nr:]

    def accumulate_saliency(self, q, lse):
        """Eq. 8 while decoding: the real token's (q [B,H,1,D], its lse [B,H,1]) attention to the
        residual rows it sees (its own included) joins their sums."""
        acc, cnt = residual_attention(q, lse, self.k_res, self.res_len, self.sm_scale)
        self.sal_acc.add_(acc)
        self.sal_cnt.add_(cnt)

    def write_step(self, k, v):
        super().write_step(k, v)
        if self.mixed:  # rows (re)written: their saliency sums start again
            rows = self.res_len + torch.arange(k.shape[2], device=k.device)
            for buf in (self.sal_acc, self.sal_cnt):
                buf.index_fill_(2, rows, 0.0)

    def attend(self, q, fetched: Optional[Fetched] = None, select: int = 0):
        """LowBitCache.attend through this store's views (attn_views' kernel)."""
        out = attention_views(q, self.stored(), self.residual_rows(q.shape[2]), fetched, self.sm_scale,
                              use_op=self.custom_ops, select=select)
        if self.mixed:  # the real token is a saliency probe (a policy attending twice counts it twice: same ratio)
            self.accumulate_saliency(q[:, :, :1], out[1][:, :, :1])
        return out
