"""Moving fp16 KV between host memory and the device (specache.txt §3.3, Figure 3).

`Prefetcher` owns the host store, host_k/host_v [L, B, Hkv, S, D]: every real token's full-precision
K/V, pinned on CUDA so the device can read it directly, and each layer's ring (`new_ring`): the
fetched rows ring_k/ring_v [B, Hkv, sinks + k, D] and which positions they hold, fetch_idx/fetch_valid.
The layer's SpeCache module registers them as its buffers, so a compiled step sees them as static
inputs (a CUDA graph replays on fixed addresses).

One transfer per layer and step, `start(layer, bufs, idx, valid, new_k, new_v, new_pos)` (bufs: the
layer's ring and its fetch_idx/fetch_valid, which record idx and valid): write the step's real
token to the host store and gather the selected host rows into the ring (transfer.transfer_rows).
`idx=None` only writes the token; `new_k=None` only gathers. With re-ranking (name part rrN,
rerank_by), idx are the low-bit candidates: the side stream gets them and the selecting query rows,
and topk.rerank_rows picks the k rows by their fp keys; the main stream only stages its inputs.

The selected indices' route on the async path, from selection to the ring: the functions that return
them or take them (SpeCache.forward calls the first two; _owner finds the op's Prefetcher and _run_side
runs a closure on the side stream, neither sees them):
  topk.select -> Prefetcher.start -> _fetch_start_op (the custom op) -> Prefetcher._start_async
  -> transfer.stage (main stream: staging) -> Prefetcher._transfer (side stream) -> transfer.transfer_rows
and with re-ranking: ... _rerank_start_op -> Prefetcher._start_async -> transfer.stage -> Prefetcher._rerank
-> topk.rerank_rows.

On CUDA the transfer runs on a side stream and overlaps the rest of the step:
  main stream: copy idx and the token's K/V into this layer's staging buffers and record idx and
               valid in fetch_idx/fetch_valid (one launch), record consumed[l]
  side stream: wait consumed[l], run the kernel (it reads pinned host memory through unified
               virtual addressing, so the indices never leave the device and nothing syncs),
               record fetched[l].
The side stream reads only memory this module owns (staging, host store) and writes only the
layer's ring buffers (`new_ring`, or `register_ring`'s; with re-ranking also fetch_idx and
fetch_valid), so graph-internal temporaries that a compiled step frees and reuses while the side
stream still runs never cross streams (the side stream's own temporaries come from its own
allocator pool). The custom ops check that they were handed the layer's own buffers, not copies
made by functionalization (which would make the side stream write a temporary).

A CUDA graph must join every stream it forks before its capture ends, so by default
(`join_each_step`) the last layer joins the side stream (`end_step`), and `wait(l)` has nothing to
do. Without graphs (`join_each_step=False`, eager CUDA) the main stream of the next step waits for
`fetched[l]` just before layer l's attention, so the copies also overlap sampling.

On CPU there is no bus: host and device memory are one, a transfer is a synchronous gather, and
the whole decode step stays traceable by torch.compile. `async_ops=True` on CPU runs the CUDA code
path (custom ops, streams and events of `torch.get_device_module`, which tests replace by delayed
fake streams).
"""
import weakref
from typing import Optional

import torch

from topk import rerank_rows, rerank_scratch
from transfer import record_rows, stage, transfer_rows, transfer_rows_ref

Tensor = torch.Tensor
# The custom ops below run outside the graph and need the Prefetcher (its streams, events, staging).
# An op takes only tensors and scalars, and a scalar id would be a constant of the compiled graph,
# recompiled for every new Prefetcher (every prompt of an evaluation). So an op finds its Prefetcher
# by the first ring buffer it is handed: the buffers are the layers' own (the ops check it).
_BY_RING = weakref.WeakValueDictionary()  # ring_k.data_ptr() of a layer -> its Prefetcher


def _owner(bufs: list[Tensor]) -> "Prefetcher":
    owner = _BY_RING.get(bufs[0].data_ptr())
    if owner is None:
        raise RuntimeError("a fetch op was handed a copy of its ring, not the ring buffer itself (a compiled graph "
                           "must pass module buffers through unchanged)")
    return owner


