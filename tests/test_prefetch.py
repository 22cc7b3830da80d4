"""prefetch.py: the CPU path, and the CUDA ordering logic run against fake streams whose copies
really are delayed (a worker thread), so a missing wait would read a stale ring."""
import threading
import time

import pytest
import torch

import prefetch
from cache import LowBitCache, SpeCache
from config import CacheConfig
from generate import decode_step
from gpu import topk, transfer
from kernels import Picked
from prefetch import Prefetcher
from tests.helpers import run_generate, setup, tiny_model

needs_interpreter = pytest.mark.skipif(type(transfer._transfer_rows_kernel).__name__ != "InterpretedFunction",
                                       reason="TRITON_INTERPRET=1 was not set before triton was imported")

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
    """Make a CPU prefetcher run its CUDA code path (custom ops, staging, events) against fake
    streams whose transfers really land late: they run on a worker thread after `delay` seconds
    and read the staging buffers only then, as the device would."""
    log = []
    side = FakeSideStream(delay, log)
    L = prefetcher.n_layers
    prefetcher.async_ops, prefetcher.join_each_step = True, join_each_step
    prefetcher._setup_async()
    prefetcher.dm = FakeDeviceModule(FakeMainStream(log))
    prefetcher.side = side
    prefetcher.consumed = [FakeEvent() for _ in range(L)]
    prefetcher.fetched = [FakeEvent(str(layer)) for layer in range(L)]

    def lands_late(work):  # Prefetcher._transfer / _rerank, as the side stream runs them: after `delay`
        def submit(layer, *args, **kw):
            def late():
                time.sleep(delay)
                work(layer, *args, **kw)
                log.append(f"copied {layer}")
            side.submit(late)
        return submit
    prefetcher._transfer, prefetcher._rerank = lands_late(prefetcher._transfer), lands_late(prefetcher._rerank)
    return log


def picked(idx):
    """Rows chosen already, all valid."""
    return Picked(idx, torch.ones_like(idx, dtype=torch.bool))


def make_prefetcher(L=2, B=1, H=2, S=32, D=4, k=3, **kw):
    p = Prefetcher(L, B, H, S, D, k, torch.float32, CPU, **kw)
    p.host_k.copy_(torch.randn_like(p.host_k))
    p.host_v.copy_(torch.randn_like(p.host_v))
    for layer in range(L):
        p.register_ring(layer, torch.zeros(B, H, k, D), torch.zeros(B, H, k, D))
    return p


def test_transfer_writes_the_token_and_gathers_rows():
    """One transfer: the real token's row goes to the host, the ring gets rows idx; a row equal to
    the token's position comes from the token itself."""
    p = make_prefetcher()
    ring_k, ring_v = p.rings[1]
    idx = torch.tensor([[[5, 0, 31], [7, 7, 2]]])
    new_k, new_v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    p.start(1, [ring_k, ring_v], picked(idx), new_k, new_v, torch.tensor(7))
    assert torch.equal(p.host_k[1, :, :, 7], new_k[:, :, 0]) and torch.equal(p.host_v[1, :, :, 7], new_v[:, :, 0])
    assert torch.equal(ring_k[0, 0], p.host_k[1, 0, 0, idx[0, 0]])
    assert torch.equal(ring_k[0, 1, 0], new_k[0, 1, 0]) and torch.equal(ring_v[0, 1, 1], new_v[0, 1, 0])
    assert p.bytes_per_step() == 2 * 2 * (1 * 2 * 3 * 4 * 4)
    assert p.bytes_per_step(deployed=True) == 2 * 2 * (1 * 2 * 3 * 4 * 2)  # 16-bit elements


@needs_interpreter
@pytest.mark.parametrize("with_idx,with_new,programs", [(True, True, 16), (True, False, 16), (False, True, 16),
                                                      (True, True, 2)])
