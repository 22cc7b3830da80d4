"""KV caches. Each attention layer owns one; model.py calls `cache(q, k, v, input_pos, mode)`.

- FullCache: the 16-bit baseline (fp32 on CPU), static [B, Hkv, max_seq_len, D] buffers.
- LowBitCache: KIVI (specache.txt §3.4, eq. 2/3): packed low-bit codes for tokens [0, n_quant) and a
  full-precision residual window for the most recent tokens; when the residual holds `residual`
  tokens they are quantized as a block (keys per channel in groups of `group` tokens, values per
  token). `n_quant` and `res_len` are 0-d tensors, so one compiled decode graph serves every step.
- SpeCache: LowBitCache + the full fp16 cache on the host + `k` fetched fp16 rows per kv head
  that replace their quantized copies in attention (eq. 1). The speculative token's attention
  picks the rows the next step needs and starts their fetch (Algorithm 3); prefetch.py moves them.

Byte accounting is exact: `device_bytes()` sums the tensors that live on the compute device.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import quant


def causal_mask(input_pos: torch.Tensor, key_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[T, S] bool: query at input_pos[t] may attend key at key_pos[s]."""
    mask = key_pos[None, :] <= input_pos[:, None]
    if window is not None:  # Mistral sliding window
        mask &= input_pos[:, None] - key_pos[None, :] < window
    return mask


class MemoryMeter:
    """Device-side KV bytes over time, by the caches' own accounting (CPU has no allocator stats).
    Prefill registers each layer's transient fp KV, so `peak` shows Algorithm 1's layer-by-layer bound."""

    def __init__(self):
        self.current = 0
        self.peak = 0

    def alloc(self, n: int):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int):
        self.current -= n


class FullCache(nn.Module):
    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, sliding_window=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("key_pos", torch.arange(max_seq_len, device=device), persistent=False)
        self.sliding_window = sliding_window

    def forward(self, q, k, v, input_pos, mode="decode"):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        mask = causal_mask(input_pos, self.key_pos, self.sliding_window)
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)

    def device_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def host_bytes(self) -> int:
        return 0


