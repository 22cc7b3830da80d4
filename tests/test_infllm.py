"""infllm.py, the InfLLM-style block retrieval: representative scores, block vectors, block selection and a
decode step's attention against plain torch; the full cache's tokens and logits when every block is
fetched; budgets, bytes and names."""
import json
import math

import pytest
import torch

from baselines import infllm
from config import CacheConfig
from generate import main, setup_caches
from prefetch import Prefetcher
from tests.helpers import require_default_checkpoint, run_generate, tiny_model


def layer_cache(name, H=2, Hq=4, D=8, L=96, B=1):
    """One InfLLMCache over its own prefetcher (fp32, CPU)."""
    config = CacheConfig.from_name(name)
    n_blocks = (L - config.sinks) // config.page
    rows = max(1, min(config.k // config.page, n_blocks)) * config.page
    pf = Prefetcher(1, B, H, L, D, rows, torch.float32, "cpu", async_ops=False)
    return infllm.InfLLMCache(0, pf, B, H, L, D, torch.float32, "cpu", config, Hq)


def reference_scores(q, k, W):
    """Plain loops: score[b, h, m] = sum over queries j in [m, m + W) of the causal softmax probability
    (scale 1/sqrt(D), every key up to j) that query j of head h gives key m (kv head h // G)."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, k.shape[2], dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for j in range(T):
                logits = [float(q[b, h, j].double() @ k[b, h // G, m].double()) / math.sqrt(D) for m in range(j + 1)]
                top = max(logits)
                total = sum(math.exp(x - top) for x in logits)
                for m in range(max(0, j - W + 1), j + 1):
                    out[b, h, m] += math.exp(logits[m] - top) / total
    return out


def reference_vectors(q, k, sinks, page, W, reprs, n_out):
    """Each block out of the window: per query head, the mean of its `reprs` keys of highest reference score."""
    scores = reference_scores(q, k, W)
    G = q.shape[1] // k.shape[1]
    vecs = []
    for j in range(n_out):
        rows = slice(sinks + j * page, sinks + (j + 1) * page)
        top = scores[:, :, rows].topk(reprs, -1).indices + sinks + j * page  # [B, Hq, reprs]
        vecs.append(torch.stack([torch.stack([k[b, h // G, top[b, h]].mean(0) for h in range(q.shape[1])])
                                 for b in range(q.shape[0])]))
    return torch.stack(vecs, 2)  # [B, Hq, n_out, D]


def test_window_probability_sums_match_plain_loops():
    """A chunk's queries add, to each key up to `window` positions before them, the softmax probability
    they give it; two chunks add up to the whole."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 37, 8), torch.randn(2, 2, 37, 8)
    got = infllm.window_probability_sums(q, k, torch.arange(37), 6)
    assert torch.allclose(got.double(), reference_scores(q, k, 6), atol=1e-5)
    first = infllm.window_probability_sums(q[:, :, :20], k[:, :, :20], torch.arange(20), 6)
    later = infllm.window_probability_sums(q[:, :, 20:], k, torch.arange(20, 37), 6)
    assert torch.allclose(torch.nn.functional.pad(first, (0, 17)) + later, got, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_causal_logsumexp_matches_masked_logits(fused):
    """Both paths (the CPU's fused attention kernel, blocks of queries) give log sum exp of q . k / sqrt(D)
    over the keys up to each query, for a whole prompt and for a later chunk after earlier keys."""
    torch.manual_seed(3)
    q, k = torch.randn(1, 4, 700, 16), torch.randn(1, 4, 700, 16)
    logits = (q @ k.transpose(2, 3)) / 4
    want = logits.masked_fill(torch.ones(700, 700).triu(1).bool(), -math.inf).logsumexp(-1)
    assert torch.allclose(infllm.causal_logsumexp(q, k, torch.arange(700), fused), want, atol=1e-4)
    later = infllm.causal_logsumexp(q[:, :, 530:], k, torch.arange(530, 700), fused)
    assert torch.allclose(later, want[:, :, 530:], atol=1e-4)


def test_window_probability_sums_across_key_blocks_match_the_dense_softmax():
    """Longer than a key block (the band of queries each block of keys reads) and a chunk that starts
    more than a window in: the sums equal those of the whole [T, S] softmax, masked to the window."""
    torch.manual_seed(4)
    S, W = 700, 70
    q, k = torch.randn(1, 4, S, 16), torch.randn(1, 2, S, 16)
    logits = (q @ k.repeat_interleave(2, 1).transpose(2, 3)) / 4
    dist = torch.arange(S)[:, None] - torch.arange(S)
    probs = logits.masked_fill(dist < 0, -math.inf).softmax(-1).masked_fill(dist >= W, 0.0)
    assert S > infllm.KEY_BLOCK + W
    assert torch.allclose(infllm.window_probability_sums(q, k, torch.arange(S), W), probs.sum(2), atol=1e-5)
    later = infllm.window_probability_sums(q[:, :, 400:], k, torch.arange(400, S), W)
    assert torch.allclose(later, probs[:, :, 400:].sum(2), atol=1e-5)


def test_shared_logsumexp_reuses_only_the_same_unchanged_tensors():
    torch.manual_seed(6)
    q, k = torch.randn(1, 4, 50, 8), torch.randn(1, 2, 50, 8)
    first = infllm.shared_logsumexp(q, k, torch.arange(50))
    assert infllm.shared_logsumexp(q, k, torch.arange(50)) is first  # the same tensors: computed once
    assert torch.allclose(first, infllm.causal_logsumexp(q, k, torch.arange(50)))
    again = infllm.shared_logsumexp(q, k.clone(), torch.arange(50))  # equal keys, another tensor: recomputed
    assert again is not first and torch.allclose(again, first)
    k[:, :, 10] += 1.0  # changed in place: recomputed
    assert torch.allclose(infllm.shared_logsumexp(q, k, torch.arange(50)), infllm.causal_logsumexp(q, k, torch.arange(50)))
    assert not torch.allclose(infllm.shared_logsumexp(q, k, torch.arange(50)), first)


def test_blocks_keep_their_vectors_through_prefill_chunks_and_decode_steps():
    """Two prefill chunks, then decode steps with every block fetched (so each step's probabilities are
    exact attention's): every block out of the window holds the mean of its top-reprs keys by the
    plain-loop scores of all queries, in 16 bits."""
    torch.manual_seed(1)
    sinks, page, W, reprs, L = 3, 4, 6, 2, 70
    c = layer_cache(f"infllm-p{page}-k64-r{W}-sink{sinks}-repr{reprs}", L=L)
    q, k, v = torch.randn(1, 4, 60, 8), torch.randn(1, 2, 60, 8), torch.randn(1, 2, 60, 8)
    c.append_prefill(k[:, :, :17], v[:, :, :17], torch.arange(17), q[:, :, :17])
    c.append_prefill(k[:, :, 17:41], v[:, :, 17:41], torch.arange(17, 41), q[:, :, 17:41])
    for p in range(41, 60):
        c(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
    n_out = infllm.n_blocks_out(60, sinks, W, page)
    assert n_out == 13 and c.n_sel >= n_out and c.block_vec.dtype == torch.float16
    want = reference_vectors(q, k, sinks, page, W, reprs, n_out)
    assert torch.allclose(c.block_vec[:, :, :n_out].float(), want.half().float(), atol=1e-3)
    assert torch.equal(c.init_k, k[:, :, :sinks]) and torch.equal(c.prefetcher.host_k[0, :, :, :60], k)


def test_a_decode_step_attends_to_the_top_blocks_the_initial_tokens_and_the_window():
    """One decode step against plain torch: the blocks ranked by the mean over query heads of q . vector,
    the top k/page fetched for every kv head, and softmax attention over the initial tokens, those blocks'
    rows and the window [sinks + n*page, p]."""
    torch.manual_seed(2)
    sinks, page, W, n_sel, L = 2, 4, 5, 3, 64
    c = layer_cache(f"infllm-p{page}-k{n_sel * page}-r{W}-sink{sinks}-repr2", L=L)
    T = 50
    q, k, v = torch.randn(1, 4, T + 1, 8), torch.randn(1, 2, T + 1, 8), torch.randn(1, 2, T + 1, 8)
    c.append_prefill(k[:, :, :T], v[:, :, :T], torch.arange(T), q[:, :, :T])
    out = c(q[:, :, T:], k[:, :, T:], v[:, :, T:], torch.tensor([T]))
    n_out = infllm.n_blocks_out(T, sinks, W, page)
    vecs = reference_vectors(q, k, sinks, page, W, 2, n_out).half().float()
    score = torch.einsum("bhd,bhnd->bn", q[:, :, T], vecs) / 4
    blocks = score.topk(n_sel, -1).indices[0].tolist()
    keep = list(range(sinks)) + [sinks + j * page + i for j in blocks for i in range(page)] + \
        list(range(sinks + n_out * page, T + 1))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, T:], k[:, :, keep], v[:, :, keep], enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5)
    assert sorted(set(c.ring_pos[0, 0].tolist())) == sorted(sinks + j * page + i for j in blocks for i in range(page))


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_layers=2, max_seq_len=256)


def test_every_block_fetched_is_the_full_cache_token_for_token_and_in_logits(model):
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (1, 100))
    logits = {}

    def keep(name):
        logits[name] = []
        return lambda step, lg, token, fed: logits[name].append(lg.clone())
    setup_caches(model, "full", 1, 131)
    full, _ = run_generate(model, prompt, 30, "full", on_step=keep("full"))
    name = "infllm-p8-k128-r8-sink4-repr2"  # (131 - 4) // 8 = 15 blocks, 16 fetched
    setup_caches(model, name, 1, 131)
    every, _ = run_generate(model, prompt, 30, name, on_step=keep(name))
    assert torch.equal(full, every)
    assert max(float((a - b).abs().max()) for a, b in zip(logits["full"], logits[name])) < 1e-4
    few = "infllm-p8-k16-r8-sink4-repr2"  # two blocks a step: attention differs
    setup_caches(model, few, 1, 131)
    two, _ = run_generate(model, prompt, 30, few, on_step=keep(few))
    assert max(float((a - b).abs().max()) for a, b in zip(logits["full"], logits[few])) > 1e-2