def test_triton_transfer_matches_reference(with_idx, with_new, programs):
    """The persistent grid: 48 slots in 3 tiles of 16 over 6 programs (one per kv head's token row),
    or 2 programs looping over the tiles and the token rows. Slots with idx -1 keep their rows."""
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(2, 3, 64, 40, generator=g) for _ in range(2)]
    idx = torch.randint(0, 64, (2, 3, 8), generator=g) if with_idx else None
    if with_idx:
        idx[1, 2, 5] = 17  # the new token's own row
        idx[0, 1, 2:4] = -1  # slots that keep their row
    new = [torch.randn(2, 3, 1, 40, generator=g) for _ in range(2)] if with_new else [None, None]
    pos = torch.tensor(17) if with_new else None
    ring = [torch.randn(2, 3, 8, 40, generator=g) for _ in range(2)]
    ref = [[h.clone() for h in host], [r.clone() for r in ring]]
    tri = [[h.clone() for h in host], [r.clone() for r in ring]]
    prefetch.transfer_rows_ref(*ref[0], *ref[1], idx, *new, pos)
    transfer.transfer_rows_triton(*tri[0], *tri[1], idx, *new, pos, programs=programs)
    for a, b in zip(ref[0] + ref[1], tri[0] + tri[1]):
        assert torch.equal(a, b)
    if with_idx:
        assert torch.equal(ref[1][0][0, 1, 2:4], ring[0][0, 1, 2:4])


@needs_interpreter
@pytest.mark.parametrize("row0,starts", [(0, [0, 0]), (64, [0, 0]), (32, [30, 60])])
def test_the_sinks_launch_is_keep_sink_rows(row0, starts):
    """The attention sinks' rows into the ring's first slots (one launch a step; it writes a row's sinks from the
    block that holds its first real tokens: the first block without padding; a left-padded row's sinks may
    straddle two blocks), from a strided slice of the residual, as the torch reference does."""
    g = torch.Generator().manual_seed(0)
    res_k, res_v = torch.randn(2, 3, 34, 40, generator=g), torch.randn(2, 3, 34, 40, generator=g)
    bufs = [torch.randn(2, 3, 12, 40, generator=g), torch.randn(2, 3, 12, 40, generator=g),
            torch.rand(2, 3, 12, generator=g) > 0.5]
    want, before = [t.clone() for t in bufs], [t.clone() for t in bufs]
    row0, starts = torch.tensor(row0), torch.tensor(starts)
    prefetch.keep_sink_rows(want, res_k[:, :, :32], res_v[:, :, :32], row0, 4, starts)
    transfer.keep_sinks_triton(bufs, res_k[:, :, :32], res_v[:, :, :32], row0, 4, starts)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))
    for b in range(2):  # sink i of row b: slot starts[b] + i, row starts[b] + i - row0 of the block when it is in it
        for i in range(4):
            rel = int(starts[b]) + i - int(row0)
            if 0 <= rel < 32:
                assert torch.equal(bufs[0][b, :, i], res_k[b, :, rel]) and bufs[2][b, :, i].all()
            else:
                assert torch.equal(bufs[0][b, :, i], before[0][b, :, i]) and torch.equal(bufs[2][b, :, i], before[2][b, :, i])


def test_record_rows_keeps_held_rows_in_place():
    """A selection the ring partly holds: those rows keep their slots, only the others are copied,
    into the freed slots; the ring then holds exactly the selection's valid rows."""
    fetch_idx = torch.tensor([[[9, 9, 5, 3, 8, 1, 7]]])  # slots 0-1: sinks (not touched)
    fetch_valid = torch.tensor([[[True, True, True, True, False, True, True]]])
    idx = torch.tensor([[[7, 2, 8, 5, 4]]])  # 7 and 5 are held; 8 sits in a slot marked invalid
    valid = torch.tensor([[[True, True, True, True, False]]])
    rows = prefetch.record_rows(idx, valid, fetch_idx, fetch_valid, 2)
    assert rows.tolist() == [[[-1, 2, 8, -1, -1]]]  # slot 2 (5) and 6 (7) kept; 2 and 8 into slots 3 and 4
    assert fetch_idx.tolist() == [[[9, 9, 5, 2, 8, 0, 7]]]
    assert fetch_valid.tolist() == [[[True, True, True, True, True, False, True]]]
    again = prefetch.record_rows(idx, valid, fetch_idx, fetch_valid, 2)  # the same selection: nothing to copy
    assert (again == -1).all() and fetch_idx.tolist() == [[[9, 9, 5, 2, 8, 0, 7]]]


