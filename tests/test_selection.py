"""topk.py's one-launch selection (interpreted on CPU): the radix rounds over hand-made scores (ties,
scores that differ only in their lowest bits, fewer candidates than k) pick exactly what select_ref
picks, which is torch.topk's set; the ring layout it writes is prefetch.record_rows'; and the
selections every policy makes in a real generation replay to the same rows."""
import math

import pytest
import torch

import kernels
import prefetch
from gpu import topk
from prefetch import Prefetcher
from tests.helpers import tiny_model
from tests.test_kernels import needs_interpreter
from tests.test_specache import run_policy


def logits_for(kind, n, seed):
    """Selection logits (log2 units) of one kv head with one query head, lse 0: score = 2^logit."""
    g = torch.Generator().manual_seed(seed)
    if kind == "spread":  # probabilities over many binades
        return 8 * torch.log2(torch.rand(n, generator=g))
    if kind == "ties":  # five distinct values: the k-th score ties with hundreds of others
        return torch.tensor([-30.0, -10.0, -2.0, -1.0, 0.0])[torch.randint(0, 5, (n,), generator=g)]
    if kind == "low_bits":  # one binade, the last mantissa bits differ: every round decides
        return torch.randint(0, 512, (n,), generator=g).float() * 2 ** -23 / math.log(2)
    raise ValueError(kind)


