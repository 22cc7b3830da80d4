"""What the caches hold, in bytes: the one place a 16-bit deployment's bytes are counted (deployed_nbytes), the
device bytes over time (MemoryMeter), and the 16-bit cache every low-bit figure is compared with (kv_fp16_bytes).
cache.py's caches count their own buffers with these; the baselines' caches (baselines/) too."""
from contextlib import contextmanager
from dataclasses import dataclass


def deployed_nbytes(*tensors) -> int:
    """Bytes of the tensors in a 16-bit deployment, whatever dtype this run computes in: a floating-point
    element is 2 bytes (fp32 on CPU stands in for fp16/bf16 on a GPU); codes, positions and counters as stored."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors)


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


def kv_fp16_bytes(args, batch: int, seq_len: int) -> int:
    """What a 16-bit cache of every layer would hold: the reference the low-bit caches are compared with."""
    return 2 * args.n_layers * batch * args.n_kv_heads * seq_len * args.head_dim * 2