def make_rerank_prefetcher(C=5, k=2, sinks=1, **kw):
    """2 layers, 1 x 2 kv heads, 4 query heads, 32 rows of D 4: k of C candidates, after `sinks` ring slots."""
    p = make_prefetcher(k=k, key_rows=C, select_rows=(4, 1), **kw)
    for layer in range(2):  # rings with `sinks` slots before the fetched rows, and re-ranking's buffers
        ring = [torch.zeros(1, 2, sinks + k, 4) for _ in range(2)]
        p.register_ring(layer, *ring, off=sinks, index_bufs=(torch.full((1, 2, sinks + k), -1),
                                                             torch.zeros(1, 2, sinks + k, dtype=torch.bool)))
    return p


def test_rerank_transfer_keeps_the_best_candidates():
    """Re-ranking's transfer: it reads the candidates' fp keys (the step's own token from new_k,
    its host row not yet written), keeps the k with the best exact scores (summed over the kv
    head's query heads), writes their keys, positions and validity, moves only their values, and
    writes the token to the host. Slots before the offset (sinks) are left alone."""
    torch.manual_seed(0)
    p = make_rerank_prefetcher()
    bufs = p.rings[1]
    ring_k, ring_v, fetch_idx, fetch_valid = bufs
    cand = torch.tensor([[[5, 0, 31, 9, 7], [7, 3, 2, 11, 12]]])
    valid = torch.tensor([[[True, True, True, True, True], [True, True, True, False, False]]])
    q, lse = torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1).abs() + 3
    new_k, new_v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    p.start(1, bufs, Picked(cand, valid, (q, lse, 0.5)), new_k, new_v, torch.tensor(7))
    keys = p.host_k[1, 0].clone()  # [Hkv, S, D], the token's row now written
    assert torch.equal(keys[:, 7], new_k[0, :, 0]) and torch.equal(p.host_v[1, 0, :, 7], new_v[0, :, 0])
    for h in range(2):
        prob = torch.exp(0.5 * q[0, 2 * h:2 * h + 2, 0] @ keys[h, cand[0, h]].T - lse[0, 2 * h:2 * h + 2]).sum(0)
        prob = torch.where(valid[0, h], prob, -1.0)
        want = cand[0, h, prob.topk(2).indices]
        assert set(fetch_idx[0, h, 1:].tolist()) == set(want.tolist()) and fetch_valid[0, h, 1:].all()
        assert torch.equal(ring_k[0, h, 1:], keys[h, fetch_idx[0, h, 1:]])
        assert torch.equal(ring_v[0, h, 1:], p.host_v[1, 0, h, fetch_idx[0, h, 1:]])
    assert fetch_idx[0, :, 0].eq(-1).all() and not fetch_valid[0, :, 0].any() and ring_k[0, :, 0].eq(0).all()
    assert make_prefetcher(key_rows=6).bytes_per_step() == 2 * (1 * 2 * 1 * 4 * 4) * (6 + 3)  # 2 layers