def test_sliding_window_layers_keep_their_window_and_the_global_one_retrieves():
    m = tiny_model(n_layers=3, max_seq_len=160)
    m.args.layer_windows = (8, None, 8)
    torch.manual_seed(7)
    prompt = torch.randint(0, 256, (1, 60))
    setup_caches(m, "full", 1, 80)
    full, _ = run_generate(m, prompt, 14, "full")
    caches = setup_caches(m, "infllm-p4-k128-r4-sink2-repr2", 1, 80)
    assert [type(c).__name__ for c in caches] == ["FullCache", "InfLLMCache", "FullCache"] and caches[0].ring
    every, _ = run_generate(m, prompt, 14, "infllm-p4-k128-r4-sink2-repr2")
    assert torch.equal(full, every)


def infllm_bytes(H, Hq, D, L, P, k, W, S, itemsize):
    """One global layer on the device, by hand: 16-bit block vectors (one per query head, (L - S) // P + 1
    blocks with the scratch one), the initial tokens', window ring's (W + 2P - 1 slots) and fetched rows' K
    and V, the ring's int64 positions and fp32 scores (2 B in 16 bits), the fetched rows' positions, the length."""
    blocks, ring = (L - S) // P + 1, W + 2 * P - 1
    score = 4 if itemsize == 4 else 2
    return (Hq * blocks * D * 2 + 2 * H * (S + ring + k) * D * itemsize + 8 * ring + Hq * ring * score
            + 8 * H * k + 8)


