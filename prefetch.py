"""Moving fp16 KV between host memory and the device (specache.txt §3.3, Figure 3).

`Prefetcher` owns the host store, host_k/host_v [L, B, Hkv, S, D]: every real token's full-precision
K/V, pinned on CUDA so the device can read it directly, and each layer's ring (`new_ring`): the
fetched rows ring_k/ring_v [B, Hkv, sinks + k, D] and which positions they hold, fetch_idx/fetch_valid.
The layer's SpeCache module registers them as its buffers, so a compiled step sees them as static
inputs (a CUDA graph replays on fixed addresses).

One transfer per layer and step, `start(layer, bufs, pick, new_k, new_v, new_pos)` (bufs: the layer's
ring and its fetch_idx/fetch_valid): write the step's real token to the host store and gather the rows
`pick` names into the ring (transfer_rows_ref below; gpu/transfer.py on CUDA); rows the ring already holds
stay in their slots and do not cross the bus again (record_rows). `pick` is a kernels.Selection (the
speculative path: the top-k of the logits the attention kernel wrote), a kernels.Picked (rows chosen
already: the oracle) or None (the token only). With re-ranking (name part rrN) the picked rows are
low-bit candidates and the k of them whose fp keys score best are fetched (rerank_rows_ref), on the side
stream.

On CUDA, from the selection to the ring, every function the rows pass through, launches included
(8 in 3 files):
  main stream: Prefetcher.start -> _select_fetch_op (the custom op) -> Prefetcher._start_async
               -> gpu.topk.select_triton -> its _select_kernel: ONE launch picks the rows, lays them out
               in the ring (fetch_idx/fetch_valid), writes the slot map (slot_rows: the host row each
               ring slot receives, -1 = keeps its row) and stages the token's K/V; record consumed[l]
  side stream: wait consumed[l] -> Prefetcher._transfer -> gpu.transfer.transfer_rows_triton
               -> its _transfer_rows_kernel (it reads pinned host memory through unified virtual
               addressing, so the indices never leave the device and nothing syncs); record fetched[l]
With re-ranking the side stream runs gpu.transfer.rerank_rows_triton's three launches instead.
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

from kernels import Picked, Selection, as_rows, fp_row_scores, select_ref

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
@torch.library.custom_op("specache::select_fetch", mutates_args=("bufs",))
def _select_fetch_op(bufs: list[Tensor], logits: Tensor, lse: Tensor, n_quant: Tensor, k: int, first: int,
                     row_start: Optional[Tensor], q_rows: Optional[Tensor], sm_scale: float, new_k: Optional[Tensor],
                     new_v: Optional[Tensor], new_pos: Optional[Tensor], layer: int) -> None:
    rerank = (q_rows, lse, sm_scale) if q_rows is not None else None
    _owner(bufs)._start_async(layer, bufs, Selection(logits, lse, n_quant, k, first, rerank, row_start), new_k, new_v,
                              new_pos)


@_select_fetch_op.register_fake
def _(bufs, logits, lse, n_quant, k, first, row_start, q_rows, sm_scale, new_k, new_v, new_pos, layer):
    return None


@torch.library.custom_op("specache::fetch_start", mutates_args=("bufs",))
def _fetch_start_op(bufs: list[Tensor], idx: Optional[Tensor], valid: Optional[Tensor], q_rows: Optional[Tensor],
                    lse_rows: Optional[Tensor], sm_scale: float, new_k: Optional[Tensor], new_v: Optional[Tensor],
                    new_pos: Optional[Tensor], layer: int) -> None:
    rerank = (q_rows, lse_rows, sm_scale) if q_rows is not None else None
    pick = Picked(idx, valid, rerank) if idx is not None else None
    _owner(bufs)._start_async(layer, bufs, pick, new_k, new_v, new_pos)


@_fetch_start_op.register_fake
def _(bufs, idx, valid, q_rows, lse_rows, sm_scale, new_k, new_v, new_pos, layer):
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


# A graph that wrote the ring itself would hand the transfer ops a functionalized copy of it
# (the ring check refuses that), so on the async path this write is an op too.
@torch.library.custom_op("specache::keep_sinks", mutates_args=("bufs",))
def _keep_sinks_op(bufs: list[Tensor], k: Tensor, v: Tensor, row0: Tensor, n: int, row_start: Tensor) -> None:
    if _owner(bufs).triton:
        from gpu.transfer import keep_sinks_triton
        keep_sinks_triton(bufs, k, v, row0, n, row_start)
    else:
        keep_sink_rows(bufs, k, v, row0, n, row_start)


@_keep_sinks_op.register_fake
def _(bufs, k, v, row0, n, row_start):
    return None


# =============================================================================================
# the prefetcher
# =============================================================================================
class Prefetcher:
    def __init__(self, n_layers, batch, n_kv_heads, max_seq_len, head_dim, k, dtype, device, impl="uva",
                 join_each_step=True, async_ops=None, key_rows=None, select_rows=None, query_heads=None, row_start=None):
        if impl not in ("uva", "staged"):
            raise ValueError(f"unknown fetch impl {impl!r} (uva, staged)")
        device = torch.device(device)
        self.device, self.impl, self.k, self.join_each_step = device, impl, k, join_each_step
        self.key_rows = k if key_rows is None else key_rows  # keys read per layer and kv head (re-ranking: N*k candidates)
        self.select_rows = select_rows  # re-ranking: (query heads, tokens) of the selecting query, staged per layer
        self.query_heads = query_heads or n_kv_heads  # the model's (the selection reads G = query / kv heads rows)
        self.n_layers = n_layers
        # [B] each row's first real slot (the caches' tensor: cache.register_row_start): where its sinks are
        self.row_start = row_start if row_start is not None else torch.zeros(batch, dtype=torch.int64, device=device)
        # [B] the rows whose ring a fetch leaves as it is (a resync's pre-decoding: the rows that guessed right)
        self.keep_rows = torch.zeros(batch, dtype=torch.bool, device=device)
        self.on_cuda = device.type == "cuda"
        self.async_ops = self.on_cuda if async_ops is None else async_ops
        self.triton = self.on_cuda  # the selection's and the transfers' Triton kernels (True on CPU: interpreted, tests)
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        host = dict(dtype=dtype, device="cpu", pin_memory=True) if self.on_cuda else dict(dtype=dtype, device=device)
        self.host_k, self.host_v = torch.zeros(shape, **host), torch.zeros(shape, **host)
        self.rings = [None] * n_layers  # [ring_k, ring_v, ...]: what the side stream writes, per layer
        self.ring_offs = [0] * n_layers  # per layer: the ring slots before it hold rows the cache keeps (sinks)
        self.rerank_scratch = None  # re-ranking's device scratch (CUDA), one for all layers: they run in turn
        self.select_counters = None  # the one-launch selection's counters (CUDA)
        if self.async_ops:
            self._setup_async()

    def _setup_async(self):
        """Side stream, events and the staging buffers the side stream reads."""
        L, B, H, _, D = self.host_k.shape
        dt, dev = self.host_k.dtype, self.device
        if self.triton:
            from gpu.topk import select_counters
            from gpu.transfer import rerank_scratch

            # the selection's ticket counters and fault counts, made here so that no graph owns them; the layers'
            # selections run in turn on the step's stream and share them
            self.select_counters = select_counters(B, H, dev)
            if self.on_cuda and self.select_rows is not None:
                self.rerank_scratch = rerank_scratch(B, H, self.key_rows, D, dt, dev)
        self.slot_rows = torch.zeros(L, B, H, self.k, dtype=torch.int64, device=dev)  # host row per ring slot, -1 keeps
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
        # high priority: the transfer's few blocks start as soon as an SM frees, not behind a GEMM's queued wave
        self.side = self.dm.Stream(device=dev, priority=-1) if self.on_cuda else self.dm.Stream()
        self.consumed = [self.dm.Event() for _ in range(L)]
        self.fetched = [self.dm.Event() for _ in range(L)]
        if self.impl == "staged" and self.on_cuda:
            self.staging_k = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)
            self.staging_v = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)

    def new_ring(self, layer, sinks=0) -> list[Tensor]:
        """Layer `layer`'s ring, registered: [ring_k, ring_v [B, Hkv, sinks + k, D], fetch_idx, fetch_valid
        [B, Hkv, sinks + k]]. Slots [0, sinks) hold the rows the cache keeps itself (each row's first sinks real
        positions, row_start + 0..sinks-1, valid once quantized: keep_sinks); the rest receive fetched rows
        (none valid yet)."""
        _, B, H, _, D = self.host_k.shape
        n, dev = sinks + self.k, self.device
        idx = (torch.arange(n, device=dev).clamp(max=sinks) + self.row_start[:, None, None]).expand(B, H, n).contiguous()
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

    def bytes_per_step(self, deployed: bool = False) -> int:
        """Bytes one decode step may move host -> device, every layer and kv head: k rows of K and V
        (re-ranking: key_rows candidate keys and k values). An upper bound: rows the ring already
        holds are not moved again (record_rows; how many: tools/probe.py's `reuse`).
        deployed: in a 16-bit deployment (2 bytes an element) rather than as this run holds them."""
        row = lambda ring: ring[:, :, :1].numel() * 2 if deployed else ring[:, :, :1].nbytes
        return sum(row(bufs[0]) * (self.key_rows + self.k) for bufs in self.rings if bufs is not None)

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

    # ---- decode ----------------------------------------------------------------------------------
    def start(self, layer, bufs, pick=None, new_k=None, new_v=None, new_pos=None):
        """Write the real token's K/V [B,Hkv,1,D] to host row new_pos (a 0-d device tensor) and fetch the
        rows `pick` names into the layer's ring, asynchronously on the async path. bufs: the layer's
        registered [ring_k, ring_v] or [ring_k, ring_v, fetch_idx, fetch_valid]; with the latter the rows
        are recorded there (record_rows: a row the ring holds stays in its slot and is not copied again).
        pick: a kernels.Selection (the top-k of the attention's logits: the speculative path; on the async
        path one launch selects, lays the ring out and stages the transfer's inputs), a kernels.Picked (rows
        chosen already: the oracle), or None (the token only). With `rerank` the picked rows are
        candidates, and the k whose fp keys score best for its query rows are fetched (rerank_rows_ref)."""
        if self.async_ops and isinstance(pick, Selection):
            q_rows, _, sm_scale = pick.rerank or (None, None, 0.0)
            torch.ops.specache.select_fetch(bufs, pick.logits, pick.lse, pick.n_quant, pick.k, pick.first, pick.row_start,
                                            q_rows, float(sm_scale), new_k, new_v, new_pos, layer)
        elif self.async_ops:
            idx, valid, rerank = pick or (None, None, None)
            q_rows, lse_rows, sm_scale = rerank or (None, None, 0.0)
            torch.ops.specache.fetch_start(bufs, idx, valid, q_rows, lse_rows, float(sm_scale), new_k, new_v,
                                           new_pos, layer)
        elif pick is None:
            self._transfer(layer, bufs[0], bufs[1], None, new_k, new_v, new_pos)
        else:
            idx, valid = select_ref(*pick[:5], row_start=pick.row_start) if isinstance(pick, Selection) else pick[:2]
            idx, valid = self._held(layer, bufs, idx, valid)
            if pick.rerank is not None:
                self._rerank(layer, bufs, idx, valid, *pick.rerank, new_k, new_v, new_pos)
            else:
                record = self._record(layer, bufs, valid)
                rows = record_rows(idx, *record) if record is not None else idx
                self._transfer(layer, bufs[0], bufs[1], rows, new_k, new_v, new_pos)

    def _held(self, layer, bufs, idx, valid):
        """The selection with the keep_rows rows replaced by what their ring holds (held_selection)."""
        if len(bufs) < 4:
            return idx, valid
        return held_selection(idx, valid, bufs[2], bufs[3], self.ring_offs[layer], self.keep_rows)

    def _record(self, layer, bufs, valid):
        """record_rows' arguments after idx, or None when the ring keeps no record (bufs without index buffers)."""
        return (valid, *bufs[2:], self.ring_offs[layer]) if len(bufs) > 2 else None

    def wait(self, layer, bufs, now=False):
        """The main stream waits for this layer's fetch only (bufs: what it writes, see register_ring):
        on the async path without step joins, or always with `now` (a fetch the same step needs)."""
        if self.async_ops and (now or not self.join_each_step):
            torch.ops.specache.fetch_wait(bufs, layer)

    def keep_sinks(self, bufs, k, v, row0, n):
        """The attention sinks' fp rows (each row's first n real tokens) of a block just quantized into slots
        [row0, ...) into the ring's first n slots (keep_sink_rows)."""
        if self.async_ops:
            torch.ops.specache.keep_sinks(bufs, k, v, row0.reshape(()), n, self.row_start)
        else:
            keep_sink_rows(bufs, k, v, row0, n, self.row_start)

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
        if not self.triton:
            if new_k is not None:  # (the Triton kernels write the token themselves)
                self._append_host(layer, new_k, new_v, new_pos)
            rerank_rows_ref(self.host_k[layer], self.host_v[layer], *bufs, cand, cand_valid, q_rows, lse_rows, sm_scale,
                            ring_off=self.ring_offs[layer])
        else:
            from gpu.transfer import rerank_rows_triton
            rerank_rows_triton(self.host_k[layer], self.host_v[layer], *bufs, cand, cand_valid, q_rows, lse_rows,
                               sm_scale, new_k, new_v, new_pos, self.ring_offs[layer], scratch=self.rerank_scratch)

    def _transfer(self, layer, ring_k, ring_v, slot_rows, new_k, new_v, new_pos):
        """The transfer itself, on the current stream (re-ranking's, `_rerank`, reads over UVA with
        either impl)."""
        if not self.triton:
            if new_k is not None:
                self._append_host(layer, new_k, new_v, new_pos)
            if slot_rows is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, slot_rows, None, None, None,
                                  self.ring_offs[layer])
        elif self.impl == "uva":
            from gpu.transfer import transfer_rows_triton
            transfer_rows_triton(self.host_k[layer], self.host_v[layer], ring_k, ring_v, slot_rows, new_k, new_v, new_pos,
                                 self.ring_offs[layer])
        else:  # staged: indices to the host (one sync: eager only), gather, one non_blocking copy
            if new_k is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, None, new_k, new_v, new_pos)
            if slot_rows is not None:  # (slots with slot_rows -1 keep their row)
                rows_host = slot_rows.to("cpu")
                pairs = ((self.host_k, self.staging_k, ring_k), (self.host_v, self.staging_v, ring_v))
                for host, staging, ring in pairs:
                    torch.gather(host[layer], 2, rows_host.clamp(min=0)[..., None].expand_as(staging), out=staging)
                    slots = ring[:, :, self.ring_offs[layer]:]
                    slots.copy_(torch.where(slot_rows[..., None] >= 0, staging.to(ring.device, non_blocking=True), slots))

    # ---- the async path (run by the custom ops) ----------------------------------------------------
    def _check_ring(self, layer, bufs):
        mine = self.rings[layer]
        if mine is None or [t.data_ptr() for t in bufs] != [t.data_ptr() for t in mine[:len(bufs)]]:
            raise RuntimeError(f"fetch for layer {layer} was handed a copy of its ring, not the ring buffer itself "
                               "(a compiled graph must pass module buffers through unchanged): the side stream "
                               "would write memory the graph frees")

    def _main(self):
        return self.dm.current_stream(self.device) if self.on_cuda else self.dm.current_stream()

    def _start_async(self, layer, bufs, pick, new_k, new_v, new_pos):
        """`start` on the async path (its custom ops). The main stream stages what the side stream reads, as
        the step's tensors are temporaries the graph reuses right after: a Selection on the Triton path in one
        launch (gpu.topk.select_triton: the top-k, the ring's record, the slot map, the token), else torch's
        copies. Then the side stream, after the staging (consumed[layer]), moves the rows or re-ranks."""
        self._check_ring(layer, bufs)
        staged_new = (self.stage_k[layer], self.stage_v[layer], self.stage_pos[layer]) if new_k is not None else None
        token = (new_k, new_v, new_pos, *staged_new) if staged_new is not None else None
        rerank = pick.rerank if pick is not None else None
        slot_rows = self.slot_rows[layer] if pick is not None and rerank is None else None
        cand = (self.stage_cand[layer], self.stage_cand_valid[layer]) if rerank is not None else None
        cand_q = (self.stage_q[layer], self.stage_lse[layer]) if rerank is not None else None
        if isinstance(pick, Selection) and self.triton:
            record = None if slot_rows is None or len(bufs) < 4 else (bufs[2], bufs[3], self.ring_offs[layer], slot_rows)
            assert cand is not None or record is not None, "a selection without re-ranking needs the ring's record"
            keep = (self.keep_rows, bufs[2], bufs[3], self.ring_offs[layer]) if len(bufs) > 3 else None
            from gpu.topk import select_triton
            select_triton(*pick[:5], out=cand, record=record, stage_q=(rerank[0], *cand_q) if rerank else None,
                          token=token, counters=self.select_counters, row_start=pick.row_start, keep=keep)
        else:
            self._stage_torch(layer, bufs, pick, token, slot_rows, cand, cand_q)
        self.consumed[layer].record(self._main())
        self.side.wait_event(self.consumed[layer])  # the layer's buffers are free, staging is written
        with self.dm.stream(self.side):
            if rerank is not None:
                self._rerank(layer, bufs, *cand, *cand_q, rerank[2], *(staged_new or (None,) * 3))
            else:
                self._transfer(layer, bufs[0], bufs[1], slot_rows, *(staged_new or (None,) * 3))
            self.fetched[layer].record(self.side)

    def _stage_torch(self, layer, bufs, pick, token, slot_rows, cand, cand_q):
        """The staging in torch: the oracle's rows and the token-only writes, and the CPU reference of
        select_triton's (the slot map, or re-ranking's candidates and query rows; the token)."""
        if pick is not None:
            idx, valid = select_ref(*pick[:5], row_start=pick.row_start) if isinstance(pick, Selection) else pick[:2]
            idx, valid = self._held(layer, bufs, idx, valid)
            if cand is not None:
                cand[0].copy_(idx)
                cand[1].copy_(valid)
                cand_q[0].copy_(pick.rerank[0])  # (one selecting token staged for two: broadcast, as the kernel's r % R)
                cand_q[1].copy_(pick.rerank[1])
            else:
                record = self._record(layer, bufs, valid)
                slot_rows.copy_(record_rows(idx, *record) if record is not None else idx)
        if token is not None:
            for dst, src in zip(token[3:], (token[0], token[1], token[2].reshape(()))):
                dst.copy_(src)

    def _wait_async(self, layer):
        self._main().wait_event(self.fetched[layer])

    def _join_async(self):
        self._main().wait_stream(self.side)