# =============================================================================================
# custom ops: what a compiled step calls on the async path (opaque to torch.compile)
# =============================================================================================
# They "mutate" each layer's registered buffers (the ring, fetch_idx, fetch_valid), which the
# transfer writes; that orders them against the attention that reads those buffers inside one
# fullgraph step; join mutates every layer's, so no fetch can be scheduled after it.
@torch.library.custom_op("specache::fetch_start", mutates_args=("bufs",))
def _fetch_start_op(bufs: list[Tensor], idx: Optional[Tensor], valid: Optional[Tensor], new_k: Optional[Tensor],
                    new_v: Optional[Tensor], new_pos: Optional[Tensor], layer: int) -> None:
    _owner(bufs)._start_async(layer, bufs, idx, valid, new_k, new_v, new_pos)


@_fetch_start_op.register_fake
def _(bufs, idx, valid, new_k, new_v, new_pos, layer):
    return None


@torch.library.custom_op("specache::rerank_start", mutates_args=("bufs",))
def _rerank_start_op(bufs: list[Tensor], cand: Tensor, cand_valid: Tensor, q_rows: Tensor, lse_rows: Tensor,
                     new_k: Optional[Tensor], new_v: Optional[Tensor], new_pos: Optional[Tensor], sm_scale: float,
                     layer: int) -> None:
    _owner(bufs)._start_async(layer, bufs, cand, cand_valid, new_k, new_v, new_pos, rerank=(q_rows, lse_rows, sm_scale))


@_rerank_start_op.register_fake
def _(bufs, cand, cand_valid, q_rows, lse_rows, new_k, new_v, new_pos, sm_scale, layer):
    return None


@torch.library.custom_op("specache::fetch_wait", mutates_args=("bufs",))
def _fetch_wait_op(bufs: list[Tensor], layer: int) -> None:
    _owner(bufs)._wait_async(layer)


@_fetch_wait_op.register_fake
def _(bufs, layer):
    return None


@torch.library.custom_op("specache::fetch_join", mutates_args=("bufs",))
def _fetch_join_op(bufs: list[Tensor]) -> None:
    _owner(bufs)._join_async()


@_fetch_join_op.register_fake
def _(bufs):
    return None


def keep_sink_rows(bufs: list[Tensor], k: Tensor, v: Tensor, first: Tensor, n: int) -> None:
    """Where `first` (0-d bool: the first block was just quantized), copy the first n rows of
    k, v [B,H,>=n,D] into ring slots [0, n) and mark them valid. bufs: [ring_k, ring_v, fetch_valid]."""
    ring_k, ring_v, valid = bufs
    for ring, x in ((ring_k, k), (ring_v, v)):
        ring[:, :, :n] = torch.where(first, x[:, :, :n].to(ring.dtype), ring[:, :, :n])
    valid[:, :, :n] |= first


# A graph that wrote the ring itself would hand the transfer ops a functionalized copy of it
# (the ring check refuses that), so on the async path this write is an op too.
@torch.library.custom_op("specache::keep_sinks", mutates_args=("bufs",))
def _keep_sinks_op(bufs: list[Tensor], k: Tensor, v: Tensor, first: Tensor, n: int) -> None:
    keep_sink_rows(bufs, k, v, first, n)


@_keep_sinks_op.register_fake
def _(bufs, k, v, first, n):
    return None


