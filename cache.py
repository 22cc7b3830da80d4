"""KV caches. Each attention layer owns one; model.py calls `cache(q, k, v, input_pos, mode)`, where
`mode` (model.MODES) says what the forward is. What a cache is, and its name, is a
config.CacheConfig; `setup_caches` gives every layer of a model its cache:
  FullCache    the 16-bit baseline; a ring of its window in a layer with a shorter sliding window
  LowBitCache  KIVI (specache.txt §3.4, eq. 2/3): packed low-bit codes and an fp residual
  SpeCache     LowBitCache + the fp16 cache on the host + fetched fp16 rows that replace their
               quantized copies in attention (eq. 1), picked and moved by a fetch policy (§3.3)
(Other quantizers subclass LowBitCache in their own files.) Byte accounting is exact: `device_bytes()`
sums the tensors on the compute device as run, `deployed_bytes()` the same tensors in a 16-bit deployment
(quant.deployed_nbytes), `read_bytes(T)` is what a decode step of T tokens reads.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
import quant
from config import NO_FETCH, CacheConfig, FetchPolicy, check_attn_path
from prefetch import Prefetcher
from quant import Fetched, LowBitKV, MemoryMeter, Residual, deployed_nbytes


def register_row_start(cache, row_start, batch: int, device):
    """The batch's [B] first real slot per row (a left-padded batch; zeros: none), one tensor that every cache
    of the model registers (setup_caches makes it; the model reads it too): the kernels, the masks, the
    quantizer and the selection read it from there. Not counted as KV bytes."""
    if row_start is None:
        row_start = torch.zeros(batch, dtype=torch.int64, device=device)
    cache.register_buffer("row_start", row_start, persistent=False)


def kv_buffers(cache) -> list:
    """A cache's buffers but the batch's row_start (shared by every layer)."""
    return [b for name, b in cache.named_buffers() if name != "row_start"]


def check_fits(input_pos, max_seq_len: int):
    """A prefill chunk (eager) past the positions the cache was set up for is an error, not a wrap or
    an overrun of its buffers."""
    end = int(input_pos[-1]) + 1
    if end > max_seq_len:
        raise ValueError(f"a sequence of {end} tokens does not fit caches set up for {max_seq_len} positions "
                         f"(setup_caches' max_seq_len)")


def exact_attention(q, k, v, input_pos, key_pos, window=None, row_start=None):
    """Softmax attention of queries at input_pos over keys at key_pos, causal (and windowed). The mask
    takes two comparisons per element: prefill builds one for every layer and chunk. row_start [B]: a
    left-padded batch's first real slot per row: its keys before it are padding, never attended (a padding
    query attends to itself alone, so that no row of the softmax is empty)."""
    mask = key_pos[None, :] <= input_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > (input_pos - window)[:, None]
    if row_start is not None:
        real = key_pos[None, None, :] >= row_start[:, None, None]  # [B, 1, S]
        mask = (mask & (real | (key_pos[None, :] == input_pos[:, None])))[:, None]  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def prefill_chunk(cache, q, k, v, input_pos, held: int, earlier_kv):
    """Algorithm 1 for one layer and one chunk of the prompt: exact attention of the chunk over positions
    [0, p0) (`earlier_kv(p0)`: what the cache keeps of them) and itself, then the chunk into the cache
    (`cache.append_prefill`). The fp K/V built here are transient: the meter counts them while this layer runs."""
    p0 = int(input_pos[0])
    check_fits(input_pos, cache.max_seq_len)
    if p0 != held:
        raise RuntimeError(f"prefill chunk starts at {p0} but the cache holds {held} tokens")
    earlier_k, earlier_v = earlier_kv(p0)
    k_all, v_all = torch.cat([earlier_k, k], 2), torch.cat([earlier_v, v], 2)
    with cache.meter.holding(k_all, v_all):
        out = exact_attention(q, k_all, v_all, input_pos, torch.arange(k_all.shape[2], device=q.device),
                              row_start=getattr(cache, "row_start", None))  # (the baselines' caches: no padding)
        cache.append_prefill(k, v, input_pos, q=q)
    return out


class FullCache(nn.Module):
    """The 16-bit cache (fp32 on CPU): K/V of position p in slot p % capacity, `key_pos` the position
    each slot holds. Without a sliding window (or one as long as the sequence) the capacity is
    max_seq_len and nothing wraps. A layer that attends within a window W shorter than that keeps a
    ring of W + max_step_tokens - 1 slots: the window of every token of a decode step (Gemma 3's
    local layers, Mistral's window)."""

    EMPTY = 2 ** 62  # key_pos of a slot never written: after every query, so masked as causality masks the future
    policy = NO_FETCH  # what generate.generate reads of a layer's cache: this one fetches nothing

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, sliding_window=None,
                 max_step_tokens=2, meter=None, row_start=None):
        super().__init__()
        register_row_start(self, row_start, batch, device)
        self.ring = sliding_window is not None and sliding_window + max_step_tokens - 1 < max_seq_len
        self.capacity = sliding_window + max_step_tokens - 1 if self.ring else max_seq_len
        shape = (batch, n_kv_heads, self.capacity, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("key_pos", torch.full((self.capacity,), self.EMPTY, device=device), persistent=False)
        self.register_buffer("length", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        self.sliding_window, self.meter = sliding_window, meter or MemoryMeter()
        self.max_seq_len = max_seq_len

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        self.append_prefill(k, v, input_pos)  # every mode stores: a later step writes its positions again
        return exact_attention(q, self.k_cache, self.v_cache, input_pos, self.key_pos, self.sliding_window,
                               self.row_start)

    def prefill(self, q, k, v, input_pos):
        """A chunk attends to the earlier positions the cache holds and to itself, then is stored.
        Eager: without a ring over the filled slots only; with one, over the ring's slots and the
        chunk side by side (a chunk longer than the ring would overwrite the rows it still needs)."""
        if not self.ring:  # (a ring takes any position: it keeps the window)
            check_fits(input_pos, self.max_seq_len)
            self.append_prefill(k, v, input_pos)
            end = int(input_pos[-1]) + 1
            return exact_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], input_pos,
                                   self.key_pos[:end], self.sliding_window, self.row_start)
        k_all, v_all = torch.cat([self.k_cache, k], 2), torch.cat([self.v_cache, v], 2)
        pos_all, W, C = torch.cat([self.key_pos, input_pos]), self.sliding_window, self.capacity
        out = []
        with self.meter.holding(k_all, v_all):
            for b0 in range(0, k.shape[2], W):  # query blocks of W positions: each sees at most 2W - 1 keys
                b1 = min(k.shape[2], b0 + W)
                keys = slice(C + b0 - W + 1 if b0 >= W - 1 else 0, C + b1)  # the ring's rows only near the start
                out.append(exact_attention(q[:, :, b0:b1], k_all[:, :, keys], v_all[:, :, keys], input_pos[b0:b1],
                                           pos_all[keys], W, self.row_start))
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

    def deployed_bytes(self) -> int:
        return deployed_nbytes(self.k_cache, self.v_cache)  # (row_start: the batch's positions, not KV bytes)

    def host_bytes(self) -> int:
        return 0

    def read_bytes(self, step_tokens: int = 1) -> int:
        """K/V bytes a decode step must read: every valid token (the step's own included; a ring: its slots)."""
        row = self.k_cache[0, :, 0].nbytes * self.k_cache.shape[0]
        return 2 * row * min(int(self.length) + step_tokens, self.capacity)


