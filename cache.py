"""KV caches. Each attention layer owns one; model.py calls `cache(q, k, v, input_pos, mode)`, where
`mode` (model.MODES) says what the forward is. What a cache is, and its name, is a
config.CacheConfig; `setup_caches` gives every layer of a model its cache:
  FullCache    the 16-bit baseline; a ring of its window in a layer with a shorter sliding window
  LowBitCache  KIVI (specache.txt §3.4, eq. 2/3) and ZipCache: packed low-bit codes and an fp residual
  SpeCache     LowBitCache + the fp16 cache on the host + fetched fp16 rows that replace their
               quantized copies in attention (eq. 1), picked and moved by a fetch policy (§3.3)
(quantspec.py holds QuantSpec's cache.) Byte accounting is exact: `device_bytes()` sums the tensors
on the compute device, `read_bytes(T)` is what a decode step of T tokens reads (the byte floor).
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import quant
import topk
from config import CacheConfig
from kernels import Fetched, LowBitKV, Residual
from prefetch import Prefetcher

def exact_attention(q, k, v, input_pos, key_pos, window=None):
    """Softmax attention of queries at input_pos over keys at key_pos, causal (and windowed). The mask
    takes two comparisons per element: prefill builds one for every layer and chunk."""
    mask = key_pos[None, :] <= input_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > (input_pos - window)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


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


class FullCache(nn.Module):
    """The 16-bit cache (fp32 on CPU): K/V of position p in slot p % capacity, `key_pos` the position
    each slot holds. Without a sliding window (or one as long as the sequence) the capacity is
    max_seq_len and nothing wraps. A layer that attends within a window W shorter than that keeps a
    ring of W + max_step_tokens - 1 slots: the window of every token of a decode step (Gemma 3's
    local layers, Mistral's window)."""

    EMPTY = 2 ** 62  # key_pos of a slot never written: after every query, so masked as causality masks the future

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, sliding_window=None,
                 max_step_tokens=2, meter=None):
        super().__init__()
        self.ring = sliding_window is not None and sliding_window + max_step_tokens - 1 < max_seq_len
        self.capacity = sliding_window + max_step_tokens - 1 if self.ring else max_seq_len
        shape = (batch, n_kv_heads, self.capacity, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("key_pos", torch.full((self.capacity,), self.EMPTY, device=device), persistent=False)
        self.register_buffer("length", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.sliding_window, self.meter = sliding_window, meter or MemoryMeter()

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        self.append_prefill(k, v, input_pos)  # every mode stores: a later step writes its positions again
        return exact_attention(q, self.k_cache, self.v_cache, input_pos, self.key_pos, self.sliding_window)

    def prefill(self, q, k, v, input_pos):
        """A chunk attends to the earlier positions the cache holds and to itself, then is stored.
        Eager: without a ring over the filled slots only; with one, over the ring's slots and the
        chunk side by side (a chunk longer than the ring would overwrite the rows it still needs)."""
        if not self.ring:
            self.append_prefill(k, v, input_pos)
            end = int(input_pos[-1]) + 1
            return exact_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], input_pos,
                                   self.key_pos[:end], self.sliding_window)
        k_all, v_all = torch.cat([self.k_cache, k], 2), torch.cat([self.v_cache, v], 2)
        pos_all, W, C = torch.cat([self.key_pos, input_pos]), self.sliding_window, self.capacity
        out = []
        with self.meter.holding(k_all, v_all):
            for b0 in range(0, k.shape[2], W):  # query blocks of W positions: each sees at most 2W - 1 keys
                b1 = min(k.shape[2], b0 + W)
                keys = slice(C + b0 - W + 1 if b0 >= W - 1 else 0, C + b1)  # the ring's rows only near the start
                out.append(exact_attention(q[:, :, b0:b1], k_all[:, :, keys], v_all[:, :, keys], input_pos[b0:b1],
                                           pos_all[keys], W))
        self.append_prefill(k, v, input_pos)
        return torch.cat(out, 2)

    def append_prefill(self, k, v, input_pos, q=None):
        """Store K/V [B,Hkv,T,D] at positions input_pos (a ring keeps the last `capacity`; tools/eval.py
        replays a recorded prefill this way)."""
        n = min(k.shape[2], self.capacity)
        slots = input_pos[-n:] % self.capacity
        self.k_cache.index_copy_(2, slots, k[:, :, -n:])
        self.v_cache.index_copy_(2, slots, v[:, :, -n:])
        self.key_pos.index_copy_(0, slots, input_pos[-n:])
        self.length.copy_(torch.maximum(self.length, input_pos[-1] + 1))

    def device_bytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def host_bytes(self) -> int:
        return 0

    def read_bytes(self, step_tokens: int = 1) -> int:
        """K/V bytes a decode step must read: every valid token (the step's own included; a ring: its slots)."""
        row = self.k_cache[0, :, 0].nbytes * self.k_cache.shape[0]
        return 2 * row * min(int(self.length) + step_tokens, self.capacity)