# =============================================================================================
# the prefetcher
# =============================================================================================
class Prefetcher:
    def __init__(self, n_layers, batch, n_kv_heads, max_seq_len, head_dim, k, dtype, device, impl="uva",
                 join_each_step=True, async_ops=None, key_rows=None, select_rows=None):
        if impl not in ("uva", "staged"):
            raise ValueError(f"unknown fetch impl {impl!r} (uva, staged)")
        device = torch.device(device)
        self.device, self.impl, self.k, self.join_each_step = device, impl, k, join_each_step
        self.key_rows = k if key_rows is None else key_rows  # keys read per layer and kv head (re-ranking: N*k candidates)
        self.select_rows = select_rows  # re-ranking: (query heads, tokens) of the selecting query, staged per layer
        self.n_layers = n_layers
        self.on_cuda = device.type == "cuda"
        self.async_ops = self.on_cuda if async_ops is None else async_ops
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        host = dict(dtype=dtype, device="cpu", pin_memory=True) if self.on_cuda else dict(dtype=dtype, device=device)
        self.host_k, self.host_v = torch.zeros(shape, **host), torch.zeros(shape, **host)
        self.rings = [None] * n_layers  # [ring_k, ring_v, ...]: what the side stream writes, per layer
        self.ring_offs = [0] * n_layers  # per layer: the ring slots before it hold rows the cache keeps (sinks)
        self.rerank_scratch = None  # re-ranking's device scratch (CUDA), one for all layers: they run in turn
        if self.on_cuda and select_rows is not None:
            self.rerank_scratch = rerank_scratch(batch, n_kv_heads, self.key_rows, head_dim, dtype, device)
        if self.async_ops:
            self._setup_async()

    def _setup_async(self):
        """Side stream, events and the staging buffers the side stream reads."""
        L, B, H, _, D = self.host_k.shape
        dt, dev = self.host_k.dtype, self.device
        self.stage_idx = torch.zeros(L, B, H, self.k, dtype=torch.int64, device=dev)
        self.stage_k = torch.zeros(L, B, H, 1, D, dtype=dt, device=dev)
        self.stage_v = torch.zeros(L, B, H, 1, D, dtype=dt, device=dev)
        self.stage_pos = torch.zeros(L, dtype=torch.int64, device=dev)
        if self.select_rows is not None:  # re-ranking on the side stream: the candidates and who scores them
            Hq, R = self.select_rows
            self.stage_cand = torch.zeros(L, B, H, self.key_rows, dtype=torch.int64, device=dev)
            self.stage_cand_valid = torch.zeros(L, B, H, self.key_rows, dtype=torch.bool, device=dev)
            self.stage_q = torch.zeros(L, B, Hq, R, D, dtype=dt, device=dev)
            self.stage_lse = torch.zeros(L, B, Hq, R, dtype=torch.float32, device=dev)
        self.dm = torch.get_device_module(dev.type)
        self.side = self.dm.Stream(device=dev) if self.on_cuda else self.dm.Stream()
        self.consumed = [self.dm.Event() for _ in range(L)]
        self.fetched = [self.dm.Event() for _ in range(L)]
        if self.impl == "staged" and self.on_cuda:
            self.staging_k = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)
            self.staging_v = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)

    def new_ring(self, layer, sinks=0) -> list[Tensor]:
        """Layer `layer`'s ring, registered: [ring_k, ring_v [B, Hkv, sinks + k, D], fetch_idx, fetch_valid
        [B, Hkv, sinks + k]]. Slots [0, sinks) hold the rows the cache keeps itself (positions 0..sinks-1,
        valid once quantized: keep_sinks); the rest receive fetched rows (none valid yet)."""
        _, B, H, _, D = self.host_k.shape
        n, dev = sinks + self.k, self.device
        idx = torch.arange(n, device=dev).clamp(max=sinks).expand(B, H, n).contiguous()
        bufs = [torch.zeros(B, H, n, D, dtype=self.host_k.dtype, device=dev) for _ in range(2)]
        bufs += [idx, torch.zeros(B, H, n, dtype=torch.bool, device=dev)]
        self.register_ring(layer, bufs[0], bufs[1], off=sinks, index_bufs=bufs[2:])
        return bufs

    def register_ring(self, layer, ring_k, ring_v, off=0, index_bufs=()):
        """The layer's ring: slots [off, off + k) receive the fetched rows (before off: rows the
        cache keeps on the device itself, attention sinks). index_bufs = (fetch_idx, fetch_valid):
        which positions the slots hold, recorded by the transfer (re-ranking: by the side stream)."""
        self.rings[layer] = [ring_k, ring_v, *index_bufs]
        self.ring_offs[layer] = off
        _BY_RING[ring_k.data_ptr()] = self

    # ---- accounting ----------------------------------------------------------------------------
    def host_bytes_per_layer(self) -> int:
        return (self.host_k.nbytes + self.host_v.nbytes) // self.host_k.shape[0]

    def bytes_per_step(self) -> int:
        """Bytes one decode step may move host -> device, every layer and kv head: k rows of K and V
        (re-ranking: key_rows candidate keys and k values). An upper bound: rows the ring already
        holds are not moved again (transfer.record_rows; how many: tools/probe.py's `reuse`)."""
        return sum(bufs[0][:, :, :1].nbytes * (self.key_rows + self.k) for bufs in self.rings if bufs is not None)

    # ---- prefill: Algorithm 1's offload (eager) --------------------------------------------------
    def offload(self, layer, k, v, input_pos):
        """Copy a prefill chunk's fp K/V [B,Hkv,T,D] to host positions input_pos (contiguous)."""
        p0, T = int(input_pos[0]), k.shape[2]
        self.host_k[layer, :, :, p0:p0 + T].copy_(k, non_blocking=self.on_cuda)
        self.host_v[layer, :, :, p0:p0 + T].copy_(v, non_blocking=self.on_cuda)

    def host_prefix(self, layer, p0):
        """fp K/V of positions [0, p0) on the device, for a later prefill chunk's exact attention."""
        return (self.host_k[layer, :, :, :p0].to(self.device, non_blocking=True),
                self.host_v[layer, :, :, :p0].to(self.device, non_blocking=True))

    def host_keys(self, layer):
        """All host keys of a layer on the device (oracle fetch and the fetch probe only)."""
        return self.host_k[layer].to(self.device, non_blocking=True)

    def host_values(self, layer):
        return self.host_v[layer].to(self.device, non_blocking=True)

    # ---- decode ----------------------------------------------------------------------------------
    def start(self, layer, bufs, idx=None, valid=None, new_k=None, new_v=None, new_pos=None, rerank_by=None):
        """Write the real token's K/V [B,Hkv,1,D] to host row new_pos (a 0-d device tensor) and fetch
        host rows idx [B,Hkv,k] into the ring, asynchronously on the async path. bufs: the layer's
        registered [ring_k, ring_v] or [ring_k, ring_v, fetch_idx, fetch_valid]; with the latter, idx
        and valid (real rows) are recorded there (record_rows; on the async path by the main stream's
        staging launch, so the compiled step has no copy kernels of its own for them). rerank_by =
        (q_rows [B,H,R,D], lse_rows [B,H,R], sm_scale): idx are re-ranking's candidates [B,Hkv,N*k], and
        the k whose fp keys score best for those query rows are fetched and recorded (topk.rerank_rows)."""
        if self.async_ops and rerank_by is not None:
            q_rows, lse_rows, sm_scale = rerank_by
            torch.ops.specache.rerank_start(bufs, idx, valid, q_rows, lse_rows, new_k, new_v, new_pos, float(sm_scale),
                                            layer)
        elif self.async_ops:
            torch.ops.specache.fetch_start(bufs, idx, valid, new_k, new_v, new_pos, layer)
        elif rerank_by is not None:
            self._rerank(layer, bufs, idx, valid, *rerank_by, new_k, new_v, new_pos)
        else:
            record = self._record(layer, bufs, idx, valid)
            rows = record_rows(idx, *record) if record is not None else idx
            self._transfer(layer, bufs[0], bufs[1], rows, new_k, new_v, new_pos)

    def _record(self, layer, bufs, idx, valid):
        """record_rows' arguments after idx, or None when there is nothing to record."""
        return (valid, *bufs[2:], self.ring_offs[layer]) if idx is not None and len(bufs) > 2 else None

    def start_rerank(self, layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k=None, new_v=None,
                     new_pos=None):
        """`start` with rerank_by = (q_rows, lse_rows, sm_scale) for the candidates cand (cand_valid: real ones)."""
        self.start(layer, bufs, cand, cand_valid, new_k, new_v, new_pos, rerank_by=(q_rows, lse_rows, sm_scale))

    def wait(self, layer, bufs, now=False):
        """The main stream waits for this layer's fetch only (bufs: what it writes, see register_ring):
        on the async path without step joins, or always with `now` (a fetch the same step needs)."""
        if self.async_ops and (now or not self.join_each_step):
            torch.ops.specache.fetch_wait(bufs, layer)

    def keep_sinks(self, bufs, k, v, first, n):
        """The attention sinks' fp rows into the ring's first n slots (keep_sink_rows)."""
        if self.async_ops:
            torch.ops.specache.keep_sinks(bufs, k, v, first, n)
        else:
            keep_sink_rows(bufs, k, v, first, n)

    def end_step(self):
        """Called by the last layer: join the side stream (see the module docstring)."""
        if self.async_ops and self.join_each_step:
            torch.ops.specache.fetch_join([t for bufs in self.rings for t in bufs])

    def _append_host(self, layer, k, v, pos):
        # CPU, compiled: index_put_ on the whole store, not on the view host_k[layer]: a mutated
        # view of a graph input makes functionalization copy the entire base every step.
        B, H = k.shape[:2]
        index = (torch.tensor(layer, device=k.device), torch.arange(B, device=k.device)[:, None],
                 torch.arange(H, device=k.device)[None, :], pos.reshape(()))
        self.host_k.index_put_(index, k[:, :, 0])
        self.host_v.index_put_(index, v[:, :, 0])

    def _rerank(self, layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k, new_v, new_pos):
        """Re-ranking and its transfer, on the current stream (the side stream on the async path)."""
        if not self.on_cuda and new_k is not None:  # (the Triton kernel writes the token itself)
            self._append_host(layer, new_k, new_v, new_pos)
            new_k = new_v = new_pos = None
        rerank_rows(self.host_k[layer], self.host_v[layer], *bufs, cand, cand_valid, q_rows, lse_rows, sm_scale,
                    new_k, new_v, new_pos, self.ring_offs[layer], scratch=self.rerank_scratch)

    def _transfer(self, layer, ring_k, ring_v, idx, new_k, new_v, new_pos):
        """The transfer itself, on the current stream (re-ranking's, `_rerank`, reads over UVA with
        either impl)."""
        if not self.on_cuda:
            if new_k is not None:
                self._append_host(layer, new_k, new_v, new_pos)
            if idx is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, idx, None, None, None,
                                  self.ring_offs[layer])
        elif self.impl == "uva":
            transfer_rows(self.host_k[layer], self.host_v[layer], ring_k, ring_v, idx, new_k, new_v, new_pos,
                          self.ring_offs[layer])
        else:  # staged: indices to the host (one sync: eager only), gather, one non_blocking copy
            if new_k is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, None, new_k, new_v, new_pos)
            if idx is not None:  # (slots with idx -1 keep their row)
                idx_host = idx.to("cpu")
                pairs = ((self.host_k, self.staging_k, ring_k), (self.host_v, self.staging_v, ring_v))
                for host, staging, ring in pairs:
                    torch.gather(host[layer], 2, idx_host.clamp(min=0)[..., None].expand_as(staging), out=staging)
                    slots = ring[:, :, self.ring_offs[layer]:]
                    slots.copy_(torch.where(idx[..., None] >= 0, staging.to(ring.device, non_blocking=True), slots))

    # ---- the async path (run by the custom ops) ----------------------------------------------------
    def _check_ring(self, layer, bufs):
        mine = self.rings[layer]
        if mine is None or [t.data_ptr() for t in bufs] != [t.data_ptr() for t in mine[:len(bufs)]]:
            raise RuntimeError(f"fetch for layer {layer} was handed a copy of its ring, not the ring buffer itself "
                               "(a compiled graph must pass module buffers through unchanged): the side stream "
                               "would write memory the graph frees")

    def _main(self):
        return self.dm.current_stream(self.device) if self.on_cuda else self.dm.current_stream()

    def _run_side(self, layer, work):
        """work() on the side stream, after the main stream's staging (consumed[layer])."""
        self.consumed[layer].record(self._main())
        self.side.wait_event(self.consumed[layer])  # the layer's buffers are free, staging is written
        with self.dm.stream(self.side):
            work()
            self.fetched[layer].record(self.side)

    def _start_async(self, layer, bufs, idx, valid, new_k, new_v, new_pos, rerank=None):
        """`start` on the async path (its custom ops): the inputs staged on the main stream in one launch
        (they may be temporaries the graph reuses right after), then the transfer, or re-ranking
        (rerank = (q_rows, lse_rows, sm_scale); idx: its candidates), on the side stream."""
        self._check_ring(layer, bufs)
        s_idx, s_new = self.stage_idx[layer], (self.stage_k[layer], self.stage_v[layer], self.stage_pos[layer])
        s_rerank = (self.stage_cand[layer], self.stage_cand_valid[layer], self.stage_q[layer],
                    self.stage_lse[layer]) if rerank is not None else None
        if rerank is not None:
            stage(None, new_k, new_v, new_pos, s_idx, *s_new, (idx, valid, *rerank[:2]), s_rerank)
        elif idx is not None or new_k is not None:
            stage(idx, new_k, new_v, new_pos, s_idx, *s_new, record=self._record(layer, bufs, idx, valid))
        s_new = s_new if new_k is not None else (None, None, None)
        if rerank is not None:
            self._run_side(layer, lambda: self._rerank(layer, bufs, *s_rerank, rerank[2], *s_new))
        else:
            s_idx = s_idx if idx is not None else None
            self._run_side(layer, lambda: self._transfer(layer, bufs[0], bufs[1], s_idx, *s_new))

    def _wait_async(self, layer):
        self._main().wait_event(self.fetched[layer])

    def _join_async(self):
        self._main().wait_stream(self.side)