def test_bytes_by_hand_and_budgets(model):
    a = model.args
    L, name = 200, "infllm-p8-k32-r16-sink4-repr2"
    caches = setup_caches(model, name, 1, L)
    shape = (a.n_kv_heads, a.n_heads, a.head_dim, L, 8, 32, 16, 4)
    assert caches.device_bytes() == a.n_layers * infllm_bytes(*shape, 4)
    assert caches.deployed_bytes() == a.n_layers * infllm_bytes(*shape, 2)
    assert caches.fetch_bytes_per_step() == a.n_layers * 2 * a.n_kv_heads * 32 * a.head_dim * 4
    # @1/4: a quarter of the sequence as token rows, InfLLM's split (initial tokens <= 1/8, fetched : window 1 : 2)
    c = setup_caches(model, "infllm-p8-repr2@1/4", 1, 800).config
    assert (c.sinks, c.k, c.residual) == (25, 56, 104) and c.sinks + c.k + c.residual + 2 * 8 - 1 == 800 // 4
    # @NAME: the most rows whose deployed bytes fit that cache's on the same sequence
    target = setup_caches(model, "specache-1bit", 1, 800).deployed_bytes()
    got = setup_caches(model, "infllm-p8-repr2@specache-1bit", 1, 800)
    rows = got.config.sinks + got.config.k + got.config.residual + 15
    assert got.deployed_bytes() <= target < infllm.build(model, infllm.sized(got.config, rows + 1), 1, 800).deployed_bytes()
    assert CacheConfig.from_name("infllm-p128").bits_per_value(64, 3) == 8 * 3 / 128


