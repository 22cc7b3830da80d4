"""quest.py, the block-retrieval baseline: page bounds and page selection against plain torch, the
oracle top-k with one-token pages, exactness when the pages cover the context, bytes, errors."""
import json
import math

import pytest
import torch

from baselines import quest
from config import CacheConfig
from generate import main, setup_caches
from prefetch import Prefetcher
from tests.helpers import require_default_checkpoint, run_generate, tiny_model


def layer_cache(name, H=2, D=8, L=64, B=1):
    """One QuestCache over its own prefetcher (fp32, CPU)."""
    config = CacheConfig.from_name(name)
    rows = min(config.k // config.page, -(-L // config.page)) * config.page
    pf = Prefetcher(1, B, H, L, D, rows, torch.float32, "cpu", async_ops=False)
    return quest.QuestCache(0, pf, B, H, L, D, torch.float32, "cpu", config)


def test_page_bounds_are_the_min_and_max_of_each_page_and_channel():
    torch.manual_seed(0)
    k = torch.randn(2, 3, 37, 8)
    lo, hi = quest.page_bounds(k, 5)
    assert lo.shape == (2, 3, 8, 8)
    for j in range(8):
        page = k[:, :, 5 * j:5 * j + 5]
        assert torch.equal(lo[:, :, j], page.amin(2)) and torch.equal(hi[:, :, j], page.amax(2))


def test_the_cache_keeps_the_bounds_of_prefill_chunks_and_decode_steps():
    torch.manual_seed(1)
    c = layer_cache("quest-p4-k8-r4-sink2", L=40)
    k, v = torch.randn(1, 2, 33, 8), torch.randn(1, 2, 33, 8)
    c.append_prefill(k[:, :, :13], v[:, :, :13], torch.arange(13))
    c.append_prefill(k[:, :, 13:30], v[:, :, 13:30], torch.arange(13, 30))
    for p in range(30, 33):  # decode steps store the token too
        c(torch.randn(1, 2, 1, 8), k[:, :, p:p + 1], v[:, :, p:p + 1], torch.tensor([p]))
    lo, hi = quest.page_bounds(k, 4)
    assert c.kmin.dtype == torch.float16  # 16-bit bounds under an fp32 model
    assert torch.equal(c.kmin[:, :, :9], lo.half()) and torch.equal(c.kmax[:, :, :9], hi.half())
    assert torch.isinf(c.kmin[:, :, 9:]).all()  # pages not written yet
    assert torch.equal(c.sink_k, k[:, :, :2]) and torch.equal(c.prefetcher.host_k[0, :, :, :33], k)
    assert sorted(c.res_pos.tolist()) == [29, 30, 31, 32]
    assert torch.equal(c.res_k[:, :, c.res_pos % 4], k[:, :, c.res_pos])


def reference_selection(q, k, page, n_sel, first, end):
    """Plain loops: each kv head's pages scored by max over its query heads of sum_d max(q*lo, q*hi),
    among the pages holding a position of [first, end); the rows of the best n_sel."""
    B, Hq, D = q.shape
    H = k.shape[1]
    G = Hq // H
    out = torch.zeros(B, H, n_sel * page, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            scores = []
            for j in range(-(-k.shape[2] // page)):
                if not (j * page < end and j * page + page > first):
                    continue
                keys = k[b, h, j * page:(j + 1) * page]
                lo, hi = keys.amin(0), keys.amax(0)
                ub = max(sum(max(float(q[b, h * G + g, d] * lo[d]), float(q[b, h * G + g, d] * hi[d]))
                             for d in range(D)) for g in range(G))
                scores.append((ub, j))
            pages = [j for _, j in sorted(scores, reverse=True)[:n_sel]]
            out[b, h] = torch.tensor([j * page + i for j in pages for i in range(page)])
    return out


@pytest.mark.parametrize("Hq,H", [(2, 2), (4, 2), (6, 2)])
def test_page_selection_matches_the_reference(Hq, H):
    torch.manual_seed(2)
    B, D, N, page, n_sel, first, end = 2, 8, 45, 4, 3, 2, 38
    k, q = torch.randn(B, H, N, D), torch.randn(B, Hq, D)
    lo, hi = quest.page_bounds(k, page)
    rows, valid = quest.select_pages(quest.page_scores(q, lo, hi), n_sel, page, first, torch.tensor(end))
    expected = reference_selection(q, k, page, n_sel, first, end)
    assert torch.equal(rows.sort(-1).values, expected.sort(-1).values)
    assert torch.equal(valid, (rows >= first) & (rows < end))


def test_the_upper_bound_bounds_every_key_of_the_page():
    torch.manual_seed(3)
    k, q = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 16)
    lo, hi = quest.page_bounds(k, 8)
    ub = quest.page_scores(q, lo, hi)[0, 0]
    dots = (k[0, 0] @ q[0, 0]).view(8, 8)
    assert (ub[:, None] >= dots - 1e-5).all()


@pytest.mark.parametrize("Hq", [2, 4])
def test_one_token_pages_select_the_oracle_top_k(Hq):
    """Pages of one token: the bound is q.k itself, so the pages are the exact top-k of the attention
    logits (one query head per kv head: the top-k of the attention probabilities), sinks and window aside."""
    torch.manual_seed(4)
    H, D, n, kk = 2, 8, 50, 6
    c = layer_cache(f"quest-p1-k{kk}-r5-sink3", H=H, D=D)
    k, v = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
    c.append_prefill(k, v, torch.arange(n))
    q = torch.randn(1, Hq, D)
    rows, valid = c.select(q, torch.tensor(n - 1))
    assert valid.all()
    logits = torch.einsum("bhgd,bhnd->bhgn", q.view(1, H, Hq // H, D), k) / math.sqrt(D)
    scores = logits.softmax(-1) if Hq == H else logits  # (GQA: the largest logit over the group)
    oracle = scores.amax(2)[..., 3:n - 5].topk(kk, -1).indices + 3  # the middle: [sinks, n - window)
    assert torch.equal(rows.sort(-1).values, oracle.sort(-1).values)


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_layers=2, max_seq_len=128)


def test_pages_covering_the_context_generate_the_full_cache_tokens(model):
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (1, 40))
    setup_caches(model, "full", 1, 61)
    full, _ = run_generate(model, prompt, 20, "full")
    setup_caches(model, "quest-p8-k64-r8-sink2", 1, 61)  # 8 pages of 8: every position
    covered, _ = run_generate(model, prompt, 20, "quest-p8-k64-r8-sink2")
    assert torch.equal(full, covered)
    caches = setup_caches(model, "quest-p8-k8-r8", 1, 61)  # one page a step: attention differs
    small, _ = run_generate(model, prompt, 20, "quest-p8-k8-r8")
    assert caches[0].n_sel == 1 and not torch.equal(full, small)


def test_sliding_window_layers_keep_their_window_and_the_global_ones_retrieve():
    """A Gemma-3-like stack (local, global, local): the local layers keep a FullCache ring of their window,
    the global one a QuestCache, and with pages covering the context the tokens are the full cache's."""
    m = tiny_model(n_layers=3, max_seq_len=128)
    m.args.layer_windows = (8, None, 8)
    torch.manual_seed(7)
    prompt = torch.randint(0, 256, (1, 30))
    setup_caches(m, "full", 1, 45)
    full, _ = run_generate(m, prompt, 14, "full")
    caches = setup_caches(m, "quest-p4-k64-r4", 1, 45)
    assert [type(c).__name__ for c in caches] == ["FullCache", "QuestCache", "FullCache"] and caches[0].ring
    covered, _ = run_generate(m, prompt, 14, "quest-p4-k64-r4")
    assert torch.equal(full, covered)


def quest_bytes(n_layers, H, D, L, P, k, R, S, itemsize):
    """What a quest cache holds on the device, by hand: per global layer and kv head, the 16-bit bounds
    (min and max of ceil(L/P) pages), the sinks', window's and fetched rows' K and V, and the int64
    positions of the window's and the ring's rows (and the layer's length). The ring holds k rows, or
    the pages of a shorter context."""
    k = min(k, -(-L // P) * P)
    per_layer = (2 * H * -(-L // P) * D * 2 + 2 * H * (S + R + k) * D * itemsize
                 + 8 * (R + H * k + 1))
    return n_layers * per_layer


def test_device_bytes_are_bounds_sinks_window_and_ring(model):
    P, k, R, S, L = 4, 16, 8, 2, 100
    caches = setup_caches(model, f"quest-p{P}-k{k}-r{R}-sink{S}", 1, L)
    a = model.args
    H, D = a.n_kv_heads, a.head_dim
    assert caches.device_bytes() == quest_bytes(a.n_layers, H, D, L, P, k, R, S, 4)
    assert caches.fetch_bytes_per_step() == a.n_layers * 2 * H * k * D * 4  # k rows of K and V: SpeCache's bus
    assert caches.host_bytes() == a.n_layers * 2 * H * L * D * 4
    assert CacheConfig.from_name("quest-p16").bits_per_value(D) == 1.0  # 2*D*16 bits a page over 16 tokens' 2*D values


@pytest.mark.parametrize("name,message", [
    ("quest-p16-k40", "must be a positive multiple of the page size"),
    ("quest-p0", "the page size (pN) must be >= 1"),
    ("quest-p16-2bit", "a quest cache takes pN (page), kN (rows fetched), rN (residual), sinkN; got bits"),
    ("quest-p16-resync", "'resync' is a SpeCache fetch policy"),
    ("quest-p16-r0", "the residual window (rN) must be >= 1"),
])
def test_bad_names_are_clear_errors(name, message):
    with pytest.raises(ValueError) as e:
        CacheConfig.from_name(name)
    assert message in str(e.value)


def test_the_command_line_runs_it_and_counts_its_bytes(capsys):
    ckpt = str(require_default_checkpoint())
    main(["--checkpoint", ckpt, "--json", "--quiet", "--max-new-tokens", "4", "--chat",
          "--prompt", "Name three colours of the rainbow, then count from one to twenty in words.", "--cache", "quest-p16-k64"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cache"] == "quest-p16-k64-r64" and len(out["tokens"]) == 4
    a = json.load(open(f"{ckpt}/config.json"))
    L = out["prompt_tokens"] + 4 + 1  # generate.py's sequence length: prompt, new tokens, one spare
    shape = (a["n_layers"], a["n_kv_heads"], a["head_dim"], L, 16, 64, 64, 0)
    assert out["kv_device_bytes"] == quest_bytes(*shape, 2)  # a 16-bit deployment
    assert out["kv_device_bytes_as_run"] == quest_bytes(*shape, 4)  # fp32 as run here
    rows = min(64, -(-L // 16) * 16)
    assert out["bytes_fetched_per_step"] == a["n_layers"] * 2 * a["n_kv_heads"] * rows * a["head_dim"] * 2
    assert out["bytes_fetched_per_step_as_run"] == 2 * out["bytes_fetched_per_step"]
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", ckpt, "--cache", "quest-p16-k40"])
    assert str(e.value).startswith("error: ") and "multiple of the page size" in str(e.value)


@pytest.mark.full
def test_the_compiled_step_is_the_eager_step(model):
    """The decode step (selection, gather, attention) compiles as one fullgraph graph at static shapes."""
    from decoding import compiled_step
    from generate import decode_step
    torch.manual_seed(6)
    prompt = torch.randint(0, 256, (1, 40))
    setup_caches(model, "quest-p8-k16-r8-sink2", 1, 61)
    eager, _ = run_generate(model, prompt, 12, "quest-p8-k16-r8-sink2")
    setup_caches(model, "quest-p8-k16-r8-sink2", 1, 61)
    compiled, _ = run_generate(model, prompt, 12, "quest-p8-k16-r8-sink2", step_fn=compiled_step(torch.device("cpu"), decode_step))
    assert torch.equal(eager, compiled)
