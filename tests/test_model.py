"""model.py against Hugging Face transformers, after a round trip through convert_hf.py."""
import pytest
import torch

from tests.helpers import tiny_model

transformers = pytest.importorskip("transformers")

import convert_hf  # noqa: E402
from cache import setup_caches  # noqa: E402
from model import ModelArgs, Transformer, load_model  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=256)
FAMILIES = {
    "llama2": (transformers.LlamaConfig, dict(num_key_value_heads=4, rope_theta=10000.0)),
    "llama31-gqa": (transformers.LlamaConfig, dict(
        num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "mistral-window": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=6, rope_theta=1e6)),
    "tied": (transformers.LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=100000.0)),
}


def hf_model(family, tmp_path):
    cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = cfg_cls(**TINY, **extra)
    cfg._attn_implementation = "eager"
    hf = (transformers.MistralForCausalLM if cfg_cls is transformers.MistralConfig else transformers.LlamaForCausalLM)(cfg)
    with torch.no_grad():  # random norms too, so a swapped norm weight cannot pass
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf = hf.float().eval()
    src = tmp_path / "hf"
    hf.save_pretrained(src, safe_serialization=True)
    out = tmp_path / "ours"
    convert_hf.convert_hf_dir(src, out, dtype="float32")
    return hf, load_model(out)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_hf(family, tmp_path):
    hf, ours = hf_model(family, tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        setup_caches(ours, "full", batch=2, max_seq_len=32)
        got_prefill = ours(ids, torch.arange(20), mode="prefill", all_logits=True)
        # Decode path: prefill 12 tokens, then one token per step through the static cache.
        setup_caches(ours, "full", batch=2, max_seq_len=32)
        steps = [ours(ids[:, :12], torch.arange(12), mode="prefill", all_logits=True)]
        for t in range(12, 20):
            steps.append(ours(ids[:, t:t + 1], torch.tensor([t])))
        got_decode = torch.cat(steps, 1)
    torch.testing.assert_close(got_prefill, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_decode, ref, atol=1e-4, rtol=0)


def test_prefill_applies_the_head_to_the_last_position_only():
    """A prefill chunk returns its last position's logits [B, 1, V] (what decoding.prefill samples from), equal to
    that row of all the chunk's logits; decode steps return every fed token's."""
    model = tiny_model()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        setup_caches(model, "full", batch=2, max_seq_len=32)
        last = model(ids, torch.arange(20), mode="prefill")
        two = model(ids[:, :2], torch.tensor([20, 21]))
        setup_caches(model, "full", batch=2, max_seq_len=32)
        every = model(ids, torch.arange(20), mode="prefill", all_logits=True)
    assert last.shape == (2, 1, 256) and every.shape == (2, 20, 256) and two.shape == (2, 2, 256)
    torch.testing.assert_close(last[:, 0], every[:, -1], atol=1e-4, rtol=1e-5)  # (one row or 20: other BLAS blocking)


def test_known_configs_and_errors():
    a = ModelArgs.from_name("SmolLM2-135M")
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.tie_embeddings) == (30, 9, 3, 64, True)
    assert ModelArgs.from_name("Llama-3.1-8B").rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="unknown model"):
        ModelArgs.from_name("gpt-5")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)


def test_meta_init_has_no_storage():
    with torch.device("meta"):
        m = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, intermediate_size=128))
    assert all(p.is_meta for p in m.parameters())
