"""prefetch.py: the CPU path, and the CUDA ordering logic run against fake streams whose copies
really are delayed (a worker thread), so a missing wait would read a stale ring."""
import threading
import time

import pytest
import torch

from cache import LowBitCache, SpeCache
from generate import generate, setup_caches
from prefetch import Prefetcher
from tests.helpers import tiny_model

CPU = torch.device("cpu")


class FakeEvent:
    def __init__(self, name=""):
        self.name = name
        self.done = threading.Event()
        self.done.set()  # a never-recorded event counts as complete, as on CUDA

    def record(self, stream):
        self.done.clear()
        stream.submit(self.done.set)


class FakeSideStream:
    """Runs submitted work in order on a worker thread, each item after `delay` seconds."""

    def __init__(self, delay, log):
        self.delay, self.log, self.queue = delay, log, []
        self.cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, fn):
        with self.cv:
            self.queue.append(fn)
            self.cv.notify()

    def wait_event(self, event):
        self.submit(event.done.wait)

    def _run(self):
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                fn = self.queue.pop(0)
            fn()

    def synchronize(self):
        done = threading.Event()
        self.submit(done.set)
        done.wait()


class FakeMainStream:
    """The host thread itself: waiting on an event blocks until the side stream sets it."""

    def __init__(self, log):
        self.log = log

    def submit(self, fn):  # work "on" the main stream is done by the time the host moves on
        fn()

    def wait_event(self, event):
        event.done.wait()
        self.log.append(f"waited {event.name}")

    def wait_stream(self, stream):
        stream.synchronize()
        self.log.append("joined")


class FakeDeviceModule:
    def __init__(self, main):
        self.main = main

    def current_stream(self, device=None):
        return self.main

    def stream(self, s):
        import contextlib
        return contextlib.nullcontext()


def fake_async(prefetcher: Prefetcher, delay=0.02, join_each_step=False):
    """Turn a CPU prefetcher into one that runs its CUDA code path against fake streams."""
    log = []
    side = FakeSideStream(delay, log)
    L = prefetcher.ring_k.shape[0]
    prefetcher.on_cuda = True
    prefetcher.join_each_step = join_each_step
    prefetcher.dm = FakeDeviceModule(FakeMainStream(log))
    prefetcher.side = side
    prefetcher.consumed = [FakeEvent() for _ in range(L)]
    prefetcher.fetched = [FakeEvent(str(layer)) for layer in range(L)]
    copy = Prefetcher.copy_rows.__get__(prefetcher)

    def delayed_copy(layer, idx):
        idx = idx.clone()  # what the device would read when the copy runs

        def work():
            time.sleep(delay)
            copy(layer, idx)
            log.append(f"copied {layer}")
        side.submit(work)
    prefetcher.copy_rows = delayed_copy
    # the custom ops are for the compiled CUDA graph; the fake streams are plain Python
    prefetcher.start = prefetcher._start_async
    prefetcher.wait = lambda layer: None if prefetcher.join_each_step else prefetcher._wait_async(layer)
    prefetcher.end_step = lambda: prefetcher._join_async() if prefetcher.join_each_step else None
    return log


def make_prefetcher(L=2, B=1, H=2, S=32, D=4, k=3):
    p = Prefetcher(L, B, H, S, D, k, torch.float32, CPU)
    p.host_k.copy_(torch.randn_like(p.host_k))
    p.host_v.copy_(torch.randn_like(p.host_v))
    return p


def test_cpu_fetch_gathers_rows():
    p = make_prefetcher()
    idx = torch.tensor([[[5, 0, 31], [7, 7, 2]]])
    p.start(1, idx)
    p.wait(1)
    ring_k, ring_v = p.ring(1)
    assert torch.equal(ring_k, torch.stack([p.host_k[1, 0, h, idx[0, h]] for h in range(2)])[None])
    assert torch.equal(ring_v[0, 1, 0], p.host_v[1, 0, 1, 7])
    assert p.bytes_per_step() == 2 * 2 * 1 * 2 * 3 * 4 * 4


def test_wait_blocks_until_the_delayed_copy_landed():
    p = make_prefetcher()
    log = fake_async(p, delay=0.05)
    idx = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    p.start(0, idx)
    assert not torch.equal(p.ring_k[0, 0, 0, 0], p.host_k[0, 0, 0, 1])  # still in flight
    p.wait(0)
    assert log == ["copied 0", "waited 0"]
    assert torch.equal(p.ring_k[0, 0, 1, 2], p.host_k[0, 0, 1, 6])


def generate_with_late_fetches(new_tokens, join_each_step):
    """A tiny SpeCache generation twice: synchronous CPU fetches, then every fetch landing late on
    fake streams. Returns (reference tokens, tokens, the fake streams' log)."""
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    kw = dict(batch=1, max_seq_len=128, bits=1, group=16, residual=32, k=8)
    setup_caches(model, "specache", **kw)
    ref, _ = generate(model, prompt, new_tokens, speculative=True)
    _, prefetcher, _ = setup_caches(model, "specache", **kw)
    log = fake_async(prefetcher, delay=0.002, join_each_step=join_each_step)
    got, _ = generate(model, prompt, new_tokens, speculative=True)
    return ref, got, log


def test_decode_with_delayed_fetches_matches_synchronous():
    """Per-layer waits (eager CUDA schedule): layer l's attention must wait for fetch l, so the
    tokens equal those of the synchronous CPU path."""
    ref, got, log = generate_with_late_fetches(20, join_each_step=False)
    assert torch.equal(got, ref)
    # The n-th wait of layer l comes after its (n-1)-th copy landed (the first wait, in
    # pre-decoding, has nothing to wait for).
    for layer in ("0", "1"):
        copies = waits = 0
        for entry in log:
            copies += entry == f"copied {layer}"
            if entry == f"waited {layer}":
                assert copies >= waits, log
                waits += 1
        assert waits == 20 and copies >= 19


def test_joined_steps_match_synchronous():
    """The CUDA-graph schedule: the last layer joins the side stream, so every step ends with all
    its fetches landed (the log shows each step's copies before its join)."""
    ref, got, log = generate_with_late_fetches(12, join_each_step=True)
    assert torch.equal(got, ref)
    assert log.count("joined") == 12 and not any(e.startswith("waited") for e in log)
    steps = "|".join(log).split("joined")[:-1]
    assert all(s.strip("|").split("|") == ["copied 0", "copied 1"] for s in steps), log


def test_compression_ratio_at_8k():
    """The README's table: bytes per layer of SmolLM2-sized caches at 8k context, 16-bit state."""
    dims = (1, 3, 8192, 64, torch.float16, CPU)
    fp16 = 2 * 8192 * 3 * 64 * 2
    kivi = LowBitCache(*dims, bits=1, group=64, residual=128).device_bytes()
    assert kivi == 698_896 and round(kivi / fp16, 3) == 0.111
    assert LowBitCache(*dims, bits=1, group=64, residual=64).device_bytes() == 645_136
    spec = SpeCache(0, Prefetcher(1, 1, 3, 8192, 64, 64, torch.float16, CPU), *dims, bits=1, group=64,
                    residual=64, k=64).device_bytes()
    assert spec == 720_808 and round(spec / fp16, 3) == 0.115


def test_unknown_fetch_impl():
    with pytest.raises(ValueError, match="unknown fetch impl"):
        Prefetcher(1, 1, 1, 8, 4, 2, torch.float32, CPU, impl="rdma")
