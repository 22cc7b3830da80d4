"""Left-padded batches of different prompts through the transformers adapter (hf.left_padding, the batched
caches' row_start, generate.hf_generate with attention_mask=): each row's tokens are the tokens of its prompt
run alone (paddings that are multiples of the residual window), for the full, KIVI and SpeCache caches, in one
graph when compiled; and the masks, caches and sizes that cannot take them are errors."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hf.py's tests need transformers (requirements-test.txt)")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import generate  # noqa: E402
from config import CacheConfig  # noqa: E402
from decoding import Decoding  # noqa: E402
from integrations import hf  # noqa: E402
from tests.test_hf import NEW, adapter, prompt, tiny, tiny_gemma3  # noqa: E402
from tests.test_hf_compile import traced  # noqa: E402

# 100 tokens: three quantized groups of 32 and a residual; 36: one group and a residual; 68: two groups.
# Paddings 0, 64 and 32: multiples of the caches' residual window (32), so each row's key groups and flushes
# fall where its own run's do. Gemma 3's local layers keep a ring of 9 (window 8): 100 wraps it.
LENGTHS = (100, 36, 68)


def padded(prompts, pad_id=0):
    """Left-padded ids [B, P] and transformers' attention mask (1 = token) of prompts [1, n] each."""
    P = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - p.shape[1]:], mask[i, P - p.shape[1]:] = p[0], 1
    return ids, mask


def batch_tokens(model, ids, mask, cache, **kw):
    kw = dict(dict(do_sample=False, pad_token_id=0, eos_token_id=None), **kw)
    out = model.generate(ids, attention_mask=mask, custom_generate=generate.hf_generate, cache_config=cache,
                         max_new_tokens=NEW, **kw)
    return out[:, ids.shape[1]:].tolist()


def test_left_padding_from_the_mask():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    assert hf.left_padding(mask, 3, 4).tolist() == [2, 0, 1]
    assert hf.left_padding(torch.ones(2, 4, dtype=torch.long), 2, 4) is None  # no padding: the batched caches
    assert hf.left_padding(None, 2, 4) is None
    for bad, why in [([[1, 1, 0, 0], [1, 1, 1, 1]], "row 0 is right-padded"),
                     ([[1, 1, 1, 1], [0, 1, 0, 1]], "row 1 is not contiguous"),
                     ([[1, 1, 1, 1], [0, 0, 0, 0]], "row 1 is padding only"),
                     ([[1, 1, 1, 2], [1, 1, 1, 1]], "values other than 0 and 1")]:
        with pytest.raises(hf.HFError, match=why):
            hf.left_padding(torch.tensor(bad), 2, 4)
    with pytest.raises(hf.HFError, match=r"attention_mask of shape \(2, 3\) for input_ids of shape \(2, 4\)"):
        hf.left_padding(torch.ones(2, 3), 2, 4)


@pytest.mark.parametrize("cache", ["full", "kivi-1bit-g32-r32", "specache-1bit-g32-r32", "specache-2bit-best-k64-r32",
                                   "specache-1bit-oracle-k8-g32-r32"])
def test_padded_batch_equals_each_prompt_alone(cache):
    """A batch of three different prompts, left-padded, gives each prompt's greedy tokens alone:
    prefilled whole and in chunks of 13 (chunks that are padding only for the short rows). What KIVI
    stores depends on where the chunks start (later chunks attend to the earlier ones' low-bit copy),
    and padding shifts a row's chunks: one chunk only for KIVI."""
    model = tiny("llama")
    prompts = [prompt(seed, n) for seed, n in zip((1, 2, 3), LENGTHS)]
    alone = [adapter(model, p, cache) for p in prompts]
    assert len({tuple(a) for a in alone}) == 3
    ids, mask = padded(prompts)
    for chunk in (2048,) if "kivi" in cache else (2048, 13):
        assert batch_tokens(model, ids, mask, cache, prefill_chunk=chunk) == alone, chunk


@pytest.mark.parametrize("cache", ["specache-2bit-zipcache-k64-g32-r32", "quest-p16-k64"])
def test_siblings_and_baselines_refuse_a_padded_batch(cache):
    model = tiny("llama")
    ids, mask = padded([prompt(seed, n) for seed, n in zip((1, 2, 3), LENGTHS)])
    with pytest.raises(ValueError, match="runs a batch of one prompt length only"):
        batch_tokens(model, ids, mask, cache)


def test_padded_gemma3_rings_and_sampling():
    """Gemma 3's local rings of 9 per row: a 100-token prompt wraps its ring, a 5-token one fills
    less than the window; SpeCache in the global layer. Sampling with top_k=1 is greedy per row, and
    a row that ends early is padded after its eos as transformers pads it."""
    model = tiny_gemma3()
    prompts = [prompt(1, 100), prompt(2, 4), prompt(3, 68)]
    ids, mask = padded(prompts)
    for cache in ["full", "specache-1bit-g32-r32", "specache-2bit-best-k64-r32"]:
        alone = [adapter(model, p, cache) for p in prompts]
        assert batch_tokens(model, ids, mask, cache) == alone, cache
    cache = "specache-1bit-g32-r32"
    assert batch_tokens(model, ids, mask, cache, do_sample=True, top_k=1) == alone
    eos = alone[1][3]
    ended = batch_tokens(model, ids, mask, cache, eos_token_id=eos, pad_token_id=7)
    for row, want in zip(ended, alone):
        n = want.index(eos) + 1 if eos in want else len(want)
        assert row[:n] == want[:n] and set(row[n:]) <= {7}


