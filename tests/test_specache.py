"""The low-bit cache's bookkeeping and SpeCache's pipeline, on a tiny random Llama."""
import pytest
import torch

import quant
from cache import setup_caches
from generate import decode_step
from quant import Fetched
from tests.helpers import run_generate, setup, tiny_model

PROMPT_LEN, NEW = 100, 40


def prompt(batch=1, n=PROMPT_LEN, seed=1):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed)).expand(batch, n).contiguous()


def run(model, cache, new=NEW, batch=1, step_fn=decode_step, **kw):
    caches = setup(model, cache, batch=batch, max_seq_len=PROMPT_LEN + new + 1, **kw)
    out, stats = run_generate(model, prompt(batch), new, caches.config, step_fn=step_fn)
    return out, stats, caches, caches.meter


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def full_tokens(model):
    return run(model, "full")[0]


@pytest.mark.parametrize("fit", ["range", "lsq"])
def test_lowbit_counters_and_contents(model, full_tokens, fit):
    """Teacher-force the same 139 tokens through the full and the KIVI cache (residual 32): 128
    quantized, 11 in the residual, and layer 0's store holds exactly quant.quantize_keys/values of
    the fp keys the full cache saw (with either zero/scale fit)."""
    seq = torch.cat([prompt(), full_tokens[:, :-1]], 1)
    n = seq.shape[1]
    fed = {}
    for kind, kw in (("full", {}), ("kivi", dict(bits=2, group=16, residual=32, fit=fit))):
        caches = setup(model, kind, batch=1, max_seq_len=n + 1, **kw)
        with torch.no_grad():
            model(seq[:, :PROMPT_LEN], torch.arange(PROMPT_LEN), mode="prefill")
            for p in range(PROMPT_LEN, n):
                model(seq[:, p:p + 1], torch.tensor([p]))
        fed[kind] = caches
    for c in fed["kivi"]:
        assert (int(c.n_quant), int(c.res_len)) == (n // 32 * 32, n % 32)
    # Layer 0's keys do not depend on attention, so both caches saw the same ones.
    for f, c in zip(fed["full"][:1], fed["kivi"][:1]):
        nq = int(c.n_quant)
        first = torch.arange(nq // 16) == 0  # lsq without sinks: the sinks' key group keeps min/max
        kc, ks, kz = quant.quantize_keys(f.k_cache[:, :, :nq], 2, 16, meta_dtype=c.k_scale.dtype, fit=fit, keep_range=first)
        assert torch.equal(c.k_codes[:, :, :nq], kc)
        torch.testing.assert_close(c.k_scale[:, :, : nq // 16], ks)
        vc, _, _ = quant.quantize_values(f.v_cache[:, :, :nq], 2, 16, meta_dtype=c.v_scale.dtype, fit=fit)
        assert torch.equal(c.v_codes[:, :, :nq], vc)
        torch.testing.assert_close(c.k_res[:, :, : n - nq], f.k_cache[:, :, nq:n])


POLICIES = ["speculative", "sequential", "oracle", "lag", "union", "resync"]


def run_policy(model, fetch, new=NEW, step_fn=decode_step, predecode_fn=None, **kw):
    from config import CacheConfig
    cfg = CacheConfig("specache", fetch=fetch, **{"bits": 1, "group": 16, "residual": 32, **kw}).validated()
    setup_caches(model, cfg, 1, PROMPT_LEN + new + 2)
    return run_generate(model, prompt(), new, cfg, step_fn=step_fn, pre_decode_fn=predecode_fn)


@pytest.mark.parametrize("fetch", POLICIES)
@pytest.mark.parametrize("sinks", [0, 4])
def test_every_row_fetched_equals_full_cache(model, full_tokens, fetch, sinks):
    """k >= context: every quantized row is replaced by its fp copy, so 1-bit SpeCache is exact,
    whatever the policy (and with attention sinks held on the device)."""
    out, _ = run_policy(model, fetch, k=256, sinks=sinks)
    assert torch.equal(out, full_tokens)


@pytest.mark.parametrize("fetch,rerank", [(f, 1) for f in POLICIES] + [("resync", 2), ("sequential", 2)])
def test_policies_run_one_static_graph(model, fetch, rerank):
    """Every policy shares the static-shape step: one fullgraph graph across all steps (flushes
    included); resync's pre-decoding is a second graph of its own."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from generate import pre_decode
    eager, _ = run_policy(model, fetch, new=40, k=8, rerank=rerank)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(decode_step, fullgraph=True, backend="eager")
    pre = torch.compile(pre_decode, fullgraph=True, backend="eager")
    out, _ = run_policy(model, fetch, new=40, k=8, step_fn=step, predecode_fn=pre, rerank=rerank)
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == (2 if fetch in ("speculative", "union", "resync", "lag") else 1)


def test_resync_never_keeps_a_speculative_token_known_wrong(model):
    """After a step whose speculative token differs from the real output, the next step is fed the
    guess of a fresh pre-decoding of the real token, never the chained guess made from the wrong one;
    after a right guess the chain goes on."""
    from generate import pre_decode
    fed, chained, fresh = [], [], []

    def step(model, tokens, pos, *a):
        nxt, logits = decode_step(model, tokens, pos, *a)
        fed.append(tokens[0].tolist())
        chained.append(int(nxt[0, 1]))
        return nxt, logits

    def predecode(model, token, pos):
        logits = pre_decode(model, token, pos)
        fresh.append(int(logits[0].argmax()))
        return logits

    out, stats = run_policy(model, "resync", new=40, k=8, step_fn=step, predecode_fn=predecode)
    real = out[0, 1:].tolist()  # the real output of each step
    misses = [s for s in range(len(fed) - 1) if fed[s][1] != real[s]]  # (no pre-decoding after the last step)
    assert misses and len(misses) < len(fed) and stats["resyncs"] == len(misses)
    fresh = fresh[1:]  # the first pre-decoding is Algorithm 2's, before any step
    for s in range(len(fed) - 1):
        want = fresh.pop(0) if s in misses else chained[s]
        assert fed[s + 1][1] == want, s
    assert not fresh


def test_sinks_stay_in_fp16_and_are_never_fetched(model):
    """sinkN: the first N positions are attended in fp16 from the device once quantized; top-k
    never spends a fetched row on them."""
    from config import CacheConfig
    cfg = CacheConfig("specache", bits=1, group=16, residual=32, k=8, sinks=4)
    caches = setup_caches(model, cfg, 1, PROMPT_LEN + NEW + 2)
    prefetcher = caches.prefetcher
    run_generate(model, prompt(), NEW, cfg)
    for c in caches:
        assert torch.equal(c.fetch_idx[:, :, :4], torch.arange(4).expand(1, 2, 4)) and c.fetch_valid[:, :, :4].all()
        assert torch.equal(c.ring_k[:, :, :4], prefetcher.host_k[c.layer_idx, :, :, :4])
        assert (c.fetch_idx[:, :, 4:][c.fetch_valid[:, :, 4:]] >= 4).all()
    assert prefetcher.bytes_per_step() == 2 * model.args.n_layers * 2 * 8 * model.args.head_dim * 4


@pytest.mark.parametrize("fetch", ["speculative", "sequential", "lag", "union", "resync"])
def test_rerank_with_every_row_fetched_equals_full_cache(model, full_tokens, fetch):
    out, _ = run_policy(model, fetch, k=256, sinks=4, rerank=2)
    assert torch.equal(out, full_tokens)


def test_rerank_keeps_the_candidates_with_the_best_exact_scores(model):
    """rrN: the k rows fetched for the next step are, among the selecting token's low-bit top-(N*k),
    the k with the highest exact attention probability (its fp keys, summed over the kv head's query
    heads); their keys sit in the ring at once, their values arrive with the transfer."""
    import kernels
    from config import CacheConfig
    cfg = CacheConfig("specache", bits=1, group=16, residual=32, k=8, rerank=3)
    caches = setup_caches(model, cfg, 1, PROMPT_LEN + NEW + 2)
    prefetcher = caches.prefetcher
    run_generate(model, prompt(), 10, cfg)
    c = caches[1]
    g = torch.Generator().manual_seed(0)
    D = model.args.head_dim
    q, lse = torch.randn(1, 4, D, generator=g), torch.randn(1, 4, generator=g).abs() + 2
    fetched = Fetched(*(t.clone() for t in c.fetched()))
    _, cand = kernels.topk_lowbit_ref(q, lse, c.stored(), 24, c.sm_scale, fetched)
    q_rows, lse_rows = q[:, :, None], lse[:, :, None]
    _, _, logits = kernels.attention_lowbit_ref(q_rows, c.stored(), c.residual_rows(1), fetched, c.sm_scale, select=1)
    pick = c.pick(q_rows, lse_rows, logits)
    idx, valid = kernels.select_ref(*pick[:5])
    assert pick.k == 24 and pick.rerank is not None and valid.all()
    assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(idx[0], cand[0]))  # the low-bit top-24
    prefetcher.start(c.layer_idx, c.fetch_bufs(), pick)
    keys = prefetcher.host_k[1, 0]  # [Hkv, S, D]
    p = torch.exp(torch.einsum("hgd,hsd->hgs", (q[0] * c.sm_scale).view(2, 2, D), keys) - lse[0].view(2, 2, 1)).sum(1)
    got = c.fetch_idx[0, :, c.sinks:]
    for h in range(2):
        want = set(sorted(cand[0, h].tolist(), key=lambda i: -float(p[h, i]))[:8])
        assert set(got[h].tolist()) == want and c.fetch_valid[0, h, c.sinks:].all()
    assert torch.equal(c.ring_k[0, :, c.sinks:], torch.stack([keys[h, got[h]] for h in range(2)]))
    assert torch.equal(c.ring_v[0, :, c.sinks:], torch.stack([prefetcher.host_v[1, 0, h, got[h]] for h in range(2)]))
    assert prefetcher.bytes_per_step() == model.args.n_layers * 2 * 4 * D * (24 + 8)


def test_rerank_with_fewer_rows_moves_the_presets_bus_bytes(model):
    """docs/policies.md's equal-bus-bytes comparison: the preset (rr2, k 64) moves 128 keys + 64 values per
    layer and kv head, what the preset before it moved with k 96 and no re-ranking; the paper's k 64
    moves two thirds of that, re-ranking on top of k 96 half as much again."""
    def bus(name):
        return setup_caches(model, name, 1, 512).prefetcher.bytes_per_step()
    assert bus("specache-1bit-best") == bus("specache-1bit-best-rr1-k96-r32") == 3 * bus("specache-1bit") // 2
    assert bus("specache-1bit-best-k96-r32") == 3 * bus("specache-1bit-best") // 2


def test_one_bit_kivi_alone_differs(model, full_tokens):
    out, *_ = run(model, "kivi", bits=1, group=16, residual=32)
    assert not torch.equal(out, full_tokens)  # sanity: the exactness above is not vacuous


def test_batch_rows_agree(model, full_tokens):
    out, *_ = run(model, "specache", batch=2, bits=1, group=16, residual=32, k=8)
    single, *_ = run(model, "specache", batch=1, bits=1, group=16, residual=32, k=8)
    assert torch.equal(out[0], out[1]) and torch.equal(out[:1], single)


def test_prefill_peak_is_one_layer_of_fp_kv(model):
    """Algorithm 1: device KV during prefill peaks at the low-bit cache + one layer's fp K/V."""
    caches = setup(model, "specache", batch=1, max_seq_len=256, bits=1, group=16, residual=32, k=8)
    prefetcher, meter = caches.prefetcher, caches.meter
    resident = meter.current
    from generate import prefill
    prefill(model, prompt(), chunk=4096)
    a = model.args
    one_layer_fp = 2 * PROMPT_LEN * a.n_kv_heads * a.head_dim * 4  # fp32 K and V on CPU
    assert meter.peak == resident + one_layer_fp
    assert meter.current == resident
    assert sum(c.host_bytes() for c in caches) == prefetcher.host_k.nbytes * 2


def test_chunked_prefill_is_exact_for_specache(model):
    from generate import prefill
    setup(model, "full", batch=1, max_seq_len=256)
    ref = prefill(model, prompt(), chunk=4096)
    setup(model, "specache", batch=1, max_seq_len=256, bits=1, group=16, residual=32, k=8)
    got = prefill(model, prompt(), chunk=24)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_fetch_probe_measures_without_changing_the_tokens(model, full_tokens):
    """probe.FetchProbe (tools/eval.py's hit rates) hooks the layers from outside: same tokens, rates in
    [0, 1]; the most-mass top-k carries at least the mass of any k rows (the fetched ones, the exact
    top-k); with k >= context every row is held (both hit rates and the masses exactly 1 / equal)."""
    from tools.probe import FetchProbe
    plain, *_ = run(model, "specache", bits=1, group=16, residual=32, k=8)
    caches = setup(model, "specache", max_seq_len=PROMPT_LEN + NEW + 1, bits=1, group=16, residual=32, k=8)
    with FetchProbe(caches) as probe:
        out, _ = run_generate(model, prompt(), NEW, caches.config)
    assert torch.equal(out, plain)
    for key in ("hit", "hit_mass", "hit_own", "mass", "mass_topk", "mass_best", "reuse"):
        vals = probe.per_step(key)
        assert len(vals) >= NEW - 5 and all(0.0 <= v <= 1.0 + 1e-6 for v in vals), key
    best = probe.per_step("mass_best")
    for key in ("mass", "mass_topk"):
        assert all(m <= b + 1e-6 for m, b in zip(probe.per_step(key), best)), key
    assert probe.per_step("hit_mass") != probe.per_step("hit")  # GQA (2 query heads per kv head): the sets differ
    caches = setup(model, "specache", max_seq_len=PROMPT_LEN + NEW + 1, bits=1, group=16, residual=32, k=256)
    with FetchProbe(caches) as probe:
        run_generate(model, prompt(), NEW, caches.config)
    for key in ("hit", "hit_mass"):
        assert probe.per_step(key) and all(h == 1.0 for h in probe.per_step(key)), key
    for key in ("mass_topk", "mass_best"):
        assert all(abs(m - t) < 1e-6 for m, t in zip(probe.per_step("mass"), probe.per_step(key))), key
    # every quantized row fetched: the ring lacks only the rows a flush quantized during the step
    recs = probe.records[0]
    n = [r["n_quant"] for r in recs]
    assert [r["reuse"] for r in recs[:-1]] == pytest.approx([a / b for a, b in zip(n, n[1:])])
    assert any(a < b for a, b in zip(n, n[1:]))  # (a flush happened)


def test_most_mass_topk_weighs_heads_by_their_real_attention():
    """Two query heads share a kv head; position 0 is a sink kept in fp16 (not ranked). Head A puts
    almost all its attention on the sink, and of the rest most on position 2. Head B attends to
    position 1. Renormalized over the ranked positions (kernels.topk_exact), A's leftovers vote as
    loudly as B's real attention and position 2 wins; by attention actually paid, position 1 does."""
    from kernels import topk_exact
    from tools.probe import most_mass_topk
    keys = torch.eye(4)[None, None]  # [B=1, Hkv=1, S=4, D=4]: logits = q itself
    q = torch.tensor([[10.0, 0, 2, 0], [0, 1, 0, 0]])[None]  # [B=1, H=2, D=4]
    _, renorm = topk_exact(q, keys, 4, 1, 1.0, first=1)
    p = torch.softmax(q, -1)[:, None]  # [B, Hkv, G, S] over everything the heads attend to
    assert renorm.tolist() == [[[2]]] and most_mass_topk(p, 1, 4, 1).tolist() == [[[1]]]
    assert p[..., 1].sum() > 2.5 * p[..., 2].sum()  # position 1 carries more of the attention


def test_bad_arguments_are_clear(model):
    with pytest.raises(ValueError, match="multiple of --group"):
        setup(model, "kivi", max_seq_len=128, group=32, residual=48)
    with pytest.raises(ValueError, match="power of two"):
        setup(model, "kivi", max_seq_len=128, group=48)
    with pytest.raises(ValueError, match="--k must be >= 1"):
        setup(model, "specache", max_seq_len=128, k=0)
    with pytest.raises(ValueError, match="unknown cache 'h2o'"):
        setup_caches(model, "h2o", max_seq_len=128)


@pytest.mark.parametrize("fit", ["range", "lsq"])
def test_compiled_equals_eager_without_recompiles(model, fit):
    """One fullgraph graph serves every two-token step, including the steps that flush the residual
    (where the least-squares fit runs its fixed number of iterations)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager, *_ = run(model, "specache", bits=1, group=16, residual=32, k=8, fit=fit)
    torch._dynamo.reset()
    counters.clear()
    compiled_step = torch.compile(decode_step, fullgraph=True)
    out, *_ = run(model, "specache", bits=1, group=16, residual=32, k=8, step_fn=compiled_step, fit=fit)
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("scheme,bits", [("zipcache", 2), ("quantspec", 4), ("quantspec", 8)])
def test_sibling_quantizers_plug_into_the_same_cache(model, full_tokens, scheme, bits):
    """ZipCache and QuantSpec stores run through the same kernels: exact with every row fetched,
    and the stored codes decode back to layer 0's fp keys/values within their error bounds."""
    out, *_ = run(model, "specache", bits=bits, group=16, residual=32, k=256, scheme=scheme)
    assert torch.equal(out, full_tokens)
    seq = torch.cat([prompt(), full_tokens[:, :-1]], 1)
    fed = {}
    for kind, kw in (("full", {}), ("kivi", dict(bits=bits, group=16, residual=32, scheme=scheme))):
        caches = setup(model, kind, batch=1, max_seq_len=seq.shape[1] + 1, **kw)
        with torch.no_grad():
            model(seq, torch.arange(seq.shape[1]), mode="prefill")
        fed[kind] = caches[0]
    low, full = fed["kivi"], fed["full"]
    nq = int(low.n_quant)
    k_hat, v_hat = low.dequantized(nq)
    k, v = full.k_cache[:, :, :nq], full.v_cache[:, :, :nq]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    limit = {2: 0.35, 4: 0.08, 8: 0.01}[bits]
    assert rel(k_hat, k) < limit and rel(v_hat, v) < limit, (rel(k_hat, k), rel(v_hat, v))
    if scheme == "quantspec":  # the 4-bit view reads the upper planes of the same store
        low.view_bits = 4 if bits == 8 else 8
        k4, _ = low.dequantized(nq)
        assert (rel(k4, k) > rel(k_hat, k)) == (bits == 8)


def test_bad_scheme_bits():
    with pytest.raises(ValueError, match="not available for scheme quantspec"):
        setup(tiny_model(), "kivi", max_seq_len=64, bits=1, group=16, residual=32, scheme="quantspec")


@pytest.mark.parametrize("chunk", [5, 16, 100])
def test_window_ring_equals_the_masked_full_cache(chunk):
    """FullCache with a sliding window of 7: a ring of 8 slots (two-token steps) against the same
    cache at full capacity, masked: chunked prefill (chunks of 5: the ring wraps inside and between
    chunks; 100: one chunk longer than the ring), then two-token steps whose speculative row the
    next step writes again, and a pre-decoding step; the same outputs at every step."""
    from cache import FullCache
    g = torch.Generator().manual_seed(0)
    ring, full = FullCache(1, 2, 128, 8, torch.float32, "cpu", sliding_window=7), FullCache(1, 2, 128, 8, torch.float32, "cpu")
    full.sliding_window = 7  # the same window, masked over every slot
    assert ring.ring and ring.capacity == 8 and not full.ring and full.capacity == 128
    def qkv(T):
        return torch.randn(1, 4, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g), torch.randn(1, 2, T, 8, generator=g)
    for p0 in range(0, 100, chunk):
        pos = torch.arange(p0, min(100, p0 + chunk))
        q, k, v = qkv(len(pos))
        torch.testing.assert_close(ring(q, k, v, pos, "prefill"), full(q, k, v, pos, "prefill"), atol=1e-5, rtol=0)
    q, k, v = qkv(1)
    torch.testing.assert_close(ring(q, k, v, torch.tensor([100]), "predecode"), full(q, k, v, torch.tensor([100]), "predecode"))
    for p in range(100, 112):
        q, k, v = qkv(2)
        pos = torch.tensor([p, p + 1])
        torch.testing.assert_close(ring(q, k, v, pos), full(q, k, v, pos), atol=1e-5, rtol=0)
    assert ring.read_bytes(2) == 2 * 2 * 8 * 4 * 8 and ring.device_bytes() == 2 * 2 * 8 * 8 * 4
