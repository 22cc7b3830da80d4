"""ZipCache (zipcache.txt §4) as a quantizer of the low-bit cache: `--quant zipcache`, cache names
kivi-...-zipcache and specache-...-zipcache (SpeCache's fetch over these codes).

    python generate.py --cache kivi --quant zipcache --bits 2 --salient-ratio 0.4 --bits-salient 4 ...

Keys are quantized as KIVI's; values channel-separably tokenwise (eq. 6): divided by a per-channel
scale c, then quantized per token, and read back as dequant * c. With `salient` > 0, mixed precision
(§4.2-4.3, quant.quantize_mixed): each key group's n_ref most salient tokens keep bits_salient bits,
the rest `bits`. Saliency is the normalized attention of eq. 8: at prefill from probe queries (eq. 9:
5% recent + 5% random of the chunk), while decoding from every real token's attention to the residual
rows, accumulated until they are quantized. The kernels read these codes through LowBitKV's v_chan,
k_ref, v_ref and ref_map (kernels.py's references, tiles.load_codes).
"""
from typing import Optional

import torch

import quant
from cache import LowBitCache
from config import CacheConfig
from lowbit import Fetched, LowBitKV


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

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig,
                 max_step_tokens=2, meter=None):
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, max_step_tokens, meter)
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

    def stored(self) -> LowBitKV:
        mixed = dict(k_ref=self.k_ref, v_ref=self.v_ref, ref_map=self.ref_map, ref_bits=self.ref_bits,
                     n_ref=self.n_ref) if self.mixed else {}
        return super().stored()._replace(v_chan=self.v_chan_scale, **mixed)

    # ---- the quantizer ---------------------------------------------------------------------------
    def channel_scale(self, v):
        """Eq. 6's c: the first quantized block sets it (n_quant == 0), later blocks keep it."""
        self.v_chan_scale.copy_(torch.where(self.n_quant == 0, quant.channel_scale(v, self.k_scale.dtype),
                                            self.v_chan_scale))
        return self.v_chan_scale

    def quantize_values(self, v):
        return quant.quantize_values_zip(v, self.bits, self.group_v, self.channel_scale(v), self.one_bit,
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
        kc, kl, ks, kz = quant.quantize_mixed(k, self.bits, self.bits_hi, G, "tokens", meta)
        v_sep = quant.channel_separated(v, self.channel_scale(v), meta)  # eq. 6
        vc, vl, vs, vz = quant.quantize_mixed(v_sep, self.bits, self.bits_hi, self.group_v, "channels", meta)
        k_ref, v_ref, ref_map = quant.compact_refinement(kl, vl, saliency, G, self.n_ref, self.ref_bits)
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
        probes = (quant.probe_positions(L, seed=p0) if probes is None else probes).to(q.device)
        keys = torch.cat([self.earlier_kv(p0)[0], k], 2)  # positions [0, p0 + L)
        acc, cnt = quant.normalized_attention(q[:, :, probes], keys, p0 + probes, self.sm_scale)
        return acc[:, :, p0 - nr:], cnt[:, :, p0 - nr:]

    def accumulate_saliency(self, q, lse):
        """Eq. 8 while decoding: the real token's (q [B,H,1,D], its lse [B,H,1]) attention to the
        residual rows it sees (its own included) joins their sums."""
        acc, cnt = quant.residual_attention(q, lse, self.k_res, self.res_len, self.sm_scale)
        self.sal_acc.add_(acc)
        self.sal_cnt.add_(cnt)

    def write_step(self, k, v):
        super().write_step(k, v)
        if self.mixed:  # rows (re)written: their saliency sums start again
            rows = self.res_len + torch.arange(k.shape[2], device=k.device)
            for buf in (self.sal_acc, self.sal_cnt):
                buf.index_fill_(2, rows, 0.0)

    def attend(self, q, fetched: Optional[Fetched] = None, select: int = 0):
        out = super().attend(q, fetched, select)
        if self.mixed:  # the real token is a saliency probe (a policy attending twice counts it twice: same ratio)
            self.accumulate_saliency(q[:, :, :1], out[1][:, :, :1])
        return out