@needs_interpreter
@pytest.mark.parametrize("kind", ["spread", "ties", "low_bits"])
@pytest.mark.parametrize("k", [1, 16, 100])
def test_radix_selection_equals_the_reference_and_torch_topk(kind, k):
    """Three kv heads of 512 positions in 8 chunks (8 slices for k 1 and 16): the kernel picks select_ref's rows exactly (ties: the lowest
    positions), in position order; their scores are torch.topk's k values."""
    n = 512
    logits = torch.stack([logits_for(kind, n, seed) for seed in range(3)]).view(1, 3, 1, n)
    lse = torch.zeros(1, 3, 1)
    got = topk.select_triton(logits, lse, torch.tensor(n), k, slice_len=64)
    want = kernels.select_ref(logits, lse, torch.tensor(n), k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[1].all()
    score = kernels.selection_scores(logits, lse)
    torch.testing.assert_close(score.gather(-1, got[0]).sort(-1, descending=True).values, score.topk(k, -1).values,
                               atol=0, rtol=0)
    assert all(len(set(row.tolist())) == k for row in got[0].flatten(0, 1))


@needs_interpreter
@pytest.mark.parametrize("kind", ["ties", "crowded", "spread"])
def test_the_slices_candidates_hold_the_heads_top_k(kind):
    """The launch's slices (8 of 512 positions here) each keep their own top k, and the head's last program
    picks from their union: the same rows as select_ref when the k best crowd into one slice, when the k-th
    score ties across every slice, and in general; the ticket counters are zero again after the launch."""
    n, k = 4096, 100
    assert topk.slices(n, k, 64) == (512, 8)
    if kind == "crowded":  # scores fall with the position: all of the top 100 sit in the first slice
        logits = -torch.arange(n, dtype=torch.float32).view(1, 1, 1, n).repeat(1, 2, 1, 1) / 64
    else:
        logits = torch.stack([logits_for(kind, n, seed) for seed in range(2)]).view(1, 2, 1, n)
    lse = torch.zeros(1, 2, 1)
    counters = topk.select_counters(1, 2, logits.device)
    got = topk.select_triton(logits, lse, torch.tensor(n - 5), k, first=3, counters=counters, slice_len=64)
    want = kernels.select_ref(logits, lse, torch.tensor(n - 5), k, first=3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not counters.any()


@needs_interpreter
def test_slices_past_the_quantized_length_and_a_counter_left_non_zero():
    """n_quant 700 of 4096 positions: 2 of the 8 slices hold candidates and the others only take their ticket,
    after a launch over every slice has left its candidates in memory; the rows are select_ref's. A head whose
    counter an earlier launch left at its slice count never merges, and each of its programs records a fault in
    the counters' second row; the other head is unaffected."""
    n, k = 4096, 100
    logits = torch.stack([logits_for("spread", n, seed) for seed in range(2)]).view(1, 2, 1, n)
    lse = torch.zeros(1, 2, 1)
    for n_quant in (n, 700):
        got = topk.select_triton(logits, lse, torch.tensor(n_quant), k, slice_len=64)
        want = kernels.select_ref(logits, lse, torch.tensor(n_quant), k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    counters = topk.select_counters(1, 2, logits.device)
    counters[0, 1] = 8
    got = topk.select_triton(logits, lse, torch.tensor(n), k, counters=counters, slice_len=64)
    want = kernels.select_ref(logits, lse, torch.tensor(n), k)
    assert torch.equal(got[0][:, 0], want[0][:, 0]) and torch.equal(got[1][:, 0], want[1][:, 0])
    assert counters.tolist() == [[0, 16], [0, 8]]


@needs_interpreter
def test_fewer_candidates_than_k_and_the_sinks():
    """n_quant 40 and first 4: 36 candidates for k 64; the other 28 slots are invalid. Positions below first
    are never valid."""
    logits = logits_for("spread", 256, 0).view(1, 1, 1, 256).repeat(1, 2, 1, 1)
    lse = torch.zeros(1, 2, 1)
    got = topk.select_triton(logits, lse, torch.tensor(40), 64, first=4, slice_len=64)
    want = kernels.select_ref(logits, lse, torch.tensor(40), 64, first=4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].sum(-1).eq(36).all() and set(got[0][got[1]].tolist()) == set(range(4, 40))


@needs_interpreter
@pytest.mark.parametrize("k", [8, 160])
def test_the_ring_layout_is_record_rows(k):
    """Three consecutive selections over one ring (4 sink slots before it): the launch keeps rows the ring
    holds in their slots, puts the new ones into the freed slots in order and gives the transfer -1 for kept
    slots, as prefetch.record_rows does on select_ref's rows; k 160 (not a power of two, above the old
    in-launch limit of 128)."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S = 2, 3, 3, 700
    lse = torch.randn(B, Hkv * G, 1, generator=g).abs() + 5
    base = torch.randn(B, Hkv, G, S, generator=g) * 3
    ring = [torch.full((B, Hkv, 4 + k), -1), torch.zeros(B, Hkv, 4 + k, dtype=torch.bool)]
    want_ring = [t.clone() for t in ring]
    kept = 0
    for step in range(3):
        logits = base + 0.4 * step * torch.randn(base.shape, generator=g)
        idx, valid = kernels.select_ref(logits, lse, torch.tensor(640), k, first=4)
        rows = prefetch.record_rows(idx, valid, *want_ring, 4)
        slot_rows = torch.empty(B, Hkv, k, dtype=torch.long)
        got = topk.select_triton(logits, lse, torch.tensor(640), k, first=4, record=(*ring, 4, slot_rows), slice_len=128)
        assert torch.equal(got[0], idx) and torch.equal(got[1], valid)
        assert torch.equal(slot_rows, rows) and torch.equal(ring[0], want_ring[0]) and torch.equal(ring[1], want_ring[1])
        kept += int((rows == -1).sum())
    assert kept > 0 and (ring[0][:, :, :4] == -1).all()


@needs_interpreter
@pytest.mark.parametrize("R,RS", [(1, 1), (1, 2), (2, 2)])
def test_the_launch_stages_the_token_and_the_query_rows(R, RS):
    """The step's token (a [B,Hkv,1,D] slice of the step's K/V, read through its strides) and, for re-ranking,
    the selecting query rows and their lse (slices of the step's q and lse; one token staged for two as the
    union policy's pre-decoding needs) land in the staging buffers; the candidates in `out`."""
    g = torch.Generator().manual_seed(1)
    B, Hkv, G, T, S, D, C = 2, 3, 3, 2, 256, 40, 12
    step_k, step_v = torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2), torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2)
    q = torch.randn(B, T, Hkv * G, D, generator=g).transpose(1, 2)  # [B,H,T,D] as the model passes it
    lse = torch.randn(B, Hkv * G, T, generator=g) + 4
    logits = torch.randn(B, Hkv, G * R, S, generator=g)
    staged = [torch.zeros(B, Hkv, 1, D), torch.zeros(B, Hkv, 1, D), torch.zeros((), dtype=torch.long)]
    s_q, s_lse = torch.zeros(B, Hkv * G, RS, D), torch.zeros(B, Hkv * G, RS)
    out = (torch.zeros(B, Hkv, C, dtype=torch.long), torch.zeros(B, Hkv, C, dtype=torch.bool))
    token = (step_k[:, :, :1], step_v[:, :, :1], torch.tensor(41), *staged)
    topk.select_triton(logits, lse[:, :, -R:], torch.tensor(200), C, out=out, stage_q=(q[:, :, -R:], s_q, s_lse),
                       token=token, slice_len=64)
    want = kernels.select_ref(logits, lse[:, :, -R:], torch.tensor(200), C)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert torch.equal(staged[0], step_k[:, :, :1]) and torch.equal(staged[1], step_v[:, :, :1]) and int(staged[2]) == 41
    assert torch.equal(s_q, q[:, :, -R:].expand(-1, -1, RS, -1)) and torch.equal(s_lse, lse[:, :, -R:].expand(-1, -1, RS))


# ---- the selections each policy makes ------------------------------------------------------------
SELECTING = [("speculative", 1), ("union", 1), ("resync", 1), ("lag", 1), ("sequential", 1), ("resync", 2)]


@needs_interpreter
@pytest.mark.parametrize("fetch,rerank", SELECTING)
def test_every_selecting_policy_gets_the_reference_rows(monkeypatch, fetch, rerank):
    """Record the selections a short generation hands the prefetcher (selecting rows R, k or re-ranking's N*k
    candidates, sinks as `first`, the logits of the attention that saw the fetched rows) with each layer's
    ring as it was, and replay the last step's through the kernel: the rows and the ring layout of the
    reference."""
    calls = []
    start = Prefetcher.start

    def record(self, layer, bufs, pick=None, *args):
        if isinstance(pick, kernels.Selection):
            calls.append((pick, [t.clone() for t in bufs], self.ring_offs[layer]))
        return start(self, layer, bufs, pick, *args)

    monkeypatch.setattr(Prefetcher, "start", record)
    run_policy(tiny_model(), fetch, new=6, k=8, sinks=4, rerank=rerank)
    for sel, bufs, off in calls[-2:]:  # the tiny model's two layers
        R = 2 if fetch == "union" else 1
        assert sel.lse.shape[2] == R and sel.k == 8 * rerank and sel.first == 4
        want = kernels.select_ref(*sel[:5])
        if sel.rerank is not None:
            got = topk.select_triton(*sel[:5])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            continue
        ring = [t.clone() for t in bufs[2:]]
        rows = prefetch.record_rows(*want, *bufs[2:], off)
        slot_rows = torch.empty_like(rows)
        got = topk.select_triton(*sel[:5], record=(*ring, off, slot_rows))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(slot_rows, rows) and torch.equal(ring[0], bufs[2]) and torch.equal(ring[1], bufs[3])


@needs_interpreter
def test_launches_per_decode_layer():
    """tools/kernel_cost.py --launches on a small model: KIVI's attention is two launches a layer; SpeCache adds the
    selection and the transfer (at most KIVI + 3), the preset re-ranking's three and the sinks' one (at most KIVI + 6),
    and no custom op runs torch kernels of its own beyond the two-token query's copy."""
    from tools import kernel_cost
    counts = {name: kernel_cost.count_launches(name, layers=2, context=200, head_dim=64)
              for name in ("kivi-1bit", "specache-1bit", "specache-1bit-best")}
    kivi, spec, best = (counts[n] for n in ("kivi-1bit", "specache-1bit", "specache-1bit-best"))
    assert kivi["triton"] == {"_attn_combine_kernel": 1.0, "_attn_words_kernel": 1.0}
    assert spec["triton"] == {**kivi["triton"], "_select_kernel": 1.0, "_transfer_rows_kernel": 1.0}
    assert set(best["triton"]) == set(kivi["triton"]) | {"_select_kernel", "_keep_sinks_kernel", "_rerank_score_kernel",
                                                         "_rerank_layout_kernel", "_rerank_pick_kernel"}
    assert spec["launches_per_layer"] <= kivi["launches_per_layer"] + 3
    assert best["launches_per_layer"] <= kivi["launches_per_layer"] + 6
    assert kivi["torch_ops_in_custom_ops_per_layer"] == 0 and spec["torch_ops"] == best["torch_ops"] == {"contiguous": 1.0}