def test_a_byte_budget_just_above_the_smallest_layout_is_found(model):
    """The search over token rows starts at the smallest layout (fewer rows hold none): a budget a little
    above it gives the most rows that fit, and one below it is a clear error."""
    L = 200
    target = setup_caches(model, "specache-2bit", 1, L).deployed_bytes()
    got = setup_caches(model, "infllm-p48-repr2@specache-2bit", 1, L)
    rows = got.config.sinks + got.config.k + got.config.residual + 2 * 48 - 1
    assert infllm.smallest_rows(48) == 164 < rows == 180
    assert got.deployed_bytes() <= target < infllm.build(model, infllm.sized(got.config, rows + 1), 1, L).deployed_bytes()
    with pytest.raises(ValueError, match=r"do not hold InfLLM's smallest layout \(164 token rows: \d+ bytes\)"):
        setup_caches(model, "infllm-p48-repr2@specache-1bit", 1, L)


@pytest.mark.parametrize("name,message", [
    ("infllm-p8-k12", "must be a positive multiple of the block"),
    ("infllm-p4-repr5", "must be 1 <= reprN <= pN"),
    ("infllm-2bit", "an infllm cache takes pN (page), kN (rows fetched), rN (residual), sinkN, reprN; got bits"),
    ("infllm@1/0", "is a share a/b in (0, 1]"),
    ("infllm@3/2", "is a share a/b in (0, 1]"),
    ("infllm@specache-7bit", "names no cache"),
    ("infllm@quest-p16", "must be full, kivi or specache"),
    ("specache-1bit@1/4", "a budget after @ sizes InfLLM's cache"),
])
def test_bad_names_are_clear_errors(name, message):
    with pytest.raises(ValueError) as e:
        CacheConfig.from_name(name)
    assert message in str(e.value)


def test_names_round_trip():
    for name in ("infllm-p128-k2048-r4096-sink128-repr4", "infllm-p128-repr4@1/8", "infllm-p64-repr2@specache-1bit-best"):
        assert CacheConfig.from_name(name).name == name
    assert CacheConfig.from_name("infllm").name == "infllm-p128-k2048-r4096-sink128-repr4"  # InfLLM's Mistral setting


def test_a_budget_too_small_for_a_block_is_an_error(model):
    with pytest.raises(ValueError, match="do not hold InfLLM's initial tokens, one block of 128 fetched and a window"):
        setup_caches(model, "infllm@1/8", 1, 400)


def test_the_command_line_runs_it_and_counts_its_bytes(capsys):
    ckpt = str(require_default_checkpoint())
    main(["--checkpoint", ckpt, "--json", "--quiet", "--max-new-tokens", "4", "--chat",
          "--prompt", "Name three colours of the rainbow, then count from one to twenty in words.",
          "--cache", "infllm-p8-k16-r8-sink4-repr2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cache"] == "infllm-p8-k16-r8-sink4-repr2" and len(out["tokens"]) == 4
    a = json.load(open(f"{ckpt}/config.json"))
    L = out["prompt_tokens"] + 4 + 1  # generate.py's sequence length: prompt, new tokens, one spare
    shape = (a["n_kv_heads"], a["n_heads"], a["head_dim"], L, 8, 16, 8, 4)
    assert out["kv_device_bytes"] == a["n_layers"] * infllm_bytes(*shape, 2)  # a 16-bit deployment
    assert out["kv_device_bytes_as_run"] == a["n_layers"] * infllm_bytes(*shape, 4)  # fp32 as run here
