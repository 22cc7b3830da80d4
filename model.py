"""A static-shape Llama/Mistral/Qwen2 decoder, written to be read.

Everything the decode step touches is allocated up front (cache.setup_caches), positions arrive as
an `input_pos` tensor, and the KV cache is a pluggable object owned by each attention layer: the
layer computes q/k/v and RoPE, the cache stores k/v and returns the attention output. cache.py
holds the caches (fp16, low-bit KIVI, SpeCache; the siblings' in siblings/); this file does not look
inside them: it passes the forward's `mode` through to them, one of MODES, the list of what the
caches' forwards are.
"""
import json
import math
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


MODES = {  # what a forward asks of the caches: `mode`, passed through to them unchanged
    "prefill": "Algorithm 1: a chunk of the prompt, attended exactly, then stored",
    "decode": "a decode step (Algorithm 3's [real, speculative] or one token): the first token's K/V stays",
    "predecode": "Algorithm 2: attend and select the first step's rows; nothing stays",
    "draft": "QuantSpec: draft tokens over the INT4 view",
    "verify": "QuantSpec: the target over the INT8 view, written over the round's drafts",
}


@dataclass
class ModelArgs:
    name: str = "custom"
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 0  # 0 -> dim // n_heads
    vocab_size: int = 32000
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3.1: factor, low/high_freq_factor, original_max_position_embeddings
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    sliding_window: Optional[int] = None  # Mistral: every layer attends within this many positions
    layer_windows: Optional[tuple] = None  # where layers differ (Gemma 3): each layer's window, None = global
    qkv_bias: bool = False  # Qwen2: the q, k and v projections add a bias (o and the MLP have none)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of a layer (None: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        if name not in KNOWN_CONFIGS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_CONFIGS)}")
        return cls(name=name, **KNOWN_CONFIGS[name])


_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
KNOWN_CONFIGS = {
    "Llama-2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008, max_seq_len=4096),
    "Llama-2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, intermediate_size=13824, max_seq_len=4096),
    "Meta-Llama-3-8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336, vocab_size=128256,
                            rope_theta=500000.0, max_seq_len=8192),
    "Llama-3.1-8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336, vocab_size=128256,
                         rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA31_ROPE),
    "Llama-3.1-70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672, vocab_size=128256,
                          rope_theta=500000.0, max_seq_len=131072, rope_scaling=_LLAMA31_ROPE),
    "Mistral-7B-v0.2": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                            rope_theta=1000000.0, max_seq_len=32768),
    "Qwen2.5-1.5B": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128, intermediate_size=8960,
                         vocab_size=151936, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, qkv_bias=True),
    "SmolLM2-135M": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                         rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "SmolLM2-360M": dict(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, intermediate_size=2560, vocab_size=49152,
                         rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "SmolLM2-1.7B": dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, intermediate_size=8192, vocab_size=49152,
                         rope_theta=130000.0, max_seq_len=8192, tie_embeddings=True),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies, with Llama-3.1's piecewise scaling when `rope_scaling` is set."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    s = args.rope_scaling
    if s:
        low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
            s["high_freq_factor"] - s["low_freq_factor"])
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq, scaled)
    return inv_freq