def test_rerank_on_the_side_stream_lands_late_and_reads_staged_inputs():
    """On the async path the whole re-ranking runs on the side stream: nothing it writes changes
    before it lands, and the caller may overwrite its inputs at once (they were staged)."""
    torch.manual_seed(0)
    ref, p = make_rerank_prefetcher(), make_rerank_prefetcher()
    p.host_k.copy_(ref.host_k)
    p.host_v.copy_(ref.host_v)
    log = fake_async(p, delay=0.05)
    cand = torch.tensor([[[5, 0, 31, 9, 7], [7, 3, 2, 11, 12]]])
    args = [cand, torch.ones(1, 2, 5, dtype=torch.bool), torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1).abs() + 3]
    ref.start(0, ref.rings[0], Picked(args[0], args[1], (args[2], args[3], 0.5)))
    mine = [a.clone() for a in args]
    p.start(0, p.rings[0], Picked(mine[0], mine[1], (mine[2], mine[3], 0.5)))
    before = [t.clone() for t in p.rings[0]]
    for a in mine:
        a.zero_()
    p.wait(0, p.rings[0])
    assert log == ["copied 0", "waited 0"]
    assert all(torch.equal(a, b) for a, b in zip(before, make_rerank_prefetcher().rings[0]))  # nothing landed early
    assert all(torch.equal(a, b) for a, b in zip(p.rings[0], ref.rings[0]))
    with pytest.raises(RuntimeError, match="copy of its ring"):
        p.start(0, [t.clone() for t in p.rings[0]], Picked(args[0], args[1], (args[2], args[3], 0.5)))


def test_the_gpu_rerank_refuses_more_candidates_than_its_rank_tile():
    """rerank x k above RERANK_MAX_CANDIDATES would be ranked in one tile that ptxas takes minutes on:
    a clear error when the scratch is made (the Prefetcher makes it at set-up on CUDA)."""
    transfer.rerank_scratch(1, 2, transfer.RERANK_MAX_CANDIDATES, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="re-ranking 512 candidates a kv head.*at most 256"):
        transfer.rerank_scratch(1, 2, 512, 16, torch.float32, "cpu")


def test_square_tiles_get_warps_by_their_size():
    """One warp up to the paper's k 64 (unchanged launches), then about 64 elements a thread, at most 32
    warps: a 512 x 512 tile on one warp kept ptxas busy for minutes."""
    assert [transfer.square_tile_warps(b) for b in (16, 64, 128, 256, 512, 1024)] == [1, 1, 8, 32, 32, 32]


