"""topk.py's radix selection (interpreted on CPU): the selected set equals torch.topk's, ties aside,
on hand-made scores (ties, scores that differ only in their lowest bits, fewer candidates than k)
and on the calls every selecting policy makes in a real generation."""
import pytest
import torch

import topk
from tests.helpers import tiny_model
from tests.test_kernels import assert_same_topk, needs_interpreter
from tests.test_specache import run_policy


def keys_of(score):
    """topk._radix_key in torch: fp32 bits + 1 for scores >= 0, 0 for the rest (-1: no candidate)."""
    bits = score.float().view(torch.int32).clamp(max=0x7F800000) + 1
    return torch.where(score >= 0, bits, 0).to(torch.int32)


def scores(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "spread":  # probabilities over many binades
        return torch.rand(n, generator=g) ** 8
    if kind == "ties":  # five distinct values: the k-th key ties with hundreds of others
        return torch.tensor([0.0, 1e-3, 0.25, 0.5, 1.0])[torch.randint(0, 5, (n,), generator=g)]
    if kind == "low_bits":  # one binade, the last 9 mantissa bits differ: all four rounds decide
        return (torch.tensor(1.0).view(torch.int32) + torch.randint(0, 512, (n,), generator=g, dtype=torch.int32)).view(torch.float32)
    if kind == "few":  # fewer candidates than k: the rest are -1 at position 0
        s = torch.full((n,), -1.0)
        s[torch.randperm(n, generator=g)[:10]] = torch.rand(10, generator=g)
        return s
    raise ValueError(kind)


@needs_interpreter
@pytest.mark.parametrize("kind", ["spread", "ties", "low_bits", "few"])
@pytest.mark.parametrize("k", [1, 16, 100])
def test_radix_select_equals_torch_topk(kind, k):
    n, chunk = 512, 64
    score = torch.stack([scores(kind, n, seed) for seed in range(3)])  # three kv heads, 8 chunks each
    got_score, got_idx = topk.radix_select_triton(keys_of(score), k, chunk)
    want = torch.where(score >= 0, score, -1.0).topk(k, -1)
    torch.testing.assert_close(got_score, want.values, atol=0, rtol=0)  # sorted, the same k values
    valid = got_score >= 0
    torch.testing.assert_close(score.gather(1, got_idx)[valid], got_score[valid], atol=0, rtol=0)
    assert (got_idx[~valid] == 0).all()
    for row, ok in zip(got_idx, valid):
        assert len(set(row[ok].tolist())) == int(ok.sum())  # distinct positions


# ---- the calls each policy makes -------------------------------------------------------------------
SELECTING = [("speculative", 1), ("union", 1), ("resync", 1), ("lag", 1), ("sequential", 1), ("resync", 2)]


@needs_interpreter
@pytest.mark.parametrize("fetch,rerank", SELECTING)
def test_every_selecting_policy_gets_the_reference_set(monkeypatch, fetch, rerank):
    """Record the top-k calls a short generation makes (selecting rows R, k or re-ranking's N*k
    candidates, sinks as `first`, the fetched rows scored exactly) and run the radix selection on
    the last step's calls of each layer: the same set as the reference."""
    calls = []

    def record(*args, use_op=None, attn_path=None, **kw):
        calls.append((args, kw))
        return topk.topk_lowbit_ref(*args, **kw)

    monkeypatch.setattr(topk, "topk_lowbit", record)
    run_policy(tiny_model(), fetch, new=6, k=8, sinks=4, rerank=rerank)
    last = calls[-2:]  # the tiny model's two layers
    rows = 2 if fetch == "union" else 1
    for args, kw in last:
        q_rows = args[0]
        assert (q_rows.shape[2] if q_rows.dim() == 4 else 1) == rows and args[3] == 8 * rerank and kw["first"] == 4
        assert_same_topk(topk.topk_lowbit_triton(*args, **kw), topk.topk_lowbit_ref(*args, **kw))