class LowBitCache(nn.Module):
    """KIVI cache (specache.txt §3.4, eq. 2, and eq. 3 for 1 bit). Layout (S = capacity rounded up to
    `residual`, plus one scratch block that absorbs the no-op flush writes of a static-shape graph):
      k_codes [B,Hkv,S+R,D*bits/8] u8, k_scale/k_zero [B,Hkv,(S+R)/group,D]   keys per channel
      v_codes [B,Hkv,S+R,D*bits/8] u8, v_scale/v_zero [B,Hkv,S+R,D/group]     values per token
      k_res/v_res [B,Hkv,R+max_step_tokens,D]: the residual window; decode writes the step's tokens here first.
    Another quantizer (config.scheme) is a subclass in its own file: it adds its buffers and overrides
    `quantize` (and `stored`, what the kernels read of them); generate.setup_caches picks it.
    """
    scheme = "kivi"  # the config.scheme this class quantizes by
    one_attn_path: Optional[str] = None  # a store read by a kernel of its own: the one path that kernel has

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig,
                 max_step_tokens=2, meter=None, row_start=None):
        super().__init__()
        register_row_start(self, row_start, batch, device)
        config = config.validated(head_dim)
        if config.scheme != self.scheme:
            raise ValueError(f"cache {config.name}: the {config.scheme} quantizer has its own cache class "
                             f"(generate.setup_caches builds it), not {type(self).__name__}")
        self.config, self.policy = config, config.policy  # (the decode loop reads the policy: generate.fetch_policy)
        self.group, self.one_bit, self.fit = config.group, config.one_bit, config.fit
        self.residual = config.residual_len
        self.bits = self.code_bits(config)
        self.group_v = min(self.group, head_dim)
        self.sm_scale = head_dim ** -0.5
        R = self.residual
        self.max_seq_len = max_seq_len
        self.capacity = -(-max_seq_len // R) * R  # quantized slots, scratch block after
        n_slots = self.capacity + R
        B, H, D = batch, n_kv_heads, head_dim
        meta = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16  # scale/zero: 16 bits, as KIVI
        self.device = torch.device(device)  # where the buffers live
        self.zeros_buffer("k_codes", (B, H, n_slots, D * self.bits // 8), dtype=torch.uint8)
        self.zeros_buffer("k_scale", (B, H, n_slots // self.group, D), dtype=meta)
        self.zeros_buffer("k_zero", (B, H, n_slots // self.group, D), dtype=meta)
        self.zeros_buffer("v_codes", (B, H, n_slots, D * self.bits // 8), dtype=torch.uint8)
        self.zeros_buffer("v_scale", (B, H, n_slots, D // self.group_v), dtype=meta)
        self.zeros_buffer("v_zero", (B, H, n_slots, D // self.group_v), dtype=meta)
        self.zeros_buffer("k_res", (B, H, R + max_step_tokens, D), dtype=dtype)
        self.zeros_buffer("v_res", (B, H, R + max_step_tokens, D), dtype=dtype)
        self.zeros_buffer("n_quant", (), dtype=torch.int64)
        self.zeros_buffer("res_len", (), dtype=torch.int64)
        self.meter = meter or MemoryMeter()  # counts prefill's transient fp K/V; setup_caches counts these buffers
        # The attention, settled here: the Triton kernel behind its custom op on CUDA (True on CPU, the tests: the
        # CUDA step's graph, the kernel interpreted), else the torch reference inline; and which Triton kernel
        # reads the codes (config.ATTN_PATHS)
        self.custom_ops = self.device.type == "cuda"
        self.attn_path = check_attn_path(config.attn_path)
        if self.one_attn_path is not None:
            if config.attn_path not in (None, self.one_attn_path):
                raise ValueError(f"cache {config.name}: the {self.scheme} store's codes are read on the "
                                 f"{self.one_attn_path} attention path only, not {config.attn_path!r}")
            self.attn_path = self.one_attn_path

    def zeros_buffer(self, name, shape, dtype, fill=0):
        """A non-persistent buffer of `fill`s on the cache's device."""
        self.register_buffer(name, torch.full(shape, fill, dtype=dtype, device=self.device), persistent=False)

    @staticmethod
    def code_bits(config: CacheConfig) -> int:
        """Bits per stored code."""
        return config.bits

    # ---- what the kernels read -----------------------------------------------------------------
    def stored(self) -> LowBitKV:
        """The quantized tokens as the kernels read them."""
        return LowBitKV(self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                        self.n_quant, self.bits, self.group, self.group_v, self.row_start)

    def residual_rows(self, step_tokens: int) -> Residual:
        """The fp window with the step's tokens (already written after the kept ones) at its end."""
        return Residual(self.k_res, self.v_res, self.res_len + step_tokens)

    # ---- storage -------------------------------------------------------------------------------
    def quantize(self, k, v, row0, first_group):
        """-> ({buffer: per-row tensor}, {buffer: per-key-group tensor}) for k, v [B,H,n,D] bound for
        slots [row0, row0+n); `first_group` [B, n/group] marks each row's first key group (the one holding its
        first real token; a batch without padding: the group of positions [0, group)):
        under the least-squares fit it keeps min/max unless the sinks are held in fp16, because the
        fit would pull the attention sinks' outlier keys off the grid and softmax leans on them
        (docs/policies.md, the least-squares fit)."""
        keep = first_group if self.config.sinks == 0 else None
        pad = (self.row_start - row0).clamp(0, k.shape[2])  # a left-padded row's padding in this block
        kc, ks, kz = quant.quantize_keys(k, self.bits, self.group, self.one_bit, self.k_scale.dtype, self.fit, keep, pad)
        vc, vs, vz = self.quantize_values(v)
        return dict(k_codes=kc, v_codes=vc, v_scale=vs, v_zero=vz), dict(k_scale=ks, k_zero=kz)

    def quantize_values(self, v):
        """Values per token (eq. 2/3) -> (codes, scale, zero)."""
        return quant.quantize_values(v, self.bits, self.group_v, self.one_bit, self.k_scale.dtype, self.fit)

    def quantize_block(self, k, v, row0, **quantizer_args):
        """Quantize k, v [B,H,n,D] (n a multiple of group) into slots [row0, row0+n); row0 a tensor.
        quantizer_args: what a subclass's `quantize` takes besides (`prefill_args`)."""
        groups = row0 // self.group + torch.arange(k.shape[2] // self.group, device=k.device)
        first_group = groups[None] == (self.row_start // self.group)[:, None]  # [B, n/group]
        per_row, per_group = self.quantize(k, v, row0, first_group, **quantizer_args)
        rows = row0 + torch.arange(k.shape[2], device=k.device)
        for name, x in per_row.items():
            getattr(self, name).index_copy_(2, rows, x)
        for name, x in per_group.items():
            getattr(self, name).index_copy_(2, groups, x)

    def dequantized(self, n: int):
        """Full-precision view of quantized tokens [0, n) (prefill only: it materializes them)."""
        k, v = self.stored().first_tokens(n).dequantized()
        return k.to(self.k_res.dtype), v.to(self.v_res.dtype)

    # ---- Algorithm 1: prefill, one layer and one chunk of the prompt ----------------------------
    def prefill(self, q, k, v, input_pos):
        return prefill_chunk(self, q, k, v, input_pos, int(self.n_quant) + int(self.res_len), self.earlier_kv)

    def earlier_kv(self, p0: int):
        """Keys/values of positions [0, p0), for a later chunk's exact attention: KIVI holds only its
        low-bit copy (SpeCache reads its fp16 host store instead)."""
        nq, nr = int(self.n_quant), int(self.res_len)
        kq, vq = self.dequantized(nq)
        return torch.cat([kq, self.k_res[:, :, :nr]], 2), torch.cat([vq, self.v_res[:, :, :nr]], 2)

    def blocks_to_quantize(self, n: int) -> int:
        """Of n fp tokens (the residual and a new chunk), how many to quantize now: whole residual blocks."""
        return n // self.residual * self.residual

    def prefill_args(self, q, k, input_pos, n_q: int) -> dict:
        """What `quantize` takes from a prefill chunk besides its K/V (the chunk's queries q, its keys k,
        the n_q fp tokens quantized now): nothing for KIVI."""
        return {}

    def append_prefill(self, k, v, input_pos, q=None):
        """Add a chunk's K/V (eager): quantize what `blocks_to_quantize` says, keep the rest in fp.
        `q`: the chunk's queries (for a quantizer that weighs tokens by them: prefill_args)."""
        nq, nr = int(self.n_quant), int(self.res_len)
        k_all = torch.cat([self.k_res[:, :, :nr], k], 2)
        v_all = torch.cat([self.v_res[:, :, :nr], v], 2)
        n = k_all.shape[2]
        n_q = self.blocks_to_quantize(n)
        if nq + n_q > self.capacity:
            raise ValueError(f"sequence of {nq + n} tokens exceeds the cache capacity {self.capacity}")
        args = self.prefill_args(q, k, input_pos, n_q)  # (before the residual rows move)
        if n_q:
            self.quantize_block(k_all[:, :, :n_q], v_all[:, :, :n_q], torch.tensor(nq, device=k.device), **args)
        self.k_res[:, :, :n - n_q] = k_all[:, :, n_q:]
        self.v_res[:, :, :n - n_q] = v_all[:, :, n_q:]
        self.n_quant.fill_(nq + n_q)
        self.res_len.fill_(n - n_q)

    # ---- decoding -------------------------------------------------------------------------------
    def write_step(self, k, v):
        """The step's K/V after the kept residual rows (attention reads them there)."""
        rows = self.res_len + torch.arange(k.shape[2], device=k.device)
        self.k_res.index_copy_(2, rows, k)
        self.v_res.index_copy_(2, rows, v)

    def attend(self, q, fetched: Optional[Fetched] = None, select: int = 0):
        """Attention of the step's T query tokens (already appended to the residual) over quantized + residual
        (+ fetched fp rows replacing their quantized copies) -> (out, lse); select > 0: also the last `select`
        tokens' logits, which the selection reads (kernels.attention_lowbit_ref says what each is). A sibling's
        store overrides it with its own kernel."""
        store, residual = self.stored(), self.residual_rows(q.shape[2])
        if not self.custom_ops:
            return kernels.attention_lowbit_ref(q, store, residual, fetched, self.sm_scale, select)
        out = kernels.attention_op(q, *kernels.op_inputs(store, residual, fetched), self.sm_scale, self.attn_path, select)
        return out if select else out[:2]

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
        return sum(b.nbytes for b in kv_buffers(self))

    def deployed_bytes(self) -> int:
        """device_bytes in a 16-bit deployment: the codes and 16-bit scales as stored, the residual (and
        SpeCache's ring of fetched rows and sinks) at 2 bytes an element."""
        return deployed_nbytes(*kv_buffers(self))

    def host_bytes(self) -> int:
        return 0

    def read_bytes(self, step_tokens: int = 1, stored: Optional[LowBitKV] = None) -> int:
        """Bytes a decode step's attention reads: codes and scales of the quantized tokens (`stored`,
        default self.stored()) and the fp residual rows."""
        return (stored or self.stored()).read_bytes(int(self.n_quant)) + \
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
        self.layer_idx, self.prefetcher = layer_idx, prefetcher
        self.n_fetch, self.sinks, self.rerank = prefetcher.k, config.sinks, config.rerank
        # The prefetcher's ring of this layer, as module buffers: a compiled step keeps their addresses.
        ring = prefetcher.new_ring(layer_idx, self.sinks)
        for name, buf in zip(("ring_k", "ring_v", "fetch_idx", "fetch_valid"), ring):
            self.register_buffer(name, buf, persistent=False)
        self.n_cand = prefetcher.key_rows  # re-ranking: low-bit candidates whose fp keys pick the k

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

    def quantize_block(self, k, v, row0, **quantizer_args):
        super().quantize_block(k, v, row0, **quantizer_args)
        if self.sinks:  # the block holding a row's first real tokens: they stay in fp16 on the device
            self.prefetcher.keep_sinks([self.ring_k, self.ring_v, self.fetch_valid], k, v, row0, self.sinks)

    # ---- selection ---------------------------------------------------------------------------------
    def pick(self, q_rows, lse_rows, logits) -> "kernels.Selection | kernels.Picked":
        """What this layer fetches, for Prefetcher.start: the top-k of the selecting rows' logits (re-ranking:
        of its N*k candidates, then by their fp keys), below `sinks` never; the oracle: the exact top-k of the
        host's fp keys."""
        if self.policy.exact:
            score, idx = kernels.topk_exact(q_rows, self.prefetcher.host_keys(self.layer_idx), self.n_quant,
                                         self.n_fetch, self.sm_scale, first=self.sinks, row_start=self.row_start)
            return kernels.Picked(idx, score >= 0)
        rerank = (q_rows, lse_rows, self.sm_scale) if self.rerank > 1 else None
        return kernels.Selection(logits, lse_rows, self.n_quant, self.n_cand if rerank else self.n_fetch, self.sinks, rerank,
                              self.row_start)

    # ---- a decode step ----------------------------------------------------------------------------
    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        keep = mode == "decode"  # pre-decoding (Algorithm 2) keeps nothing: T1 comes again as the real token
        real = (k[:, :, :1], v[:, :, :1], input_pos[0]) if keep else (None, None, None)  # for the host store
        self.write_step(k, v)
        if not self.policy.ahead:
            out = self.fetch_then_attend(q, keep, real)
        else:  # Algorithm 3: the step's last token selects (T=1: the real token itself, `lag`), or both do (`union`)
            self.prefetcher.wait(self.layer_idx, self.fetch_bufs())  # this layer's fetch only
            R = q.shape[2] if self.policy.selects == "both" else 1
            out, lse, logits = self.attend(q, self.fetched(), select=R)  # (it writes the selecting rows' logits)
            if keep:
                self.commit_step(keep=1)  # only the real token's KV stays
            # The selecting rows pick the next step's rows among the quantized positions as they are after the
            # flush (a flushed block scores by the fp rows it was attended with); the transfer overlaps the
            # remaining layers of the step.
            pick = self.pick(q[:, :, -R:], lse[:, :, -R:], logits)
            self.prefetcher.start(self.layer_idx, self.fetch_bufs(), pick, *real)
        if self.layer_idx == self.prefetcher.n_layers - 1:
            self.prefetcher.end_step()
        return out

    def fetch_then_attend(self, q, keep, real):
        """Table 4: pick rows with the real token itself, fetch and wait, then attend."""
        _, lse, logits = self.attend(q, self.fetched() if self.sinks else None, select=1)  # (these policies: T = 1)
        self.prefetcher.start(self.layer_idx, self.fetch_bufs(), self.pick(q, lse, logits))
        self.prefetcher.wait(self.layer_idx, self.fetch_bufs(), now=True)
        out, _ = self.attend(q, self.fetched())
        if keep:
            self.commit_step(keep=1)
            self.prefetcher.start(self.layer_idx, self.fetch_bufs(), None, *real)
        return out

    # ---- bytes ---------------------------------------------------------------------------------
    def host_bytes(self) -> int:
        return self.prefetcher.host_bytes_per_layer()

    def read_bytes(self, step_tokens: int = 1) -> int:
        """LowBitCache's, plus the fp rows (sinks and fetched), plus the selection's pass over the logits the
        attention wrote (4 bytes per position and selecting query row; the speculative token's: G rows a kv
        head). Re-ranking's candidate keys cross the bus into registers (prefetch.rerank_rows_ref): bus bytes,
        not device reads."""
        logits = 4 * self.k_res.shape[0] * self.prefetcher.query_heads * int(self.n_quant)
        return super().read_bytes(step_tokens) + self.ring_k.nbytes + self.ring_v.nbytes + logits


# ---- a model's caches ------------------------------------------------------------------------------
class KVCaches(list):
    """The caches setup_caches gave a model's layers, in layer order, with what they hold and move."""

    def __init__(self, config: CacheConfig, layers: list, prefetcher: Optional[Prefetcher], meter: MemoryMeter):
        super().__init__(layers)
        self.config, self.prefetcher, self.meter = config, prefetcher, meter

    def device_bytes(self) -> int:
        """KV bytes on the compute device (every buffer the caches allocated)."""
        return sum(c.device_bytes() for c in self)

    def deployed_bytes(self) -> int:
        """device_bytes in a 16-bit deployment (deployed_nbytes), whatever dtype the run computes in."""
        return sum(c.deployed_bytes() for c in self)

    def host_bytes(self) -> int:
        return sum(c.host_bytes() for c in self)

    def read_bytes(self, step_tokens: int) -> int:
        """KV bytes one decode step of `step_tokens` tokens reads (each cache's own byte floor)."""
        return sum(c.read_bytes(step_tokens) for c in self)

    def fetch_bytes_per_step(self, deployed: bool = False) -> int:
        """Host-to-device bytes a decode step may move (an upper bound: Prefetcher.bytes_per_step);
        deployed: in a 16-bit deployment."""
        return self.prefetcher.bytes_per_step(deployed) if self.prefetcher is not None else 0


def fetch_policy(model) -> FetchPolicy:
    """The fetch policy of the caches on `model`'s layers, which generate.generate runs: their
    configuration's (a layer that fetches nothing: NO_FETCH)."""
    fetching = {layer.attention.kv_cache.policy for layer in model.layers} - {NO_FETCH}
    if len(fetching) > 1:
        raise ValueError(f"the layers' caches fetch by different policies: {sorted(p.name for p in fetching)}")
    return fetching.pop() if fetching else NO_FETCH


def hold_fetched(model, rows: Optional[torch.Tensor]):
    """rows [B] bool: the batch rows whose fetched rows the next forward's fetch leaves as they are (a resync's
    pre-decoding fetches again only for the rows whose speculative token was wrong); None: every row fetches."""
    prefetchers = {id(p): p for p in (getattr(layer.attention.kv_cache, "prefetcher", None) for layer in model.layers)
                   if p is not None}
    for p in prefetchers.values():
        p.keep_rows.copy_(rows if rows is not None else torch.zeros_like(p.keep_rows))


class LayerPlan(NamedTuple):
    dims: tuple  # (batch, n_kv_heads, max_seq_len, head_dim, dtype, device): every cache's first arguments
    windows: list  # each layer's sliding window (None: global attention)
    local: list  # the window is shorter than max_seq_len: the layer keeps a windowed FullCache
    fetching: list  # the other layers: they keep the configured cache (and a fetching one its host rows)


def plan_layers(model, batch: int, max_seq_len: Optional[int], global_cache: Optional[str] = None) -> LayerPlan:
    """Which of `model`'s layers keep a window ring and which the configured cache, on the model's device
    and dtype, for max_seq_len positions (default the model's). global_cache names what the global layers
    keep where a model with no global layer must be refused (None: the full cache, which windows too)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    args = model.args
    max_seq_len = max_seq_len or args.max_seq_len
    weight = model.tok_embeddings.weight
    windows = [args.window(i) for i in range(args.n_layers)]
    local = [w is not None and w < max_seq_len for w in windows]
    if global_cache and all(local):
        raise ValueError(f"{global_cache} do not implement sliding-window attention: every layer of this model "
                         f"attends within {windows[0]} positions, fewer than the sequence's; use --cache full")
    dims = (batch, args.n_kv_heads, max_seq_len, args.head_dim, weight.dtype, weight.device)
    return LayerPlan(dims, windows, local, [i for i in range(args.n_layers) if not local[i]])


def batch_row_start(row_start, batch: int, max_seq_len: int, device) -> torch.Tensor:
    """A left-padded batch's first real slot per row as the caches' [B] int64 tensor on `device` (None: zeros).
    ValueError for the wrong length or a start outside [0, max_seq_len)."""
    if row_start is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    row_start = torch.as_tensor(row_start, dtype=torch.int64).to(device)
    if tuple(row_start.shape) != (batch,):
        raise ValueError(f"row_start has shape {tuple(row_start.shape)}: one start per row of the batch ({batch},)")
    if bool((row_start < 0).any()) or bool((row_start >= max_seq_len).any()):
        raise ValueError(f"row_start must lie in [0, {max_seq_len}) (each row's first real slot), got {row_start.tolist()}")
    return row_start.clone()


def setup_caches(model, config: CacheConfig | str = "specache", batch: int = 1, max_seq_len: Optional[int] = None,
                 store: type = LowBitCache, max_step_tokens: int = 2, row_start=None, **store_kw) -> KVCaches:
    """Give every layer of `model` (model.Transformer, or hf.HFModel) its cache, on the model's device
    and dtype, for sequences of max_seq_len positions (default the model's). `config`: a CacheConfig or
    its name. A layer whose sliding window (model.args.window) is shorter keeps the window-masked
    FullCache; the others the configured cache, and SpeCache's host store holds only them.
    `store`: the LowBitCache class of the configuration's quantizer (`store_kw` to its constructor;
    generate.setup_caches picks it), under SpeCache for the specache kind; max_step_tokens: the
    most tokens a step feeds. row_start [B]: a left-padded batch's first real slot per row (prompts of
    different lengths, padded to the longest; None: no padding): one tensor the model and every cache read.
    Raises ValueError on what the model or the kernels cannot run."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if config.kind != "full" and config.scheme != store.scheme:
        raise ValueError(f"cache {config.name}: the {config.scheme} quantizer's caches come from generate.setup_caches")
    args = model.args
    config = config.validated(args.head_dim)
    dims, windows, local, fetching = plan_layers(model, batch, max_seq_len,
                                                 None if config.kind == "full" else "low-bit caches")
    _, _, max_seq_len, _, dtype, device = dims
    row_start = batch_row_start(row_start, batch, max_seq_len, device)
    meter = MemoryMeter()
    prefetcher = None
    if config.kind == "specache":
        n_fetch = min(config.k, max_seq_len)  # k >= context fetches every row
        prefetcher = Prefetcher(len(fetching), batch, args.n_kv_heads, max_seq_len, args.head_dim, n_fetch, dtype,
                                device, impl=config.fetch_impl, key_rows=min(config.rerank * n_fetch, max_seq_len),
                                select_rows=(args.n_heads, 2 if config.policy.selects == "both" else 1)
                                if config.rerank > 1 else None, query_heads=args.n_heads, row_start=row_start)
    # SpeCache over another quantizer's store: the same fetch, that store's codes (Python's MRO
    # runs SpeCache's methods, then the store's, then LowBitCache's)
    fetching_cache = SpeCache if store is LowBitCache else type(f"SpeCache_{store.__name__}", (SpeCache, store), {})

    def make(i):
        if config.kind == "full" or local[i]:
            return FullCache(*dims, sliding_window=windows[i], max_step_tokens=max_step_tokens, meter=meter,
                             row_start=row_start)
        if config.kind == "specache":
            return fetching_cache(fetching.index(i), prefetcher, *dims, config, meter=meter, row_start=row_start)
        return store(*dims, config, meter=meter, row_start=row_start, **store_kw)

    caches = KVCaches(config, model.setup_caches(make, row_start), prefetcher, meter)
    meter.alloc(caches.device_bytes())
    return caches
