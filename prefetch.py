"""Moving fp16 KV between host memory and the device (specache.txt §3.3, Figure 3).

`Prefetcher` owns
  host_k/host_v [L, B, Hkv, S, D]  the full-precision KV cache of every layer, in host memory
                                   (pinned on CUDA so copies are asynchronous DMA);
  ring_k/ring_v [L, B, Hkv, k, D]  on the device: the k fetched rows per layer and kv head;
  a side stream and two events per layer: `consumed[l]` (the main stream is done reading ring l
  and has produced the next top-k indices) and `fetched[l]` (the side stream has filled ring l).

Fetch for layer l = `start(l, idx)`: the side stream waits for `consumed[l]`, gathers rows `idx`
of host layer l straight into ring l, and records `fetched[l]`; the copy overlaps layers
l+1..L-1 of the current step. A CUDA graph must join every stream it forks before its capture
ends, so by default (`join_each_step`) the last layer's `end_step()` makes the main stream wait for
the side stream, and `wait(l)` has nothing left to do. Without graphs (`join_each_step=False`),
`wait(l)` makes the main stream of the next step wait for `fetched[l]` only, which also lets the
copies overlap sampling and the first layers of the next step.

How rows cross the bus (CUDA): the indices are produced on the device and stay there. A Triton
gather (kernels.gather_rows) reads the pinned host rows directly through unified virtual
addressing, so the step needs no device-to-host sync; the cost is PCIe read transactions of one
row (D*2 bytes) each, which are fine for k=64 rows of 128 bytes. `impl="staged"` is the portable
alternative: copy the indices to the host (one sync per layer), gather into a pinned staging
buffer, and copy it with `non_blocking=True` on the side stream.

On CPU there is no bus: host and device memory are one, the streams and events of
`torch.get_device_module("cpu")` are no-ops, and a fetch is a plain gather, which also makes
the whole decode step traceable by torch.compile.
"""
import itertools
import weakref

import torch

import kernels

_PREFETCHERS = weakref.WeakValueDictionary()  # id -> Prefetcher, so the custom ops below can find their streams and events
_ids = itertools.count()


# Stream and event calls are opaque to torch.compile: on CUDA, start/wait run as custom ops that
# "mutate" the ring, which keeps them ordered against the attention that reads it inside one
# fullgraph (and CUDA-graph-captured: the side stream forks and joins through events) step.
@torch.library.custom_op("specache::fetch_start", mutates_args=("ring_k", "ring_v"))
def _fetch_start_op(ring_k: torch.Tensor, ring_v: torch.Tensor, idx: torch.Tensor, pid: int, layer: int) -> None:
    _PREFETCHERS[pid]._start_async(layer, idx)


@torch.library.custom_op("specache::fetch_wait", mutates_args=("ring_k", "ring_v"))
def _fetch_wait_op(ring_k: torch.Tensor, ring_v: torch.Tensor, pid: int, layer: int) -> None:
    _PREFETCHERS[pid]._wait_async(layer)


@torch.library.custom_op("specache::fetch_join", mutates_args=("ring_k", "ring_v"))
def _fetch_join_op(ring_k: torch.Tensor, ring_v: torch.Tensor, pid: int) -> None:
    _PREFETCHERS[pid]._join_async()


