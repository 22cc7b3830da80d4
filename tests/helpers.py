"""Shared test fixtures: a tiny random Llama and the default checkpoint's location."""
from pathlib import Path

import pytest
import torch

from model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CKPT = ROOT / "checkpoints" / "smollm2-135m-instruct"


def tiny_model(seed=0, n_layers=2, max_seq_len=512, vocab_size=256) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(name="tiny", dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=vocab_size,
                     intermediate_size=128, max_seq_len=max_seq_len, rope_theta=10000.0)
    model = Transformer(args)
    with torch.no_grad():  # larger weights than the default init, so attention is peaked, not uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model.eval()


def require_default_checkpoint():
    """The default model is part of the fast suite: `make test` converts it first. Missing, the
    tests that need it fail (a parity test that silently skips is not a parity test)."""
    if not (DEFAULT_CKPT / "config.json").exists():
        pytest.fail(f"default checkpoint missing at {DEFAULT_CKPT}: run `make test` (it converts it first)")
    return DEFAULT_CKPT


def planes_where_they_fit(store, D, M):
    """attn_path "planes" where the bit-plane tiles take the layout (M query rows per kv head), else "words":
    the tests that cover the plane path name it. A sibling's tuple (attn_views.ViewKV) reads words only."""
    import quant
    from gpu import attention
    return "planes" if isinstance(store, quant.LowBitKV) and attention.planes_fit(store, D, M) else "words"


def setup(model, kind, batch=1, max_seq_len=None, **fields):
    """methods.setup_caches with a CacheConfig built from its fields (kind, bits, group, ...)."""
    from config import CacheConfig
    from generate import setup_caches
    return setup_caches(model, CacheConfig(kind=kind, **fields).validated(), batch, max_seq_len)


def run_generate(model, prompt, new, config, step_fn=None, on_step=None, pre_decode_fn=None, **decoding):
    """generate.generate over the caches set up on `model` for `config` (a CacheConfig or its name,
    checked against the caches' fetch policy), greedy unless `decoding` says otherwise; step_fn /
    pre_decode_fn replace the eager steps."""
    from dataclasses import replace

    from cache import fetch_policy
    from config import CacheConfig
    from generate import Decoding, Steps, generate
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    steps = Steps()
    if step_fn is not None:
        steps = replace(steps, decode=step_fn)
    if pre_decode_fn is not None:
        steps = replace(steps, pre_decode=pre_decode_fn)
    assert fetch_policy(model) == config.policy, (fetch_policy(model), config.policy)
    return generate(model, prompt, Decoding(new, **decoding), steps, on_step)