@needs_interpreter
@pytest.mark.parametrize("with_new,R,off", [(True, 1, 4), (False, 2, 0)])
def test_triton_rerank_matches_reference(with_new, R, off):
    """The re-ranking kernels (per candidate: its key and score into the scratch; per kv head: the
    ranks and the winners' slots; per candidate: a winner's key and value) against the torch
    reference: same rows in the same slots, the same positions and validity, the token written to
    the host; one kv head with 6 valid candidates for 8 slots, one candidate the token. Then a
    second step over a ring that holds some of the winners: they keep their slots in both."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S, D, C, K = 2, 3, 3, 64, 40, 16, 8
    host = [torch.randn(B, Hkv, S, D, generator=g) for _ in range(2)]
    cand = torch.stack([torch.randperm(S, generator=g)[:C] for _ in range(B * Hkv)]).view(B, Hkv, C)
    cand[1, 2, 5] = 17
    valid = torch.ones(B, Hkv, C, dtype=torch.bool)
    valid[0, 1, 6:] = False
    cand[0, 1, 6:] = 0  # as topk_lowbit leaves them
    q, lse = torch.randn(B, Hkv * G, R, D, generator=g), torch.rand(B, Hkv * G, R, generator=g) + 3
    new = [torch.randn(B, Hkv, 1, D, generator=g) for _ in range(2)] if with_new else [None, None]
    pos = torch.tensor(17) if with_new else None
    if with_new:  # the token's candidate wins its kv head: its key and value must come from new_k/new_v
        new[0][1, 2, 0] = 3 * q[1, 2 * G, 0]
    outs = []
    for fn in (prefetch.rerank_rows_ref, transfer.rerank_rows_triton):
        hk, hv = (h.clone() for h in host)
        bufs = [torch.zeros(B, Hkv, off + K, D), torch.zeros(B, Hkv, off + K, D),
                torch.full((B, Hkv, off + K), -1), torch.zeros(B, Hkv, off + K, dtype=torch.bool)]
        fn(hk, hv, *bufs, cand, valid, q, lse, 0.2, *new, pos, ring_off=off)
        outs.append((hk, hv, *bufs))
    (rk, rv, ref_k, ref_v, ref_idx, ref_ok), (tk, tv, tri_k, tri_v, tri_idx, tri_ok) = outs
    assert torch.equal(rk, tk) and torch.equal(rv, tv)
    assert torch.equal(ref_ok, tri_ok) and int(ref_ok.sum()) == B * Hkv * K - 2
    assert torch.equal(ref_idx[ref_ok], tri_idx[tri_ok]) and (tri_idx[:, :, :off] == -1).all()
    assert torch.equal(ref_k[ref_ok], tri_k[tri_ok]) and torch.equal(ref_v[ref_ok], tri_v[tri_ok])
    assert (tri_idx[:, :, off:] >= 0).all()  # every slot written: tied (invalid) candidates take distinct ranks
    if with_new:
        assert torch.equal(tk[:, :, 17], new[0][:, :, 0])
        assert tri_idx[1, 2, off] == 17 and torch.equal(tri_v[1, 2, off], new[1][1, 2, 0])
    else:  # a second step whose candidates the ring partly holds: held winners keep their slots
        first = [t.clone() for t in outs[0]]
        cand2 = torch.where(torch.arange(C) % 2 == 0, cand.roll(1, -1), (cand + 1) % S)
        q2 = q + 0.5 * torch.randn(q.shape, generator=g)
        for fn, (hk, hv, *bufs) in zip((prefetch.rerank_rows_ref, transfer.rerank_rows_triton), outs):
            fn(hk, hv, *bufs, cand2, valid, q2, lse, 0.2, ring_off=off)
        assert torch.equal(ref_ok, tri_ok) and torch.equal(ref_idx, tri_idx)
        assert torch.equal(ref_k[ref_ok], tri_k[tri_ok]) and torch.equal(ref_v[ref_ok], tri_v[tri_ok])
        kept = (ref_idx == first[4]) & ref_ok & first[5]
        assert kept[:, :, off:].any() and not kept[:, :, off:].all()


@needs_interpreter
def test_one_selecting_token_staged_for_two_then_reranked():
    """The union policy with re-ranking stages its query rows for two selecting tokens per head; its
    pre-decoding has one (T1). The selection launch writes that token into both rows, as the CPU path's
    broadcasting copy does, and the re-ranking that reads the staged buffer picks the rows the one
    token's own scores pick (the best of two equal rows is the row)."""
    g = torch.Generator().manual_seed(4)
    B, Hkv, G, S, D, C, K = 1, 2, 3, 48, 40, 12, 6
    q1, lse1 = torch.randn(B, Hkv * G, 1, D, generator=g), torch.rand(B, Hkv * G, 1, generator=g) + 3
    logits = torch.randn(B, Hkv, G, S, generator=g)
    s_q, s_lse = torch.full((B, Hkv * G, 2, D), 7.0), torch.full((B, Hkv * G, 2), 7.0)  # stale rows of an earlier step
    cand = (torch.zeros(B, Hkv, C, dtype=torch.long), torch.zeros(B, Hkv, C, dtype=torch.bool))
    topk.select_triton(logits, lse1, torch.tensor(S), C, out=cand, stage_q=(q1, s_q, s_lse))
    assert torch.equal(s_q[:, :, 0], q1[:, :, 0]) and torch.equal(s_q[:, :, 1], q1[:, :, 0])
    host = [torch.randn(B, Hkv, S, D, generator=g) for _ in range(2)]
    picked_rows = []
    for q_rows, lse_rows, fn in ((s_q, s_lse, transfer.rerank_rows_triton), (q1, lse1, prefetch.rerank_rows_ref)):
        bufs = [torch.zeros(B, Hkv, K, D), torch.zeros(B, Hkv, K, D), torch.full((B, Hkv, K), -1),
                torch.zeros(B, Hkv, K, dtype=torch.bool)]
        fn(*host, *bufs, *cand, q_rows, lse_rows, 0.2)
        picked_rows.append(bufs)
    for a, b in zip(*picked_rows):
        assert torch.equal(a, b)