# =============================================================================================
# the rows' moves in torch: the CPU path, and the references of gpu/transfer.py's kernels
# =============================================================================================
def record_rows(idx, valid, fetch_idx, fetch_valid, off):
    """Which positions the ring's slots [off, ..) will hold (fetch_idx/fetch_valid [B,Hkv,off+k], which
    say what they hold now) for the selection idx/valid [B,Hkv,k]: a selected row the ring already
    holds keeps its slot; the others take the freed slots in order. -> the host row to copy into
    each slot, -1 for none (consecutive steps' selections overlap: only the new rows cross the bus)."""
    old, old_ok = fetch_idx[:, :, off:], fetch_valid[:, :, off:]
    same = (old[..., :, None] == idx[..., None, :]) & old_ok[..., :, None] & valid[..., None, :]  # [slot, row]
    keep, miss = same.any(-1), valid & ~same.any(-2)
    free = ~keep
    put = free[..., :, None] & miss[..., None, :] & \
        ((free.cumsum(-1) - free.long())[..., :, None] == (miss.cumsum(-1) - miss.long())[..., None, :])
    got = put.any(-1)
    row = torch.where(put, idx[..., None, :], 0).sum(-1)
    fetch_idx[:, :, off:] = torch.where(keep, old, torch.where(got, row, 0))
    fetch_valid[:, :, off:] = keep | got
    return torch.where(got, row, -1)