def rope_table(args: ModelArgs, seq_len: int) -> torch.Tensor:
    """[seq_len, head_dim/2, 2] table of (cos, sin) per position and frequency."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), rope_inv_freq(args))
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]), Meta-Llama layout. x: [B, T, H, D], rope: [B or 1, T, D/2, 2]."""
    xp = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    out = torch.stack([xp[..., 0] * cos - xp[..., 1] * sin, xp[..., 0] * sin + xp[..., 1] * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache = None  # set by Transformer.setup_caches

    def forward(self, x, rope, input_pos, mode: str):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        # The cache stores k/v and computes attention over everything it holds plus these T tokens.
        y = self.kv_cache(q, k, v, input_pos, mode)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, input_pos, mode):
        h = x + self.attention(self.attention_norm(x), rope, input_pos, mode)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args, args.max_seq_len), persistent=False)
        self.register_buffer("row_start", torch.zeros(1, dtype=torch.int64), persistent=False)

    def setup_caches(self, make_cache, row_start: Optional[torch.Tensor] = None) -> list:
        """Give every attention layer its own cache: `make_cache(layer_idx)` returns an nn.Module
        with `forward(q, k, v, input_pos, mode)` (cache.setup_caches builds them). The rope table is
        rebuilt on the model's device. row_start [B]: a left-padded batch's first real slot per row (the
        caches' own tensor: cache.register_row_start); each row's positions count from it (None: 0)."""
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = make_cache(i)
        self.fresh_buffers(self.tok_embeddings.weight.device)
        if row_start is not None:
            self.row_start = row_start
        return [layer.attention.kv_cache for layer in self.layers]

    def fresh_buffers(self, device):
        """The rope table and a batch without padding (row_start 0) on `device` (a model built on the meta device
        gets them here)."""
        self.rope = rope_table(self.args, self.args.max_seq_len).to(device)
        self.row_start = torch.zeros(1, dtype=torch.int64, device=device)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, mode: str = "decode",
                all_logits: bool = False) -> torch.Tensor:
        """idx: [B, T] token ids, input_pos: [T] absolute positions. Returns logits [B, T, vocab] (fp32); a prefill
        chunk only its last position's, [B, 1, vocab], unless all_logits (a whole chunk's logits at a 128k
        vocabulary are a GB a row). `mode` tells the caches what the step is (MODES: prefill, decode, predecode,
        draft, verify)."""
        rope = self.rope[(input_pos[None, :] - self.row_start[:, None]).clamp(min=0)]  # [B or 1, T]: each row's own positions
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, rope, input_pos, mode)
        if mode == "prefill" and not all_logits:
            x = x[:, -1:]
        x = self.norm(x)
        logits = F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        return logits.float()


def read_config(ckpt_dir) -> ModelArgs:
    path = Path(ckpt_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        return ModelArgs.from_dict(cfg)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not a valid model config: {e}") from None


def load_model(ckpt_dir, device="cpu", dtype=torch.float32, max_seq_len: Optional[int] = None) -> Transformer:
    """Build on the meta device, then assign the checkpoint's tensors one at a time (converted to
    `dtype` on the way), so peak memory is the model plus one tensor. Raises ValueError (with the
    file's path) for a missing, truncated or mismatched checkpoint."""
    from safetensors import safe_open

    ckpt_dir = Path(ckpt_dir)
    args = read_config(ckpt_dir)
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    with torch.device("meta"):
        model = Transformer(args)
    weights = ckpt_dir / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            state = {name: f.get_tensor(name).to(device=device, dtype=dtype) for name in f.keys()}
    except Exception as e:  # safetensors raises its own (Rust) error types for bad files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot read {weights}: {reason} (truncated or not a safetensors file? "
                         f"convert it again with convert_hf.py)") from None
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match ModelArgs: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.fresh_buffers(device)
    return model.eval()


def random_weights(model: Transformer, device="cpu", dtype=torch.float32, seed=0, split=lambda name: False,
                   rank=0) -> Transformer:
    """Give a model built on the meta device N(0, 0.02) weights (norms: ones): decode speed does not
    depend on their values, so this is how tools/bench.py measures 7-70B shapes without a download.
    Each tensor has its own generator, seeded by `seed` and its name, and by `rank` too where the
    ranks of a tensor-parallel model hold different slices of it (`split(name)`): a tensor every rank
    holds whole is the same on every rank."""
    state = {}
    for name, p in model.state_dict().items():  # generated where the model lives
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:
            state[name] = t.fill_(1.0)
            continue
        key = f"{seed}/{name}" + (f"/rank{rank}" if split(name) else "")
        state[name] = t.normal_(0.0, 0.02, generator=torch.Generator(device=device).manual_seed(zlib.crc32(key.encode())))
    model.load_state_dict(state, strict=True, assign=True)
    model.fresh_buffers(device)
    return model.eval()


def random_model(name: str, device="cpu", dtype=torch.float32, max_seq_len: Optional[int] = None, seed=0) -> Transformer:
    """A KNOWN_CONFIGS model with random weights (random_weights)."""
    args = ModelArgs.from_name(name)
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    with torch.device("meta"):
        model = Transformer(args)
    return random_weights(model, device, dtype, seed)