def test_wait_blocks_until_the_delayed_copy_landed():
    p = make_prefetcher()
    log = fake_async(p, delay=0.05)
    ring_k, ring_v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    p.register_ring(0, ring_k, ring_v)
    idx = torch.tensor([[[1, 2, 3], [4, 5, 6]]])
    p.start(0, [ring_k, ring_v], picked(idx))
    idx.fill_(0)  # the caller's tensor may change right away: the transfer reads the staged copy
    assert not torch.equal(ring_k[0, 0, 0], p.host_k[0, 0, 0, 1])  # still in flight
    p.wait(0, [ring_k, ring_v])
    assert log == ["copied 0", "waited 0"]
    assert torch.equal(ring_k[0, 1, 2], p.host_k[0, 0, 1, 6])


def test_a_copy_of_the_ring_is_refused():
    """If functionalization handed the op a temporary instead of the module's ring, the side stream
    would write memory the graph frees: the op refuses."""
    p = make_prefetcher(async_ops=True)
    ring_k, ring_v = p.rings[0]
    with pytest.raises(RuntimeError, match="copy of its ring"):
        p.start(0, [ring_k.clone(), ring_v], picked(torch.zeros(1, 2, 3, dtype=torch.long)))


def generate_with_late_fetches(new_tokens, join_each_step, step_fn=None, rerank=1, sinks=0, custom_ops=False):
    """A tiny SpeCache generation twice: synchronous CPU fetches, then every fetch landing late on
    fake streams (with custom_ops, the CUDA step's graph: attention and top-k are opaque ops too).
    Returns (reference tokens, tokens, the fake streams' log)."""
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    kw = dict(batch=1, max_seq_len=128, bits=1, group=16, residual=32, k=8, rerank=rerank, sinks=sinks)
    caches = setup(model, "specache", **kw)
    for c in caches:
        c.custom_ops = custom_ops
    ref, _ = run_generate(model, prompt, new_tokens, caches.config)
    caches = setup(model, "specache", **kw)
    for c in caches:
        c.custom_ops = custom_ops
    log = fake_async(caches.prefetcher, delay=0.002, join_each_step=join_each_step)
    got, _ = run_generate(model, prompt, new_tokens, caches.config, step_fn=step_fn)
    return ref, got, log


@needs_interpreter
@pytest.mark.parametrize("fetch,rerank,sinks,prompt_len", [("speculative", 1, 0, 90),
                                                           pytest.param("resync", 2, 4, 90, marks=pytest.mark.full),
                                                           ("union", 1, 4, 20)])  # (full: make test-full)
def test_the_gpu_path_interpreted_gives_the_reference_tokens(fetch, rerank, sinks, prompt_len):
    """The CUDA step's code path, eager, on CPU: the attention writing the selecting rows' logits, the one-launch
    selection with the ring's record and the staging, the transfer (or re-ranking) kernels, the sinks' launch,
    all through their custom ops and interpreted, on torch.cpu's no-op streams: the torch reference path's
    tokens (a 20-token prompt: the first block, and the sinks with it, are quantized during decoding)."""
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    kw = dict(batch=1, max_seq_len=128, bits=1, group=16, residual=32, k=8, rerank=rerank, sinks=sinks, fetch=fetch)
    ref, _ = run_generate(model, prompt, 16, setup(model, "specache", **kw).config)
    caches = setup(model, "specache", **kw)
    for c in caches:
        c.custom_ops = True
    p = caches.prefetcher
    p.async_ops, p.triton = True, True
    p._setup_async()
    got, _ = run_generate(model, prompt, 16, caches.config)
    assert torch.equal(got, ref)


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