def held_selection(idx, valid, fetch_idx, fetch_valid, off, keep):
    """(idx, valid) [B,Hkv,C] with the batch rows `keep` [B] bool replaced by what their ring's slots [off, ..)
    hold now (then invalid entries), so that record_rows, or re-ranking's layout, leaves their ring as it is:
    a resync's pre-decoding fetches again only for the rows whose speculative token was wrong."""
    cur_i, cur_v = fetch_idx[:, :, off:], fetch_valid[:, :, off:]
    n = min(idx.shape[-1], cur_i.shape[-1])
    held_i = torch.cat([cur_i[..., :n], idx.new_zeros(*idx.shape[:2], idx.shape[-1] - n)], -1)
    held_v = torch.cat([cur_v[..., :n], valid.new_zeros(*valid.shape[:2], valid.shape[-1] - n)], -1)
    k = keep[:, None, None]
    return torch.where(k, held_i, idx), torch.where(k, held_v, valid)


def transfer_rows_ref(host_k, host_v, ring_k, ring_v, slot_rows, new_k, new_v, new_pos, ring_off=0):
    """host_* [B,Hkv,S,D] (one layer), ring_* [B,Hkv,ring_off + k,D], slot_rows [B,Hkv,k] or None, new_*
    [B,Hkv,1,D] or None, new_pos 0-d. In place: host[.., new_pos] = new; ring[.., ring_off:] = host[.., slot_rows]
    where slot_rows >= 0 (-1: the slot keeps its row; ring slots before ring_off hold rows kept on the
    device: attention sinks)."""
    if new_k is not None:
        pos = new_pos.reshape(1).to(host_k.device)
        host_k.index_copy_(2, pos, new_k.to(host_k.device, host_k.dtype))
        host_v.index_copy_(2, pos, new_v.to(host_v.device, host_v.dtype))
    if slot_rows is not None:
        B, Hkv, S, D = host_k.shape
        slot_rows = slot_rows.to(host_k.device)
        flat = (slot_rows.clamp(min=0) + torch.arange(B * Hkv, device=host_k.device).reshape(B, Hkv, 1) * S).flatten()
        for host, ring in ((host_k, ring_k), (host_v, ring_v)):
            rows = torch.index_select(host.reshape(-1, D), 0, flat).view(B, Hkv, -1, D).to(ring.dtype)
            slots = ring[:, :, ring_off:] if ring_off else ring
            slots.copy_(torch.where(slot_rows[..., None] >= 0, rows, slots))