def test_a_padded_batch_is_one_set_of_caches():
    """The rows of a padded batch share one set of batched caches (the padding's slots are held, not stored
    apart): the bytes of the same caches at batch 3 without padding; a forward of another batch size is refused."""
    view = hf.HFModel(tiny("llama"))
    rows = generate.setup_caches(view, "specache-1bit-g32-r32", 3, 128, row_start=torch.tensor([0, 3, 9]))
    same = generate.setup_caches(view, "specache-1bit-g32-r32", 3, 128)
    assert rows.device_bytes() == same.device_bytes() and rows.host_bytes() == same.host_bytes()
    assert rows.fetch_bytes_per_step() == same.fetch_bytes_per_step() > 0
    generate.setup_caches(view, "full", 3, 128, row_start=torch.tensor([0, 3, 9]))
    with pytest.raises(hf.HFError, match="a batch of 3 rows, not 2"):
        view(torch.zeros(2, 4, dtype=torch.long), torch.arange(4), "prefill")


@pytest.mark.parametrize("family,cache", [("llama", "specache-1bit-best"), ("gemma3", "kivi-1bit-g32-r32")])
def test_padded_step_is_one_graph(family, cache):
    """The compiled step over a padded batch (dynamo's eager backend: what breaks graphs or recompiles
    is the tracing) is one graph for two batches of different padding, with the eager tokens."""
    model = tiny("llama") if family == "llama" else tiny_gemma3()
    view = hf.HFModel(model)

    def run(prompts, steps):
        ids, mask = padded(prompts)
        generate.setup_caches(view, cache, ids.shape[0], ids.shape[1] + NEW + 1, row_start=hf.left_padding(mask, *ids.shape))
        return generate.generate(view, ids, Decoding(NEW), steps)[0].tolist()

    batches = [[prompt(1, 100), prompt(2, 36), prompt(3, 68)], [prompt(4, 40), prompt(5, 100), prompt(6, 99)]]
    eager = [run(b, generate.Steps()) for b in batches]
    resync = CacheConfig.from_name(cache).policy.resync
    steps = generate.Steps(pre_decode=traced(generate.pre_decode) if resync else generate.pre_decode,
                           decode=traced(generate.decode_step))
    torch._dynamo.reset()
    counters.clear()
    assert [run(b, steps) for b in batches] == eager
    assert counters["stats"]["unique_graphs"] == (2 if resync else 1) and not counters["graph_break"], dict(counters)


def test_errors():
    model = tiny("llama")
    ids, mask = padded([prompt(1, 30), prompt(2, 20)])
    with pytest.raises(hf.HFError, match="row 1 is right-padded"):
        batch_tokens(model, ids, mask.flip(1), "full")
    hole = mask.clone()
    hole[1, 15] = 0
    with pytest.raises(hf.HFError, match="row 1 is not contiguous"):
        batch_tokens(model, ids, hole, "full")
    view = hf.HFModel(model)
    with torch.no_grad():
        for cache in ["full", "kivi-1bit-g32-r32", "specache-1bit-g32-r32", "quest-p16-k64"]:
            generate.setup_caches(view, cache, 1, 24)
            with pytest.raises(ValueError, match="a sequence of 30 tokens does not fit caches set up for 24 positions"):
                model(ids[:1], past_key_values=view.cache)
        generate.setup_caches(view, "full", 2, 64)
        with pytest.raises(hf.HFError, match="a padded batch's caches are set up with its rows' starts"):
            model(ids, attention_mask=mask, past_key_values=view.cache)  # a forward HFModel did not announce


@pytest.mark.full
def test_padded_batch_compiled_with_inductor():
    """hf_generate(compile=True) over a padded batch (inductor, the public entry point): the eager tokens."""
    model = tiny("llama")
    ids, mask = padded([prompt(1, 100), prompt(2, 36), prompt(3, 68)])
    for cache in ["kivi-1bit-g32-r32", "specache-1bit-best"]:
        assert batch_tokens(model, ids, mask, cache, compile=True) == batch_tokens(model, ids, mask, cache), cache


def test_bench_replays_each_row_as_its_own_prefill():
    """tools/bench_hf.py times a padded batch from prompts prefilled alone and replayed into each row's slots
    of the batched caches: the tokens of the padded batch prefilled for real."""
    from tools.bench_hf import padded_batch, replayed
    from tools.replay import PrefillReplay
    model = tiny("llama")
    view = hf.HFModel(model)
    prompts = [prompt(1, 100), prompt(2, 36), prompt(3, 68)]
    recs = []
    for p in prompts:
        generate.setup_caches(view, "full", 1, p.shape[1] + 1)
        replay = PrefillReplay(2048)
        with torch.no_grad():
            replay(view, p)
        recs.append(([r.recording() for r in replay.recorded], replay.logits))
    ids, pad = padded_batch(prompts, pad_id=0)
    assert pad.tolist() == [0, 64, 32] and ids[1, :64].eq(0).all() and ids[1, 64:].equal(prompts[1][0])
    cache = "specache-1bit-g32-r32"
    generate.setup_caches(view, cache, 3, ids.shape[1] + NEW + 1, row_start=pad)
    fill = replayed([r[0] for r in recs], torch.cat([r[1] for r in recs]), pad)
    out, _ = generate.generate(view, ids, Decoding(NEW), generate.Steps(prefill=fill))
    mask = (torch.arange(ids.shape[1])[None] >= pad[:, None]).long()
    assert out.tolist() == batch_tokens(model, ids, mask, cache)