class LowBitCache(nn.Module):
    """KIVI cache. Layout (S = capacity rounded up to `residual`, plus one scratch block that absorbs
    the no-op flush writes of a static-shape graph):
      k_codes [B,Hkv,S+R,D*bits/8] u8, k_scale/k_zero [B,Hkv,(S+R)/group,D]   keys per channel
      v_codes [B,Hkv,S+R,D*bits/8] u8, v_scale/v_zero [B,Hkv,S+R,D/group]     values per token
      k_res/v_res [B,Hkv,R+max_step_tokens,D]: the residual window; decode writes the step's tokens here first.
    `scheme` picks the quantizer of the siblings, all read by the same kernels:
      "kivi"       specache.txt eq. 2, and eq. 3 for 1 bit (one_bit="improved")
      "zipcache"   keys as KIVI; values channel-separable tokenwise (zipcache.txt eq. 6): the
                   channel scale v_chan_scale [B,Hkv,D] is set by the first quantized block, then fixed.
                   With `salient` > 0, mixed precision (§4.2-4.3, quant.quantize_mixed): each key
                   group's n_ref most salient tokens keep bits_salient bits, the rest `bits`:
                     k_ref/v_ref [B,Hkv,(S+R)/group*n_ref,D*r/8]  lower r bits of the salient rows
                     ref_map [B,Hkv,S+R] u8                      a slot's row among its group's (255: none)
                   Saliency is the normalized attention of eq. 8 (`saliency`): at prefill from probe
                   queries (eq. 9: 5% recent + 5% random of the chunk), while decoding from every real
                   token's attention to the residual rows, accumulated until they are quantized.
      "quantspec"  hierarchical INT8 = upper INT4 (k_codes) + lower INT4 (k_codes_lo), quantspec.txt
                   §4.2; config bits 4 or 8 picks the view attention reads (set `view_bits` to switch)
    """

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig,
                 max_step_tokens=2, meter=None):
        super().__init__()
        config = config.validated(head_dim)
        self.config = config
        self.scheme, self.group, self.one_bit, self.fit = config.scheme, config.group, config.one_bit, config.fit
        self.residual = config.residual_len
        self.bits = 4 if config.scheme == "quantspec" else config.bits  # bits per stored code (plane)
        self.view_bits = config.bits
        self.group_v = min(self.group, head_dim)
        self.sm_scale = head_dim ** -0.5
        R = self.residual
        self.capacity = -(-max_seq_len // R) * R  # quantized slots, scratch block after
        n_slots = self.capacity + R
        B, H, D = batch, n_kv_heads, head_dim
        meta = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16  # scale/zero: 16 bits, as KIVI
        u8 = dict(dtype=torch.uint8, device=device)
        buf = lambda name, shape, **kw: self.register_buffer(name, torch.zeros(shape, **kw), persistent=False)  # noqa: E731
        buf("k_codes", (B, H, n_slots, D * self.bits // 8), **u8)
        buf("k_scale", (B, H, n_slots // self.group, D), dtype=meta, device=device)
        buf("k_zero", (B, H, n_slots // self.group, D), dtype=meta, device=device)
        buf("v_codes", (B, H, n_slots, D * self.bits // 8), **u8)
        buf("v_scale", (B, H, n_slots, D // self.group_v), dtype=meta, device=device)
        buf("v_zero", (B, H, n_slots, D // self.group_v), dtype=meta, device=device)
        if self.scheme == "quantspec":
            buf("k_codes_lo", (B, H, n_slots, D // 2), **u8)
            buf("v_codes_lo", (B, H, n_slots, D // 2), **u8)
        if self.scheme == "zipcache":
            buf("v_chan_scale", (B, H, D), dtype=meta, device=device)
        self.mixed = config.salient > 0
        if self.mixed:
            self.bits_hi, self.ref_bits, self.n_ref = config.bits_salient, config.bits_salient - config.bits, config.n_ref
            n_ref_rows = n_slots // self.group * self.n_ref
            buf("k_ref", (B, H, n_ref_rows, D * self.ref_bits // 8), **u8)
            buf("v_ref", (B, H, n_ref_rows, D * self.ref_bits // 8), **u8)
            self.register_buffer("ref_map", torch.full((B, H, n_slots), 255, **u8), persistent=False)
            # eq. 8's sums for the residual rows: attention received, and from how many query rows
            buf("sal_acc", (B, H, R + max_step_tokens), dtype=torch.float32, device=device)
            buf("sal_cnt", (B, H, R + max_step_tokens), dtype=torch.float32, device=device)
        buf("k_res", (B, H, R + max_step_tokens, D), dtype=dtype, device=device)
        buf("v_res", (B, H, R + max_step_tokens, D), dtype=dtype, device=device)
        buf("n_quant", (), dtype=torch.int64, device=device)
        buf("res_len", (), dtype=torch.int64, device=device)
        self.meter = meter or MemoryMeter()  # counts prefill's transient fp K/V; setup_caches counts these buffers
        self.custom_ops = None  # kernels behind their custom ops: None = on CUDA; True on CPU (tests): the CUDA graph

    # ---- what the kernels read -----------------------------------------------------------------
    def stored(self, view_bits: Optional[int] = None) -> LowBitKV:
        """The quantized tokens as the kernels read them (QuantSpec: the view `view_bits`, 4 or 8, picks;
        default the configuration's)."""
        hier8 = self.scheme == "quantspec" and (view_bits or self.view_bits) == 8
        mixed = dict(k_ref=self.k_ref, v_ref=self.v_ref, ref_map=self.ref_map, ref_bits=self.ref_bits,
                     n_ref=self.n_ref) if self.mixed else {}
        return LowBitKV(self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                        self.n_quant, self.bits, self.group, self.group_v,
                        k_codes_lo=self.k_codes_lo if hier8 else None, v_codes_lo=self.v_codes_lo if hier8 else None,
                        v_chan=self.v_chan_scale if self.scheme == "zipcache" else None, **mixed)

    def residual_rows(self, step_tokens: int) -> Residual:
        """The fp window with the step's tokens (already written after the kept ones) at its end."""
        return Residual(self.k_res, self.v_res, self.res_len + step_tokens)

    # ---- storage -------------------------------------------------------------------------------
    def _quantize(self, k, v, saliency=None, first_group=None):
        """-> ({buffer: per-row tensor}, {buffer: per-key-group tensor}, {buffer: per-refinement-row
        tensor}) for k, v [B,H,n,D]; `saliency` [B,H,n] for mixed precision; `first_group` [n/group]
        marks the key group of positions [0, group): under the least-squares fit it keeps min/max
        unless the sinks are held in fp16, because the fit would pull the attention sinks' outlier
        keys off the grid and softmax leans on them (docs/policies.md, the least-squares fit)."""
        meta = self.k_scale.dtype
        if self.mixed:
            return self._quantize_mixed(k, v, saliency, meta)
        if self.scheme == "quantspec":
            kc, kl, ks, kz = quant.quantize_hier_keys(k, self.group, meta)
            vc, vl, vs, vz = quant.quantize_hier_values(v, self.group_v, meta)
            return dict(k_codes=kc, k_codes_lo=kl, v_codes=vc, v_codes_lo=vl, v_scale=vs, v_zero=vz), \
                dict(k_scale=ks, k_zero=kz), {}
        keep = first_group if self.config.sinks == 0 else None
        kc, ks, kz = quant.quantize_keys(k, self.bits, self.group, self.one_bit, meta, self.fit, keep)
        if self.scheme == "zipcache":  # the first quantized block sets the channel scale
            self.v_chan_scale.copy_(torch.where(self.n_quant == 0, quant.channel_scale(v, meta), self.v_chan_scale))
            vc, vs, vz = quant.quantize_values_zip(v, self.bits, self.group_v, self.v_chan_scale, self.one_bit, meta, self.fit)
        else:
            vc, vs, vz = quant.quantize_values(v, self.bits, self.group_v, self.one_bit, meta, self.fit)
        return dict(k_codes=kc, v_codes=vc, v_scale=vs, v_zero=vz), dict(k_scale=ks, k_zero=kz), {}

    def _quantize_mixed(self, k, v, saliency, meta):
        """ZipCache: quantize at bits_hi; keep every token's upper `bits` and the lower bits of each
        key group's n_ref most salient tokens (static shapes: a fixed count per group)."""
        n, G, r = k.shape[2], self.group, self.ref_bits
        if saliency is None:  # a decode flush of the residual: eq. 8 from the accumulated sums
            saliency = self.sal_acc[:, :, :n] / self.sal_cnt[:, :, :n].clamp(min=1)
        kc, kl, ks, kz = quant.quantize_mixed(k, self.bits, self.bits_hi, G, "tokens", meta)
        self.v_chan_scale.copy_(torch.where(self.n_quant == 0, quant.channel_scale(v, meta), self.v_chan_scale))
        v_sep = quant.channel_separated(v, self.v_chan_scale, meta)  # eq. 6
        vc, vl, vs, vz = quant.quantize_mixed(v_sep, self.bits, self.bits_hi, self.group_v, "channels", meta)
        k_ref, v_ref, ref_map = quant.compact_refinement(kl, vl, saliency, G, self.n_ref, r)
        return dict(k_codes=kc, v_codes=vc, v_scale=vs, v_zero=vz, ref_map=ref_map), dict(k_scale=ks, k_zero=kz), \
            dict(k_ref=k_ref, v_ref=v_ref)

    def quantize_block(self, k, v, row0, saliency=None):
        """Quantize k, v [B,H,n,D] (n a multiple of group) into slots [row0, row0+n); row0 a tensor."""
        groups = row0 // self.group + torch.arange(k.shape[2] // self.group, device=k.device)
        per_row, per_group, per_ref = self._quantize(k, v, saliency, first_group=groups == 0)
        rows = row0 + torch.arange(k.shape[2], device=k.device)
        for name, x in per_row.items():
            getattr(self, name).index_copy_(2, rows, x)
        for name, x in per_group.items():
            getattr(self, name).index_copy_(2, groups, x)
        if per_ref:
            ref_rows = row0 // self.group * self.n_ref + torch.arange(per_ref["k_ref"].shape[2], device=k.device)
            for name, x in per_ref.items():
                getattr(self, name).index_copy_(2, ref_rows, x)

    def dequantized(self, n: int):
        """Full-precision view of quantized tokens [0, n) (prefill only: it materializes them)."""
        part = kernels.first_tokens(self.stored(), n)
        return kernels.dequant_keys(part).to(self.k_res.dtype), kernels.dequant_values(part).to(self.v_res.dtype)

    # ---- Algorithm 1: prefill, one layer and one chunk of the prompt ----------------------------
    def prefill(self, q, k, v, input_pos):
        """Exact attention of the chunk over every earlier position and itself, then the chunk into
        the cache. The fp K/V built here are transient: the meter counts them while this layer runs."""
        p0, held = int(input_pos[0]), int(self.n_quant) + int(self.res_len)
        if p0 != held:
            raise RuntimeError(f"prefill chunk starts at {p0} but the cache holds {held} tokens")
        earlier_k, earlier_v = self.earlier_kv(p0)
        k_all, v_all = torch.cat([earlier_k, k], 2), torch.cat([earlier_v, v], 2)
        with self.meter.holding(k_all, v_all):
            out = exact_attention(q, k_all, v_all, input_pos, torch.arange(k_all.shape[2], device=q.device))
            self.append_prefill(k, v, input_pos, q=q)
        return out

    def earlier_kv(self, p0: int):
        """Keys/values of positions [0, p0), for a later chunk's exact attention: KIVI holds only its
        low-bit copy (SpeCache reads its fp16 host store instead)."""
        nq, nr = int(self.n_quant), int(self.res_len)
        kq, vq = self.dequantized(nq)
        return torch.cat([kq, self.k_res[:, :, :nr]], 2), torch.cat([vq, self.v_res[:, :, :nr]], 2)

    def blocks_to_quantize(self, n: int) -> int:
        """Of n fp tokens (the residual and a new chunk), how many to quantize now: whole residual blocks."""
        return n // self.residual * self.residual

    def append_prefill(self, k, v, input_pos, q=None):
        """Add a chunk's K/V (eager): quantize what `blocks_to_quantize` says, keep the rest in fp.
        ZipCache's mixed precision picks salient tokens with the chunk's queries `q` (eq. 9)."""
        nq, nr = int(self.n_quant), int(self.res_len)
        k_all = torch.cat([self.k_res[:, :, :nr], k], 2)
        v_all = torch.cat([self.v_res[:, :, :nr], v], 2)
        n = k_all.shape[2]
        n_q = self.blocks_to_quantize(n)
        if nq + n_q > self.capacity:
            raise ValueError(f"sequence of {nq + n} tokens exceeds the cache capacity {self.capacity}")
        saliency = None
        if self.mixed:
            if q is None:
                raise ValueError("ZipCache mixed precision picks salient tokens with the prefill's queries: pass q")
            acc, cnt = self.probe_saliency(q, k, input_pos)
            acc = torch.cat([self.sal_acc[:, :, :nr], acc], 2)
            cnt = torch.cat([self.sal_cnt[:, :, :nr], cnt], 2)
            saliency = (acc / cnt.clamp(min=1))[:, :, :n_q]
            self.sal_acc[:, :, :n - n_q], self.sal_cnt[:, :, :n - n_q] = acc[:, :, n_q:], cnt[:, :, n_q:]
        if n_q:
            self.quantize_block(k_all[:, :, :n_q], v_all[:, :, :n_q], torch.tensor(nq, device=k.device), saliency)
        self.k_res[:, :, :n - n_q] = k_all[:, :, n_q:]
        self.v_res[:, :, :n - n_q] = v_all[:, :, n_q:]
        self.n_quant.fill_(nq + n_q)
        self.res_len.fill_(n - n_q)

    # ---- ZipCache saliency (zipcache.txt eq. 8-9) --------------------------------------------------
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

    # ---- decoding -------------------------------------------------------------------------------
    def write_step(self, k, v):
        """The step's K/V after the kept residual rows (attention reads them there)."""
        rows = self.res_len + torch.arange(k.shape[2], device=k.device)
        self.k_res.index_copy_(2, rows, k)
        self.v_res.index_copy_(2, rows, v)
        if self.mixed:  # rows (re)written: their saliency sums start again
            for buf in (self.sal_acc, self.sal_cnt):
                buf.index_fill_(2, rows, 0.0)

    def attend(self, q, fetched: Optional[Fetched] = None):
        """Attention of the step's T query tokens (already appended to the residual) over
        quantized + residual (+ fetched fp rows replacing their quantized copies)."""
        out, lse = kernels.attention_lowbit(q, self.stored(), self.residual_rows(q.shape[2]), fetched, self.sm_scale,
                                            use_op=self.custom_ops, attn_path=self.config.attn_path)
        if self.mixed:  # the real token is a saliency probe (a policy attending twice counts it twice: same ratio)
            self.accumulate_saliency(q[:, :, :1], lse[:, :, :1])
        return out, lse

    def commit_step(self, keep: int = 1):
        """Static-shape end of a decode step: the first `keep` step tokens stay; a full residual is
        quantized into the next block (or, when not full, into the scratch block: same graph)."""
        R = self.residual
        res_len = self.res_len + keep
        flush = res_len >= R
        row0 = torch.where(flush, self.n_quant, torch.full_like(self.n_quant, self.capacity))
        self.quantize_block(self.k_res[:, :, :R], self.v_res[:, :, :R], row0)
        self.n_quant.add_(flush.long() * R)
        self.res_len.copy_(torch.where(flush, torch.zeros_like(res_len), res_len))

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        self.write_step(k, v)
        out, _ = self.attend(q)
        if mode == "decode":  # the first token stays ("predecode" keeps nothing)
            self.commit_step(keep=1)
        return out

    # ---- bytes ---------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def host_bytes(self) -> int:
        return 0

    def read_bytes(self, step_tokens: int = 1, view_bits: Optional[int] = None) -> int:
        """Bytes a decode step's attention reads: codes and scales of the quantized tokens (both
        planes for QuantSpec's 8-bit view, ZipCache's channel scale) and the fp residual rows."""
        return kernels.lowbit_read_bytes(self.stored(view_bits), int(self.n_quant)) + \
            self.k_res[:, :, :1].nbytes * 2 * (int(self.res_len) + step_tokens)


class SpeCache(LowBitCache):
    """LowBitCache + host fp16 store + `n_fetch` fetched rows (speculative prefetch, specache.txt §3.3).

    The ring [B, Hkv, sinks + n_fetch, D] holds the fp16 rows the real token attends to in place of
    their quantized copies: the first `sinks` positions (kept on the device once quantized) and the
    fetched rows. What a decode step does is the configuration's fetch policy (config.FetchPolicy):
      ahead       (speculative, union, resync, lag) attend with the rows fetched for this step, then
                  the selecting token's attention picks the next step's rows and their transfer
                  starts; it overlaps the rest of the step (Algorithm 3; Algorithm 2 in pre-decoding)
      not ahead   (sequential, oracle: paper Table 4) the real token's own attention picks rows (the
                  oracle: by their fp16 keys), they are fetched and waited for, attention runs again
    `layer_idx` is this layer's index among the prefetcher's layers (the ones that fetch).
    """

    def __init__(self, layer_idx, prefetcher, batch, n_kv_heads, max_seq_len, head_dim, dtype, device,
                 config: CacheConfig, **kw):
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, **kw)
        self.layer_idx, self.prefetcher, self.policy = layer_idx, prefetcher, config.policy
        self.n_fetch, self.sinks, self.rerank = prefetcher.k, config.sinks, config.rerank
        B, H, dev, n = batch, n_kv_heads, self.k_codes.device, self.sinks + prefetcher.k
        # The fp rows of this layer: module buffers, so a compiled step keeps their addresses.
        self.register_buffer("ring_k", torch.zeros(B, H, n, head_dim, dtype=dtype, device=dev), persistent=False)
        self.register_buffer("ring_v", torch.zeros(B, H, n, head_dim, dtype=dtype, device=dev), persistent=False)
        idx = torch.arange(n, device=dev).clamp(max=self.sinks).expand(B, H, n).contiguous()  # sinks: 0..sinks-1
        self.register_buffer("fetch_idx", idx, persistent=False)
        self.register_buffer("fetch_valid", torch.zeros(B, H, n, dtype=torch.bool, device=dev), persistent=False)
        self.n_cand = prefetcher.key_rows  # re-ranking: low-bit candidates whose fp keys pick the k
        prefetcher.register_ring(layer_idx, self.ring_k, self.ring_v, off=self.sinks,
                                 index_bufs=(self.fetch_idx, self.fetch_valid))

    def fetch_bufs(self) -> list:
        """The buffers this layer's transfer writes: the ring and which positions it holds."""
        return [self.ring_k, self.ring_v, self.fetch_idx, self.fetch_valid]

    def fetched(self) -> Fetched:
        """The rows in the ring and the quantized positions they replace in attention (eq. 1)."""
        return Fetched(self.ring_k, self.ring_v, self.fetch_idx, self.fetch_valid)

    # ---- Algorithm 1: the host store holds every real token's fp16 K/V, by absolute position ----
    def earlier_kv(self, p0):
        return self.prefetcher.host_prefix(self.layer_idx, p0)

    def append_prefill(self, k, v, input_pos, q=None):
        super().append_prefill(k, v, input_pos, q)
        self.prefetcher.offload(self.layer_idx, k, v, input_pos)

    def quantize_block(self, k, v, row0, saliency=None):
        super().quantize_block(k, v, row0, saliency)
        if self.sinks:  # the first block quantized: its first tokens stay in fp16 on the device
            self.prefetcher.keep_sinks([self.ring_k, self.ring_v, self.fetch_valid], k, v, row0 == 0, self.sinks)

    # ---- selection and fetch --------------------------------------------------------------------
    def select(self, q_rows, lse_rows, fetched: Optional[Fetched] = None):
        """Top-k quantized positions (sinks aside) for the query token(s) q_rows [B,H,D] or [B,H,R,D]
        -> (idx, valid) [B,Hkv,n_fetch] per kv head and None; with re-ranking, the low-bit top-(N*k)
        candidates (idx, valid) [B,Hkv,N*k] and the query rows and lse that pick the k among them
        (start_fetch). `fetched`: the rows this step attended in fp, which score exactly (Algorithm 3's A)."""
        if self.policy.exact:
            score, idx = topk.topk_exact(q_rows, self.prefetcher.host_keys(self.layer_idx), self.n_quant,
                                         self.n_fetch, self.sm_scale, first=self.sinks)
        elif self.rerank > 1:
            # Re-ranking: the low-bit top-(N*k) are candidates; their fp keys decide the k where the
            # keys land (prefetch.Prefetcher.start_rerank: on the side stream on a GPU).
            score, cand = topk.topk_lowbit(q_rows, lse_rows, self.stored(), self.n_cand, self.sm_scale, fetched,
                                           first=self.sinks, use_op=self.custom_ops, attn_path=self.config.attn_path)
            return cand, score >= 0, topk.as_rows(q_rows, lse_rows)
        else:
            score, idx = topk.topk_lowbit(q_rows, lse_rows, self.stored(), self.n_fetch, self.sm_scale, fetched,
                                          first=self.sinks, use_op=self.custom_ops, attn_path=self.config.attn_path)
        return idx, score >= 0, None

    def start_fetch(self, idx, valid, rerank_by=None, real=(None, None, None)):
        """Remember which rows the ring will hold and start their transfer (plus, with `real` = (k, v,
        position) of the step's real token, its write to the host store, in the same transfer). With
        re-ranking (rerank_by = (q_rows, lse_rows)), idx are candidates and the transfer picks the rows."""
        if rerank_by is not None:
            self.prefetcher.start_rerank(self.layer_idx, self.fetch_bufs(), idx, valid, *rerank_by, self.sm_scale, *real)
        else:
            self.prefetcher.start(self.layer_idx, self.fetch_bufs(), idx, valid, *real)

    # ---- a decode step ----------------------------------------------------------------------------
    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        keep = mode == "decode"  # pre-decoding (Algorithm 2) keeps nothing: T1 comes again as the real token
        real = (k[:, :, :1], v[:, :, :1], input_pos[0]) if keep else (None, None, None)  # for the host store
        self.write_step(k, v)
        out = self.attend_then_fetch(q, keep, real) if self.policy.ahead else self.fetch_then_attend(q, keep, real)
        if self.layer_idx == self.prefetcher.n_layers - 1:
            self.prefetcher.end_step()
        return out

    def attend_then_fetch(self, q, keep, real):
        """Algorithm 3: q [B,H,T,D]; the step's last token selects (T=1: the real token itself, `lag`),
        or both tokens do (`union`)."""
        self.prefetcher.wait(self.layer_idx, self.fetch_bufs())  # this layer's fetch only
        fetched = self.fetched()
        out, lse = self.attend(q, fetched)
        if keep:
            self.commit_step(keep=1)  # only the real token's KV stays
        # The selecting row picks the next step's rows among the quantized positions as they are
        # after the flush; the transfer overlaps the remaining layers of the step.
        rows = slice(None) if self.policy.selects == "both" else slice(-1, None)
        self.start_fetch(*self.select(q[:, :, rows], lse[:, :, rows], fetched), real)
        return out

    def fetch_then_attend(self, q, keep, real):
        """Table 4: pick rows with the real token itself, fetch and wait, then attend."""
        _, lse = self.attend(q, self.fetched() if self.sinks else None)
        self.start_fetch(*self.select(q[:, :, :1], lse[:, :, :1]))
        self.prefetcher.wait(self.layer_idx, self.fetch_bufs(), now=True)
        out, _ = self.attend(q, self.fetched())
        if keep:
            self.commit_step(keep=1)
            self.prefetcher.start(self.layer_idx, self.fetch_bufs(), None, None, *real)
        return out

    # ---- bytes ---------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        return self.prefetcher.host_bytes_per_layer()

    def read_bytes(self, step_tokens: int = 1, view_bits: Optional[int] = None) -> int:
        """LowBitCache's, plus the fp rows (sinks and fetched), plus the top-k pass of the selecting
        token over the quantized keys (the CUDA kernels read them a second time; the CPU path reuses them).
        Re-ranking's candidate keys cross the bus into registers (transfer.rerank_rows): bus bytes,
        not device reads."""
        s = self.stored()
        keys_again = kernels.lowbit_read_bytes(s._replace(v_codes=None, v_scale=None, v_zero=None, v_codes_lo=None,
                                                          v_chan=None), int(self.n_quant))
        return super().read_bytes(step_tokens) + self.ring_k.nbytes + self.ring_v.nbytes + keys_again


# ---- a model's caches ------------------------------------------------------------------------------
class KVCaches(list):
    """The caches setup_caches gave a model's layers, in layer order, with what they hold and move."""

    def __init__(self, config: CacheConfig, layers: list, prefetcher: Optional[Prefetcher], meter: MemoryMeter):
        super().__init__(layers)
        self.config, self.prefetcher, self.meter = config, prefetcher, meter

    def device_bytes(self) -> int:
        """KV bytes on the compute device (every buffer the caches allocated)."""
        return sum(c.device_bytes() for c in self)

    def host_bytes(self) -> int:
        return sum(c.host_bytes() for c in self)

    def read_bytes(self, step_tokens: int) -> int:
        """KV bytes one decode step of `step_tokens` tokens reads (each cache's own byte floor)."""
        return sum(c.read_bytes(step_tokens) for c in self)

    def fetch_bytes_per_step(self) -> int:
        """Host-to-device bytes a decode step may move (an upper bound: Prefetcher.bytes_per_step)."""
        return self.prefetcher.bytes_per_step() if self.prefetcher is not None else 0


def kv_fp16_bytes(args, batch: int, seq_len: int) -> int:
    """What a 16-bit cache of every layer would hold: the reference the low-bit caches are compared with."""
    return 2 * args.n_layers * batch * args.n_kv_heads * seq_len * args.head_dim * 2


def setup_caches(model, config: CacheConfig | str = "specache", batch: int = 1, max_seq_len: Optional[int] = None,
                 lowbit_cache=None, max_step_tokens: int = 2) -> KVCaches:
    """Give every layer of `model` (model.Transformer, or hf.HFModel) its cache, on the model's device
    and dtype, for sequences of max_seq_len positions (default the model's). `config`: a CacheConfig or
    its name. A layer whose sliding window (model.args.window) is shorter keeps the window-masked
    FullCache; the others the configured cache, and SpeCache's host store holds only them.
    `lowbit_cache(dims, meter)` builds another kind's layer cache (quantspec.setup_caches: QuantSpec's,
    whose verify steps feed max_step_tokens = gamma + 1).
    Raises ValueError on what the model or the kernels cannot run."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    args = model.args
    max_seq_len = max_seq_len or args.max_seq_len
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    config = config.validated(args.head_dim)
    windows = [args.window(i) for i in range(args.n_layers)]
    local = [w is not None and w < max_seq_len for w in windows]
    if config.kind != "full" and all(local):
        raise ValueError(f"low-bit caches do not implement sliding-window attention: every layer of this model "
                         f"attends within {windows[0]} positions, fewer than the sequence's; use --cache full")
    meter = MemoryMeter()
    dims = (batch, args.n_kv_heads, max_seq_len, args.head_dim, dtype, device)
    fetching = [i for i in range(args.n_layers) if not local[i]]
    prefetcher = None
    if config.kind == "specache":
        n_fetch = min(config.k, max_seq_len)  # k >= context fetches every row
        prefetcher = Prefetcher(len(fetching), batch, args.n_kv_heads, max_seq_len, args.head_dim, n_fetch, dtype,
                                device, impl=config.fetch_impl, key_rows=min(config.rerank * n_fetch, max_seq_len),
                                select_rows=(args.n_heads, 2 if config.policy.selects == "both" else 1)
                                if config.rerank > 1 else None)

    if config.kind == "quantspec" and lowbit_cache is None:
        raise ValueError("the quantspec cache is shared with QuantSpec's draft: build it with quantspec.setup_caches")

    def make(i):
        if config.kind == "full" or local[i]:
            return FullCache(*dims, sliding_window=windows[i], max_step_tokens=max_step_tokens, meter=meter)
        if lowbit_cache is not None:
            return lowbit_cache(dims, meter)
        if config.kind == "kivi":
            return LowBitCache(*dims, config, meter=meter)
        return SpeCache(fetching.index(i), prefetcher, *dims, config, meter=meter)

    caches = KVCaches(config, model.setup_caches(make), prefetcher, meter)
    meter.alloc(caches.device_bytes())
    return caches