def keep_sink_rows(bufs, k, v, row0, n: int, row_start) -> None:
    """A block k, v [B,H,nb,D] was just quantized into slots [row0, row0 + nb) (row0 a 0-d tensor): each row's
    first n real tokens (slots row_start[b] + i, [B] int64) that lie in it are copied into ring slots [0, n) and
    marked valid. bufs: [ring_k, ring_v, fetch_valid]."""
    ring_k, ring_v, valid = bufs
    rel = row_start[:, None] + torch.arange(n, device=k.device) - row0  # [B, n]: each sink's row of the block
    inside = (rel >= 0) & (rel < k.shape[2])
    at = rel.clamp(0, k.shape[2] - 1)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    for ring, x in ((ring_k, k), (ring_v, v)):
        ring[:, :, :n] = torch.where(inside[:, None, :, None], x.gather(2, at).to(ring.dtype), ring[:, :, :n])
    valid[:, :, :n] |= inside[:, None, :]


# =============================================================================================
# re-ranking: the k best of N*k candidates by their fp keys, read from the host (side stream)
# =============================================================================================
# Of the selecting token's low-bit top-(N*k) candidates (name part rrN), the k whose fp keys score best
# go to the ring, with their positions: three launches on the side stream (prefetch.py) where the
# candidates' keys land. One program per candidate reads its fp key and scores it; one per kv head
# ranks the candidates and lays the winners out (record_rows: rows the ring holds stay); one per
def rerank_exact(q_row, lse_row, keys, valid, k, sm_scale):
    """The k best of C candidates by their fp keys [B,Hkv,C,D] (valid [B,Hkv,C]), scored as topk_lowbit
    scores (probability summed over the kv head's query heads, best of R tokens) -> (score, index
    into the C candidates) [B,Hkv,k]; invalid candidates score -1."""
    prob = fp_row_scores(*as_rows(q_row, lse_row), keys, sm_scale)
    return torch.where(valid, prob, -1.0).topk(k, dim=-1)


