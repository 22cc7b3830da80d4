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
    if not (DEFAULT_CKPT / "config.json").exists():
        pytest.skip("default checkpoint missing: run `make test` (it converts it first)")
    return DEFAULT_CKPT