class LowBitCache(nn.Module):
    """KIVI cache. Layout (S = capacity rounded up to `residual`, plus one scratch block that absorbs
    the no-op flush writes of a static-shape graph):
      k_codes [B,Hkv,S+R,D*bits/8] u8, k_scale/k_zero [B,Hkv,(S+R)/group,D]   keys per channel
      v_codes [B,Hkv,S+R,D*bits/8] u8, v_scale/v_zero [B,Hkv,S+R,D/group]     values per token
      k_res/v_res [B,Hkv,R+max_new,D]: the residual window; decode writes the step's tokens here first.
    `scheme` picks the quantizer of the siblings, all read by the same kernels:
      "kivi"       specache.txt eq. 2, and eq. 3 for 1 bit (one_bit="improved")
      "zipcache"   keys as KIVI; values channel-separable tokenwise (zipcache.txt eq. 6): the
                   channel scale v_chan_scale [B,Hkv,D] is set by the first quantized block, then fixed
      "quantspec"  hierarchical INT8 = upper INT4 (k_codes) + lower INT4 (k_codes_lo), quantspec.txt
                   §4.2; `bits` 4 or 8 picks the view attention reads (set `view_bits` to switch)
    """

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, *, bits=2, group=64,
                 residual=128, one_bit="improved", scheme="kivi", max_step_tokens=2, meter=None):
        super().__init__()
        if residual % group or residual <= 0:
            raise ValueError(f"--residual ({residual}) must be a positive multiple of --group ({group})")
        if scheme not in ("kivi", "zipcache", "quantspec"):
            raise ValueError(f"unknown quantization scheme {scheme!r} (kivi, zipcache, quantspec)")
        if bits not in ((4, 8) if scheme == "quantspec" else (1, 2, 4, 8)):
            raise ValueError(f"--bits {bits} is not available for scheme {scheme}")
        self.scheme, self.group, self.residual, self.one_bit = scheme, group, residual, one_bit
        self.bits = 4 if scheme == "quantspec" else bits  # bits per stored code (plane)
        self.view_bits = bits
        self.group_v = min(group, head_dim)
        self.sm_scale = head_dim ** -0.5
        self.capacity = -(-max_seq_len // residual) * residual  # quantized slots, scratch block after
        n_slots = self.capacity + residual
        B, H, D = batch, n_kv_heads, head_dim
        meta = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16  # scale/zero: 16 bits, as KIVI
        u8 = dict(dtype=torch.uint8, device=device)
        buf = lambda name, shape, **kw: self.register_buffer(name, torch.zeros(shape, **kw), persistent=False)
        buf("k_codes", (B, H, n_slots, D * self.bits // 8), **u8)
        buf("k_scale", (B, H, n_slots // group, D), dtype=meta, device=device)
        buf("k_zero", (B, H, n_slots // group, D), dtype=meta, device=device)
        buf("v_codes", (B, H, n_slots, D * self.bits // 8), **u8)
        buf("v_scale", (B, H, n_slots, D // self.group_v), dtype=meta, device=device)
        buf("v_zero", (B, H, n_slots, D // self.group_v), dtype=meta, device=device)
        if scheme == "quantspec":
            buf("k_codes_lo", (B, H, n_slots, D // 2), **u8)
            buf("v_codes_lo", (B, H, n_slots, D // 2), **u8)
        if scheme == "zipcache":
            buf("v_chan_scale", (B, H, D), dtype=meta, device=device)
        buf("k_res", (B, H, residual + max_step_tokens, D), dtype=dtype, device=device)
        buf("v_res", (B, H, residual + max_step_tokens, D), dtype=dtype, device=device)
        buf("n_quant", (), dtype=torch.int64, device=device)
        buf("res_len", (), dtype=torch.int64, device=device)
        self.meter = meter  # counts prefill's transient fp K/V; the builder counts these buffers

    # ---- storage -------------------------------------------------------------------------------
    def _quantize(self, k, v):
        """-> {buffer name: rows} for k, v [B,H,n,D]: per-row tensors and per-key-group tensors."""
        meta = self.k_scale.dtype
        if self.scheme == "quantspec":
            kc, kl, ks, kz = quant.quantize_hier_keys(k, self.group, meta)
            vc, vl, vs, vz = quant.quantize_hier_values(v, self.group_v, meta)
            return dict(k_codes=kc, k_codes_lo=kl, v_codes=vc, v_codes_lo=vl, v_scale=vs, v_zero=vz), \
                dict(k_scale=ks, k_zero=kz)
        kc, ks, kz = quant.quantize_keys(k, self.bits, self.group, one_bit=self.one_bit, meta_dtype=meta)
        if self.scheme == "zipcache":  # the first quantized block sets the channel scale
            self.v_chan_scale.copy_(torch.where(self.n_quant == 0, quant.channel_scale(v, meta), self.v_chan_scale))
            vc, vs, vz = quant.quantize_values_zip(v, self.bits, self.group_v, self.v_chan_scale, self.one_bit, meta)
        else:
            vc, vs, vz = quant.quantize_values(v, self.bits, self.group_v, one_bit=self.one_bit, meta_dtype=meta)
        return dict(k_codes=kc, v_codes=vc, v_scale=vs, v_zero=vz), dict(k_scale=ks, k_zero=kz)

    def _quantize_into(self, k, v, row0):
        """Quantize k, v [B,H,n,D] (n a multiple of group) into slots [row0, row0+n); row0 a tensor."""
        per_row, per_group = self._quantize(k, v)
        rows = row0 + torch.arange(k.shape[2], device=k.device)
        groups = row0 // self.group + torch.arange(k.shape[2] // self.group, device=k.device)
        for name, x in per_row.items():
            getattr(self, name).index_copy_(2, rows, x)
        for name, x in per_group.items():
            getattr(self, name).index_copy_(2, groups, x)

    def quant_kwargs(self):
        """The kernels' arguments that describe the stored codes (scheme, view, channel scale)."""
        hier8 = self.scheme == "quantspec" and self.view_bits == 8
        return dict(k_codes_lo=self.k_codes_lo if hier8 else None, v_codes_lo=self.v_codes_lo if hier8 else None,
                    v_chan_scale=self.v_chan_scale if self.scheme == "zipcache" else None)

    def dequantized(self, n: int):
        """Full-precision view of quantized tokens [0, n) (prefill only: it materializes them)."""
        kw = {name: x[:, :, :n] if name.endswith("_lo") and x is not None else x for name, x in self.quant_kwargs().items()}
        ng = n // self.group
        kq = kernels.dequant_k(self.k_codes[:, :, :n], kw["k_codes_lo"], self.k_scale[:, :, :ng],
                               self.k_zero[:, :, :ng], self.bits, self.group)
        vq = kernels.dequant_v(self.v_codes[:, :, :n], kw["v_codes_lo"], self.v_scale[:, :, :n],
                               self.v_zero[:, :, :n], self.bits, self.group_v, kw["v_chan_scale"])
        return kq.to(self.k_res.dtype), vq.to(self.v_res.dtype)

    def prefix_kv(self, p0: int):
        """Keys/values of positions [0, p0) for a prefill chunk: KIVI only has its low-bit copy."""
        nq, nr = int(self.n_quant), int(self.res_len)
        kq, vq = self.dequantized(nq)
        return torch.cat([kq, self.k_res[:, :, :nr]], 2), torch.cat([vq, self.v_res[:, :, :nr]], 2)

    def append_prefill(self, k, v, input_pos):
        """Eager: add a prefill chunk; quantize every full `residual` block, keep the rest fp."""
        nq, nr, R = int(self.n_quant), int(self.res_len), self.residual
        k_all = torch.cat([self.k_res[:, :, :nr], k], 2)
        v_all = torch.cat([self.v_res[:, :, :nr], v], 2)
        n_full = k_all.shape[2] // R * R
        if nq + n_full > self.capacity:
            raise ValueError(f"sequence of {nq + k_all.shape[2]} tokens exceeds the cache capacity {self.capacity}")
        if n_full:
            self._quantize_into(k_all[:, :, :n_full], v_all[:, :, :n_full], torch.tensor(nq, device=k.device))
        rest = k_all.shape[2] - n_full
        self.k_res[:, :, :rest] = k_all[:, :, n_full:]
        self.v_res[:, :, :rest] = v_all[:, :, n_full:]
        self.n_quant.fill_(nq + n_full)
        self.res_len.fill_(rest)

    def commit_step(self, keep: int = 1):
        """Static-shape end of a decode step: the first `keep` step tokens stay; a full residual is
        quantized into the next block (or, when not full, into the scratch block: same graph)."""
        R = self.residual
        res_len = self.res_len + keep
        flush = res_len >= R
        row0 = torch.where(flush, self.n_quant, torch.full_like(self.n_quant, self.capacity))
        self._quantize_into(self.k_res[:, :, :R], self.v_res[:, :, :R], row0)
        self.n_quant.add_(flush.long() * R)
        self.res_len.copy_(torch.where(flush, torch.zeros_like(res_len), res_len))

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, q, fetched=None):
        """Attention of the step's T query tokens (already appended to the residual) over
        quantized + residual (+ fetched fp rows replacing their quantized copies)."""
        return kernels.attention_lowbit(
            q, self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
            self.n_quant, self.k_res, self.v_res, self.res_len + q.shape[2],
            bits_k=self.bits, bits_v=self.bits, group_k=self.group, group_v=self.group_v,
            sm_scale=self.sm_scale, **self.quant_kwargs(), **(fetched or {}))

    def write_step(self, k, v):
        rows = self.res_len + torch.arange(k.shape[2], device=k.device)
        self.k_res.index_copy_(2, rows, k)
        self.v_res.index_copy_(2, rows, v)

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        self.write_step(k, v)
        out, _ = self.attend(q)
        self.commit_step(keep=1)
        return out

    def prefill(self, q, k, v, input_pos):
        """Algorithm 1: exact attention over this layer's prefix + chunk, then store low-bit.
        The fp K/V built here are transient: the meter counts them while this layer runs."""
        p0 = int(input_pos[0])
        if p0 != int(self.n_quant) + int(self.res_len):
            raise RuntimeError(f"prefill chunk starts at {p0} but the cache holds {int(self.n_quant) + int(self.res_len)} tokens")
        pk, pv = self.prefix_kv(p0)
        k_all, v_all = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        transient = k_all.nbytes + v_all.nbytes
        if self.meter is not None:
            self.meter.alloc(transient)
        mask = causal_mask(input_pos, torch.arange(k_all.shape[2], device=q.device), None)
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        self.append_prefill(k, v, input_pos)
        if self.meter is not None:
            self.meter.free(transient)
        return out

    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def host_bytes(self) -> int:
        return 0


class SpeCache(LowBitCache):
    """LowBitCache + host fp16 store + `k` fetched rows (speculative prefetch, specache.txt §3.3).

    fetch modes: "speculative" (Algorithm 3: the step's last token is the speculative one; its
    attention picks the next step's rows), "sequential" (paper Table 4: the real token's own
    low-bit attention picks rows, they are fetched synchronously, attention is recomputed), and
    "oracle" (like sequential, with the exact top-k from fp16 keys: an accuracy upper bound).
    """

    def __init__(self, layer_idx, prefetcher, *args, k=64, fetch="speculative", track_hits=False, **kw):
        super().__init__(*args, **kw)
        if fetch not in ("speculative", "sequential", "oracle"):
            raise ValueError(f"unknown --fetch {fetch!r}")
        self.layer_idx, self.prefetcher, self.k, self.fetch = layer_idx, prefetcher, k, fetch
        B, H, n_slots, _ = self.k_codes.shape
        dev, D = self.k_codes.device, self.k_res.shape[-1]
        # The fetched fp rows of this layer: module buffers, so a compiled step keeps their addresses.
        self.register_buffer("ring_k", torch.zeros(B, H, k, D, dtype=self.k_res.dtype, device=dev), persistent=False)
        self.register_buffer("ring_v", torch.zeros(B, H, k, D, dtype=self.k_res.dtype, device=dev), persistent=False)
        prefetcher.register_ring(layer_idx, self.ring_k, self.ring_v)
        self.register_buffer("fetch_idx", torch.zeros(B, H, k, dtype=torch.int64, device=dev), persistent=False)
        self.register_buffer("fetch_valid", torch.zeros(B, H, k, dtype=torch.bool, device=dev), persistent=False)
        self.register_buffer("replaced", torch.zeros(B, H, n_slots, dtype=torch.bool, device=dev), persistent=False)
        self.track_hits = track_hits
        self.register_buffer("hit_sum", torch.zeros((), dtype=torch.float64, device=dev), persistent=False)
        self.register_buffer("hit_sum_lowbit", torch.zeros((), dtype=torch.float64, device=dev), persistent=False)
        self.register_buffer("hit_steps", torch.zeros((), dtype=torch.int64, device=dev), persistent=False)

    # The host store holds every real token's fp16 k/v, by absolute position.
    def prefix_kv(self, p0):
        return self.prefetcher.host_prefix(self.layer_idx, p0)

    def append_prefill(self, k, v, input_pos):
        super().append_prefill(k, v, input_pos)
        self.prefetcher.offload(self.layer_idx, k, v, input_pos)

    def _fetched(self):
        """kwargs for attention_lowbit: the fetched rows and the quantized positions they replace.
        Unused slots point at the scratch slot (never attended), so the scatter is race-free."""
        safe_idx = torch.where(self.fetch_valid, self.fetch_idx, self.replaced.shape[-1] - 1)
        self.replaced.scatter_(2, safe_idx, self.fetch_valid)
        return dict(k_fetch=self.ring_k, v_fetch=self.ring_v, fetch_valid=self.fetch_valid, replaced=self.replaced), safe_idx

    def _select(self, q_row, lse_row, fetched=None):
        """Top-k quantized positions for one query token [B,H,D] -> (idx, valid) per kv head.
        `fetched`: the rows this step attended in fp, which score exactly (Algorithm 3's A)."""
        if self.fetch == "oracle":
            score, idx = kernels.topk_exact(q_row, self.prefetcher.host_keys(self.layer_idx), self.n_quant, self.k,
                                            self.sm_scale)
        else:
            score, idx = kernels.topk_lowbit(q_row, self.k_codes, self.k_scale, self.k_zero, self.n_quant, lse_row,
                                             bits_k=self.bits, group_k=self.group, sm_scale=self.sm_scale, k=self.k,
                                             k_codes_lo=self.quant_kwargs()["k_codes_lo"], **(fetched or {}))
        return idx, score >= 0

    def _record_hits(self, q_row, lse_row):
        """Top-k hit rates of the speculative fetch, for the real token of this step (rebuttal Q6):
        the share of its exact top-k (fp16 keys) that the fetch holds, and the share of its own
        low-bit top-k (what a sequential, non-speculative fetch would have brought) it holds.
        Steps with nothing quantized are not counted."""
        held = torch.where(self.fetch_valid, self.fetch_idx, -1)[..., None, :]
        counted = self.n_quant > 0
        exact = kernels.topk_exact(q_row, self.prefetcher.host_keys(self.layer_idx), self.n_quant, self.k, self.sm_scale)
        own = kernels.topk_lowbit(q_row, self.k_codes, self.k_scale, self.k_zero, self.n_quant, lse_row,
                                  bits_k=self.bits, group_k=self.group, sm_scale=self.sm_scale, k=self.k,
                                  k_codes_lo=self.quant_kwargs()["k_codes_lo"])
        for total, (score, idx) in ((self.hit_sum, exact), (self.hit_sum_lowbit, own)):
            hit = (idx[..., :, None] == held).any(-1) & (score >= 0)
            rate = (hit.sum(-1) / (score >= 0).sum(-1).clamp(min=1)).double().mean()
            total.add_(torch.where(counted, rate, 0.0))
        self.hit_steps.add_(counted.long())

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        keep = mode == "decode"  # pre-decoding (Algorithm 2) keeps nothing: T1 comes again as the real token
        # the real token's K/V, written to the host store by this layer's next transfer
        new = (k[:, :, :1], v[:, :, :1], input_pos[0]) if keep else (None, None, None)
        self.write_step(k, v)
        if self.fetch == "speculative":
            # Algorithm 3 (Algorithm 2 when mode == "predecode"): wait for this layer's prefetch only.
            self.prefetcher.wait(self.layer_idx, self.ring_k, self.ring_v)
            fetched, safe_idx = self._fetched()
            out, lse = self.attend(q, fetched)
            if self.track_hits and keep:
                self._record_hits(q[:, :, 0], lse[:, :, 0])
            self.replaced.scatter_(2, safe_idx, False)
            if keep:
                self.commit_step(keep=1)
            # The speculative (last) token's row picks the next step's rows, among the quantized
            # positions as they are after this step's flush; their transfer starts now and
            # overlaps the remaining layers of this step.
            idx, valid = self._select(q[:, :, -1], lse[:, :, -1],
                                      dict(k_fetch=fetched["k_fetch"], fetch_idx=self.fetch_idx, fetch_valid=self.fetch_valid))
            self.fetch_idx.copy_(idx)
            self.fetch_valid.copy_(valid)
            self.prefetcher.start(self.layer_idx, self.ring_k, self.ring_v, idx, *new)
        else:
            # Table 4 "sequential": pick rows with the real token itself, fetch, recompute.
            _, lse = self.attend(q)
            idx, valid = self._select(q[:, :, 0], lse[:, :, 0])
            self.fetch_idx.copy_(idx)
            self.fetch_valid.copy_(valid)
            self.prefetcher.start(self.layer_idx, self.ring_k, self.ring_v, idx)
            self.prefetcher.wait(self.layer_idx, self.ring_k, self.ring_v, now=True)
            fetched, safe_idx = self._fetched()
            out, _ = self.attend(q, fetched)
            self.replaced.scatter_(2, safe_idx, False)
            if keep:
                self.commit_step(keep=1)
                self.prefetcher.start(self.layer_idx, self.ring_k, self.ring_v, None, *new)
        if self.layer_idx == self.prefetcher.n_layers - 1:
            self.prefetcher.end_step()
        return out

    def host_bytes(self) -> int:
        return self.prefetcher.host_bytes_per_layer()