@pytest.mark.parametrize("rerank", [1, 2])
def test_joined_steps_match_synchronous(rerank):
    """The CUDA-graph schedule: the last layer joins the side stream, so every step ends with all
    its fetches landed (the log shows each step's copies before its join). Re-ranking: the keys
    written by the main stream and the values landing late still pair up."""
    ref, got, log = generate_with_late_fetches(12, join_each_step=True, rerank=rerank)
    assert torch.equal(got, ref)
    assert log.count("joined") == 12 and not any(e.startswith("waited") for e in log)
    steps = "|".join(log).split("joined")[:-1]
    assert all(s.strip("|").split("|") == ["copied 0", "copied 1"] for s in steps), log


@needs_interpreter
# Minutes of interpreted Triton each: CI's `make test-full` runs the three (make test stays within
# ten minutes; test_fresh_caches_do_not_recompile_the_async_step traces the async step there, fullgraph).
@pytest.mark.full
@pytest.mark.parametrize("rerank,sinks", [(1, 0), (1, 4), (2, 4)])
def test_compiled_step_on_the_async_path_with_late_fetches(rerank, sinks):
    """The CUDA-graph schedule compiled by inductor (fullgraph), with the custom ops and fetches
    that land late: the ops get the rings themselves (checked in the op), nothing is reordered
    around them, and the tokens equal the synchronous eager path's (H100 findings: the compiled
    SpeCache step left tensors in the cudagraph pool; with sinks, the graph's own write of the sink
    rows made it hand the transfer a copy of the ring)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(decode_step, fullgraph=True)
    ref, got, log = generate_with_late_fetches(12, join_each_step=True, step_fn=step, rerank=rerank, sinks=sinks,
                                               custom_ops=True)
    assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] == 1
    assert log.count("joined") >= 11


def test_compression_ratio_at_8k():
    """docs/design.md's table: bytes per layer of SmolLM2-sized caches at 8k context, 16-bit state."""
    dims = (1, 3, 8192, 64, torch.float16, CPU)
    fp16 = 2 * 8192 * 3 * 64 * 2
    kivi = LowBitCache(*dims, CacheConfig("kivi", bits=1, group=64, residual=128)).device_bytes()
    assert kivi == 698_896 and round(kivi / fp16, 3) == 0.111
    assert LowBitCache(*dims, CacheConfig("kivi", bits=1, group=64, residual=64)).device_bytes() == 645_136
    spec = SpeCache(0, Prefetcher(1, 1, 3, 8192, 64, 64, torch.float16, CPU), *dims,
                    CacheConfig("specache", bits=1, group=64, residual=64, k=64)).device_bytes()
    assert spec == 696_016 and round(spec / fp16, 3) == 0.111  # no replaced mask or hit counters kept


def test_unknown_fetch_impl():
    with pytest.raises(ValueError, match="unknown fetch impl"):
        Prefetcher(1, 1, 1, 8, 4, 2, torch.float32, CPU, impl="rdma")


def test_fresh_caches_do_not_recompile_the_async_step():
    """An evaluation builds new caches (a new Prefetcher) for every prompt: the compiled async step
    (the CUDA path's custom ops) must serve them all. An op that named its Prefetcher by an id baked
    a new constant into every new graph: one compile per prompt."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    prompt = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    step = torch.compile(decode_step, fullgraph=True, backend="eager")
    for _ in range(3):
        caches = setup(model, "specache", batch=1, max_seq_len=128, bits=1, group=16, residual=32, k=8)
        fake_async(caches.prefetcher, delay=0.0, join_each_step=True)
        run_generate(model, prompt, 6, caches.config, step_fn=step)
    assert counters["stats"]["unique_graphs"] == 1
