"""Quest-style block retrieval: a sibling baseline of SpeCache in the same offloading family.

Like SpeCache, the fp16 K/V of every token lives in the host store (prefetch.Prefetcher) and a decode
step moves k rows of K and V per layer and kv head host-to-device. What differs is what stays on the
device to choose them. SpeCache keeps a 1-bit copy of K/V and picks rows by their low-bit attention;
this cache keeps, per page of P consecutive tokens, the per-channel min and max of the page's keys
(Quest: Tang et al., 2024), and picks whole pages by the upper bound of q.k over the page:

    ub(q, page) = sum_d max(q_d * min_d, q_d * max_d)   >= q.k for every key k of the page

Under GQA a kv head serves G query heads: a page's score is the max of its G upper bounds (the page
any of them may need). The top k/P pages are fetched (k rows: SpeCache's bus bytes), and the token
attends exactly over the fetched pages, the fp residual window (the last `residual` positions) and the
first `sinks` positions, kept on the device. A fetched row in the window or the sinks is masked, so
the three sets are disjoint; with k/P pages covering the context this is exact attention.

Bytes: 1-bit SpeCache keeps 2*D bits per token and kv head of K+V codes, plus 16-bit zeros and
scales: keys 2*16 bits per channel per group of g tokens, values 2*16 per group of g channels, 64*D/g
bits a token, 3*D in all at g = 64. The bounds are 16-bit too (fp16 under an fp32 model): 2*D*16 bits
a page, 32*D/P a token. P = 16 gives 2*D bits a token, the codes without their zeros/scales (2/3 of
the 1-bit cache's per-token bytes at g = 64); P = 8 gives 4*D (4/3). P must divide k so that k rows
are whole pages; no divisor of 64 matches 3*D exactly (P = 32/3). Both caches add the same fp rows:
the residual window (64) and the k fetched rows. Default `quest-p16-k64-r64`: 4 pages of 16 a step.

Which pages may be fetched is decided by the token about to attend (Quest's query-aware selection),
so each step selects, fetches, waits and attends in turn (SpeCache's `sequential` fetch order; one
token a step: config.NO_FETCH). Selection and attention are torch ops at static shapes (index
tensors, no data-dependent Python); on CPU the transfer is a gather and the step compiles, on CUDA it
runs eagerly through the prefetcher's synchronous transfer (async_ops off).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F

from baselines.retrieval import EMPTY, RetrievalCache, build_caches
from cache import KVCaches
from config import CacheConfig
from quant import MemoryMeter
from prefetch import Prefetcher


def page_bounds(k: torch.Tensor, page: int):
    """Reference: k [B,H,N,D] -> (min, max) [B,H,ceil(N/page),D] per page and channel."""
    B, H, N, D = k.shape
    n_pages = -(-N // page)
    pad = n_pages * page - N
    lo = F.pad(k, (0, 0, 0, pad), value=math.inf).view(B, H, n_pages, page, D).amin(3)
    hi = F.pad(k, (0, 0, 0, pad), value=-math.inf).view(B, H, n_pages, page, D).amax(3)
    return lo, hi


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound, q [B,Hq,D], bounds [B,H,n_pages,D] -> [B,H,n_pages]: max over each kv
    head's G = Hq/H query heads of sum_d max(q_d*min_d, q_d*max_d)."""
    B, Hq, D = q.shape
    H = kmin.shape[1]
    qg = q.view(B, H, Hq // H, 1, D).float()
    lo, hi = kmin[:, :, None].float(), kmax[:, :, None].float()
    ub = torch.maximum(qg * lo, qg * hi).sum(-1)  # [B,H,G,n_pages]
    return ub.amax(2)


def select_pages(scores: torch.Tensor, n_pages_sel: int, page: int, first: int, end: torch.Tensor):
    """Top `n_pages_sel` pages among those that hold a position of [first, end) (the positions neither
    the sinks nor the residual window hold). scores [B,H,n_pages] -> (rows [B,H,n_pages_sel*page]
    positions of the pages' rows, valid [same]: the rows in [first, end))."""
    n_pages = scores.shape[-1]
    start = torch.arange(n_pages, device=scores.device) * page
    cand = (start < end) & (start + page > first)
    pages = torch.where(cand, scores, -math.inf).topk(n_pages_sel, -1).indices
    rows = (pages[..., None] * page + torch.arange(page, device=scores.device)).flatten(-2)
    return rows, (rows >= first) & (rows < end)


class QuestCache(RetrievalCache):
    """One global layer's cache: page bounds, sinks and residual window on the device, fp16 K/V in
    the prefetcher's host store, k fetched rows in a ring."""

    what = "Quest caches"

    def __init__(self, layer_idx, prefetcher: Prefetcher, batch, n_kv_heads, max_seq_len, head_dim, dtype, device,
                 config: CacheConfig, meter: Optional[MemoryMeter] = None):
        super().__init__(layer_idx, prefetcher, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, meter)
        self.page, self.sinks, self.residual = config.page, config.sinks, config.residual_len
        self.n_pages = -(-max_seq_len // self.page)
        self.n_sel = prefetcher.k // self.page
        B, H, D = batch, n_kv_heads, head_dim
        # 16-bit bounds, as 1-bit SpeCache's zeros/scales are (quant.quantized_bytes): fp16 under an fp32 model
        bounds = dtype if dtype.itemsize == 2 else torch.float16
        self.buf("kmin", (B, H, self.n_pages, D), math.inf, bounds)
        self.buf("kmax", (B, H, self.n_pages, D), -math.inf, bounds)
        for name, n in (("sink", self.sinks), ("res", self.residual)):
            self.buf(f"{name}_k", (B, H, n, D), 0)
            self.buf(f"{name}_v", (B, H, n, D), 0)
        self.buf("res_pos", (self.residual,), EMPTY, torch.int64)

    # ---- storing K/V ------------------------------------------------------------------------------
    def store(self, k, v, input_pos):
        """K/V [B,H,T,D] at positions input_pos [T]: bounds of their pages, sinks, residual window
        (the host store is written by the caller: offload in prefill, the transfer in decode)."""
        B, H, T, D = k.shape
        pages = (input_pos // self.page).view(1, 1, T, 1).expand(B, H, T, D)
        self.kmin.scatter_reduce_(2, pages, k.to(self.kmin.dtype), "amin")
        self.kmax.scatter_reduce_(2, pages, k.to(self.kmax.dtype), "amax")
        if self.sinks:
            first = input_pos < self.sinks
            if T > 1:  # a prefill chunk (eager)
                self.sink_k[:, :, input_pos[first]] = k[:, :, first].to(self.sink_k.dtype)
                self.sink_v[:, :, input_pos[first]] = v[:, :, first].to(self.sink_v.dtype)
            else:  # a decode step: static shapes, the slot rewritten with itself past the sinks
                slot = input_pos.clamp(max=self.sinks - 1)
                for sink, new in ((self.sink_k, k), (self.sink_v, v)):
                    sink.index_copy_(2, slot, torch.where(first.view(1, 1, 1, 1), new.to(sink.dtype),
                                                          sink.index_select(2, slot)))
        n = min(T, self.residual)
        slots = input_pos[-n:] % self.residual
        self.res_k.index_copy_(2, slots, k[:, :, -n:].to(self.res_k.dtype))
        self.res_v.index_copy_(2, slots, v[:, :, -n:].to(self.res_v.dtype))
        self.res_pos.index_copy_(0, slots, input_pos[-n:])
        self.length.copy_(torch.maximum(self.length, input_pos[-1] + 1))

    def append_prefill(self, k, v, input_pos, q=None):
        """A prefill chunk (eager): to the host store and the device state (tools/eval.py replays this)."""
        self.prefetcher.offload(self.layer_idx, k, v, input_pos)
        self.store(k, v, input_pos)

    # ---- a decode step (RetrievalCache.forward) ------------------------------------------------------------
    def select(self, q, pos):
        """Rows to fetch for the query q [B,Hq,D] at position pos (0-d): (rows, valid) [B,H,k]."""
        end = pos - self.residual + 1  # the window holds [end, pos]
        return select_pages(page_scores(q, self.kmin, self.kmax), self.n_sel, self.page, self.sinks, end)

    def attend(self, q, pos):
        """Exact attention over the sinks, the residual window and the fetched rows (disjoint sets)."""
        B, Hq = q.shape[:2]
        H = self.res_k.shape[1]
        sink_pos = torch.arange(self.sinks, device=q.device)
        res_ok = (self.res_pos >= self.sinks) & (self.res_pos <= pos)
        ok = torch.cat([(sink_pos <= pos).expand(B, H, -1), res_ok.expand(B, H, -1), self.ring_pos != EMPTY], -1)
        keys = torch.cat([self.sink_k, self.res_k, self.ring_k], 2)
        values = torch.cat([self.sink_v, self.res_v, self.ring_v], 2)
        mask = ok.repeat_interleave(Hq // H, 1)[:, :, None, :]
        return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=True)


def setup_caches(model, config: CacheConfig | str, batch: int = 1, max_seq_len: Optional[int] = None) -> KVCaches:
    """Every layer of `model` its cache: a QuestCache in each global layer, a windowed FullCache in a
    layer whose sliding window is shorter than max_seq_len (as cache.setup_caches does)."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if config.kind != "quest":
        raise ValueError(f"cache {config.name}: quest.setup_caches builds the quest caches only")

    def fetched_rows(max_seq_len):  # whole pages; k >= context fetches every page
        return min(config.k // config.page, -(-max_seq_len // config.page)) * config.page
    return build_caches(model, config, batch, max_seq_len, QuestCache, fetched_rows)