class Prefetcher:
    def __init__(self, n_layers, batch, n_kv_heads, max_seq_len, head_dim, k, dtype, device, impl="uva",
                 join_each_step=True):
        if impl not in ("uva", "staged"):
            raise ValueError(f"unknown fetch impl {impl!r}")
        self.device, self.impl, self.k, self.join_each_step = device, impl, k, join_each_step
        self.n_layers = n_layers
        self.on_cuda = device.type == "cuda"
        host = dict(dtype=dtype, device="cpu", pin_memory=self.on_cuda)
        if not self.on_cuda:
            host["device"] = device
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        self.host_k, self.host_v = torch.zeros(shape, **host), torch.zeros(shape, **host)
        ring = (n_layers, batch, n_kv_heads, k, head_dim)
        self.ring_k = torch.zeros(ring, dtype=dtype, device=device)
        self.ring_v = torch.zeros(ring, dtype=dtype, device=device)
        self.pid = next(_ids)
        _PREFETCHERS[self.pid] = self
        if self.on_cuda:
            dm = torch.get_device_module(device.type)
            self.dm = dm
            self.side = dm.Stream(device=device)
            self.consumed = [dm.Event() for _ in range(n_layers)]
            self.fetched = [dm.Event() for _ in range(n_layers)]
            if impl == "staged":
                self.staging_k = torch.zeros(ring[1:], dtype=dtype, pin_memory=True)
                self.staging_v = torch.zeros(ring[1:], dtype=dtype, pin_memory=True)

    # ---- accounting ----------------------------------------------------------------------------
    def ring(self, layer):
        return self.ring_k[layer], self.ring_v[layer]

    def host_bytes_per_layer(self) -> int:
        return (self.host_k.nbytes + self.host_v.nbytes) // self.host_k.shape[0]

    def bytes_per_step(self) -> int:
        """Bytes moved host -> device by one decode step: k rows of K and V, every layer and head."""
        return self.ring_k.nbytes + self.ring_v.nbytes

    # ---- prefill: Algorithm 1's offload ------------------------------------------------------------
    def offload(self, layer, k, v, input_pos):
        """Copy a prefill chunk's fp K/V [B,Hkv,T,D] to host positions input_pos (contiguous)."""
        p0, T = int(input_pos[0]), k.shape[2]
        self.host_k[layer, :, :, p0:p0 + T].copy_(k, non_blocking=self.on_cuda)
        self.host_v[layer, :, :, p0:p0 + T].copy_(v, non_blocking=self.on_cuda)

    def host_prefix(self, layer, p0):
        """fp K/V of positions [0, p0) on the device, for a later prefill chunk's exact attention."""
        return (self.host_k[layer, :, :, :p0].to(self.device, non_blocking=True),
                self.host_v[layer, :, :, :p0].to(self.device, non_blocking=True))

    # ---- decode ----------------------------------------------------------------------------------
    def offload_step(self, layer, k, v, pos):
        """Append the real token's fp K/V [B,Hkv,1,D] at position pos (a device tensor)."""
        if self.on_cuda:
            kernels.scatter_rows(self.host_k[layer], pos, k)
            kernels.scatter_rows(self.host_v[layer], pos, v)
            return
        # index_put_ on the whole store, not on the view host_k[layer]: under torch.compile a
        # mutated view of a graph input makes functionalization copy the entire base every step.
        B, H = k.shape[:2]
        index = (torch.tensor(layer, device=k.device), torch.arange(B, device=k.device)[:, None],
                 torch.arange(H, device=k.device)[None, :], pos.reshape(()))
        self.host_k.index_put_(index, k[:, :, 0])
        self.host_v.index_put_(index, v[:, :, 0])

    def start(self, layer, idx):
        """Fetch rows idx [B,Hkv,k] of host layer `layer` into ring[layer] (async on CUDA)."""
        if self.on_cuda:
            torch.ops.specache.fetch_start(self.ring_k[layer], self.ring_v[layer], idx, self.pid, layer)
        else:
            self.copy_rows(layer, idx)

    def wait(self, layer):
        """The main stream waits for this layer's fetch only (no-op on CPU, where start is
        synchronous, and after a joined step)."""
        if self.on_cuda and not self.join_each_step:
            torch.ops.specache.fetch_wait(self.ring_k[layer], self.ring_v[layer], self.pid, layer)

    def end_step(self):
        """Called by the last layer: join the side stream (see the module docstring)."""
        if self.on_cuda and self.join_each_step:
            torch.ops.specache.fetch_join(self.ring_k, self.ring_v, self.pid)

    def _start_async(self, layer, idx):
        self.consumed[layer].record(self.dm.current_stream(self.device))
        self.side.wait_event(self.consumed[layer])  # ring[layer] is free and idx is written
        with self.dm.stream(self.side):
            self.copy_rows(layer, idx)
            self.fetched[layer].record(self.side)

    def copy_rows(self, layer, idx):
        """The transfer itself, issued on the current stream."""
        if self.impl == "uva" or not self.on_cuda:
            kernels.gather_rows(self.host_k[layer], idx, self.ring_k[layer])
            kernels.gather_rows(self.host_v[layer], idx, self.ring_v[layer])
        else:
            idx_host = idx.to("cpu")  # the one sync this path pays (so: eager only, no CUDA graph)
            for host, staging, ring in ((self.host_k, self.staging_k, self.ring_k), (self.host_v, self.staging_v, self.ring_v)):
                torch.gather(host[layer], 2, idx_host[..., None].expand_as(staging), out=staging)
                ring[layer].copy_(staging, non_blocking=True)

    def _wait_async(self, layer):
        self.dm.current_stream(self.device).wait_event(self.fetched[layer])

    def _join_async(self):
        self.dm.current_stream(self.device).wait_stream(self.side)


    # ---- exact reference top-k (oracle fetch, hit-rate instrumentation) ---------------------------
    def exact_topk(self, layer, q_row, n_quant, k, sm_scale):
        """Top-k of quantized positions [0, n_quant) by exact fp attention of q_row [B,H,D],
        probabilities summed over each kv head's query heads (the same reduction as topk_lowbit)."""
        keys = self.host_k[layer].to(q_row.device, non_blocking=True)  # [B,Hkv,S,D]
        B, H, D = q_row.shape
        Hkv, S = keys.shape[1], keys.shape[2]
        qg = q_row.float().view(B, Hkv, H // Hkv, D)
        scores = torch.einsum("bhgd,bhsd->bhgs", qg, keys.float()) * sm_scale
        valid = torch.arange(S, device=q_row.device) < n_quant
        scores = scores.masked_fill(~valid, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).sum(2)  # [B,Hkv,S]
        probs = torch.where(valid, probs, -1.0)
        return torch.topk(probs, k, dim=-1)