def rerank_rows_ref(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                    sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0):
    """Of the candidate host rows cand [B,Hkv,C] (cand_valid: real ones), keep the K = ring slots - ring_off
    whose fp keys score best for the query rows q_rows [B,H,R,D] (lse_rows [B,H,R]; the score of
    rerank_exact); lay them out in ring slots [ring_off, ...) as record_rows does (a row the
    ring holds keeps its slot, the others, best first, take the freed slots), write the keys and
    values of the rows the ring lacks, their positions and validity (score >= 0) to
    fetch_idx/fetch_valid, and the real token (new_*) to host row new_pos, whose candidate copy is
    taken from new_k/new_v."""
    C = cand.shape[2]
    keys = host_k.gather(2, cand[..., None].expand(*cand.shape, host_k.shape[-1]))
    if new_k is not None:
        keys = torch.where((cand == new_pos)[..., None], new_k.to(keys.dtype), keys)
    score, pick = rerank_exact(q_rows, lse_rows, keys, cand_valid, min(ring_k.shape[2] - ring_off, C), sm_scale)
    rows = record_rows(cand.gather(-1, pick), score >= 0, fetch_idx, fetch_valid, ring_off)
    transfer_rows_ref(host_k, host_v, ring_k, ring_v, rows, new_k, new_v, new_pos, ring_off)
