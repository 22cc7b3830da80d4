"""What the block-retrieval baselines share (quest.py, infllm.py): the fp16 K/V of every token lives in the host
store (prefetch.Prefetcher), and a decode step stores the token, picks the rows to fetch from what the device
keeps, fetches them and waits (the token about to attend chooses them: SpeCache's `sequential` order), then
attends exactly. A subclass keeps its own device state and defines `store`, `select` and `attend`."""
from functools import partial
from typing import Optional

import torch
import torch.nn as nn

from cache import FullCache, KVCaches, plan_layers, prefill_chunk
from config import NO_FETCH, CacheConfig
from kernels import Picked
from quant import MemoryMeter, deployed_nbytes
from prefetch import Prefetcher

EMPTY = FullCache.EMPTY  # position of a slot never written


class RetrievalCache(nn.Module):
    """One global layer's cache: a subclass's device state and the ring of fetched rows (ring_k/ring_v
    [B,H,k,D], ring_pos: the positions they hold). `layer_idx`: this layer among the prefetcher's layers."""

    policy = NO_FETCH  # one token a step, nothing fetched ahead (generate.generate reads it)
    what = "block-retrieval caches"  # the caches' name in errors

    def __init__(self, layer_idx, prefetcher: Prefetcher, batch, n_kv_heads, max_seq_len, head_dim, dtype, device,
                 config: CacheConfig, meter: Optional[MemoryMeter] = None):
        super().__init__()
        self.layer_idx, self.prefetcher, self.config = layer_idx, prefetcher, config
        self.max_seq_len, self.meter = max_seq_len, meter or MemoryMeter()
        self.dtype, self.device = dtype, device
        B, H, D, k = batch, n_kv_heads, head_dim, prefetcher.k
        self.buf("ring_k", (B, H, k, D), 0)
        self.buf("ring_v", (B, H, k, D), 0)
        self.buf("ring_pos", (B, H, k), EMPTY, torch.int64)
        self.buf("length", (), 0, torch.int64)
        prefetcher.register_ring(layer_idx, self.ring_k, self.ring_v)

    def buf(self, name, shape, fill, dtype=None):
        """A non-persistent buffer of `fill`s (in the model's dtype unless given)."""
        self.register_buffer(name, torch.full(shape, fill, dtype=dtype or self.dtype, device=self.device),
                             persistent=False)

    def prefill(self, q, k, v, input_pos):
        """Exact attention over the host store's earlier positions and the chunk, then the chunk stored."""
        return prefill_chunk(self, q, k, v, input_pos, int(self.length),
                             partial(self.prefetcher.host_prefix, self.layer_idx))

    def forward(self, q, k, v, input_pos, mode="decode"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        if mode != "decode" or q.shape[2] != 1:
            raise ValueError(f"the {self.config.kind} cache decodes one token a step (mode {mode!r}, {q.shape[2]} tokens)")
        pos = input_pos[0]
        self.store(k, v, input_pos)
        rows, valid = self.select(q[:, :, 0], pos)
        self.ring_pos.copy_(torch.where(valid, rows, EMPTY))
        bufs = [self.ring_k, self.ring_v]
        # the token to the host store; the selected rows (-1: not needed, the slot keeps its row) to the ring
        self.prefetcher.start(self.layer_idx, bufs, Picked(torch.where(valid, rows, -1), valid), k, v, pos)
        self.prefetcher.wait(self.layer_idx, bufs, now=True)
        if self.layer_idx == self.prefetcher.n_layers - 1:
            self.prefetcher.end_step()
        return self.attend(q, pos)

    # ---- bytes ------------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Every buffer: what picks the rows, the rows kept on the device, the ring of fetched rows (and their
        positions)."""
        return sum(b.nbytes for b in self.buffers())

    def deployed_bytes(self) -> int:
        """device_bytes in a 16-bit deployment (quant.deployed_nbytes)."""
        return deployed_nbytes(*self.buffers())

    def host_bytes(self) -> int:
        return self.prefetcher.host_bytes_per_layer()

    def read_bytes(self, step_tokens: int = 1) -> int:
        """A step reads what picks the rows, then all it attends over."""
        return self.device_bytes()


def build_caches(model, config: CacheConfig, batch: int, max_seq_len: Optional[int], cache_class, fetched_rows,
                 *cache_args) -> KVCaches:
    """Every layer of `model` its cache: `cache_class` in each global layer (built with `cache_args` after the
    configuration), a windowed FullCache in a layer whose sliding window is shorter than max_seq_len (as
    cache.setup_caches does); fetched_rows(max_seq_len): the rows a step fetches per layer and kv head."""
    args = model.args
    dims, windows, local, fetching = plan_layers(model, batch, max_seq_len, cache_class.what)
    _, _, max_seq_len, _, dtype, device = dims
    prefetcher = Prefetcher(len(fetching), batch, args.n_kv_heads, max_seq_len, args.head_dim, fetched_rows(max_seq_len),
                            dtype, device, async_ops=False)
    meter = MemoryMeter()

    def make(i):
        if local[i]:
            return FullCache(*dims, sliding_window=windows[i], max_step_tokens=1, meter=meter)
        return cache_class(fetching.index(i), prefetcher, *dims, config, *cache_args, meter=meter)

    caches = KVCaches(config, model.setup_caches(make), prefetcher, meter)
    meter.alloc(caches.device_bytes())
    return caches
