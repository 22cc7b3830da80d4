"""Tensor parallelism over torch.distributed.

    torchrun --nproc-per-node 2 generate.py --cache specache --prompt "..."      # the model over 2 ranks
    torchrun --nproc-per-node 2 tools/eval.py niah --out results/niah             # the cells over 2 ranks

The world size comes from torchrun's environment (WORLD_SIZE); `--tp N` only checks it. Each rank
holds (docs/tp.md has the table):
  wq/wk/wv  rows [r*n/N, (r+1)*n/N) of the output (and of a Qwen2 bias): its query heads and the KV heads they read;
  wo        the matching input columns: a partial sum, all-reduced over ranks;
  w1/w3     rows, w2 columns (all-reduced), as in Megatron-LM;
  tok_embeddings and output head: a 1/N slice of the vocabulary (rows); the embedding all-reduces
            (exactly one rank holds each token's row, the others add zeros), the head's logits are
            all-gathered (so every rank samples the same token). A vocabulary N does not divide is
            replicated instead.
The KV caches are built from the rank's own ModelArgs (n_kv_heads/N): every low-bit copy, host
store, ring, side stream and ZipCache/QuantSpec state holds the rank's KV heads only, and SpeCache's
top-k is per KV head, so the caches add no communication. Collectives are torch.distributed's
functional ones, traced by torch.compile: the decode step stays one graph per rank.
"""
import os
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from model import ModelArgs, Transformer, read_config

# Per collective: a rank that died or hangs turns into an error after this long, not a hang.
TIMEOUT_S = float(os.environ.get("SPECACHE_DIST_TIMEOUT_S", "1800"))


# ---- the process group -------------------------------------------------------------------------------
def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """The rank; before the group exists, torchrun's RANK (so errors found early print once too)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def launched() -> int:
    """torchrun's world size (0: not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "0")) if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else 0


def init(want: int | None, device: torch.device, backend: str | None = None) -> torch.device:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU) if there is one. `want` (--tp) must
    equal the world size (ValueError). Returns the rank's device (cuda:LOCAL_RANK on CUDA). The entry
    points print their results on rank 0 only; `main` drops the other ranks' `error:` lines."""
    n = launched()
    if want is not None and want < 1:
        raise ValueError(f"--tp must be >= 1, got {want}")
    if want not in (None, 1) and not n:
        raise ValueError(f"--tp {want} needs torchrun: torchrun --nproc-per-node {want} {Path(sys.argv[0]).name} ...")
    if want is not None and n and want != n:
        raise ValueError(f"--tp {want} but torchrun started {n} processes (--nproc-per-node x nodes must equal --tp)")
    if n < 2:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                                timeout=timedelta(seconds=TIMEOUT_S))
    return device


def main(fn):
    """Run an entry point's main under torchrun: one `error:` line (rank 0's) for bad input that
    every rank sees alike, the process group torn down at the end."""
    try:
        fn()
    except SystemExit as e:
        if rank() and isinstance(e.code, str):
            raise SystemExit(1) from None  # rank 0 prints this very line
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- the collectives (functional: torch.compile traces them into the graph) -------------------------------
def _waited(y: torch.Tensor) -> torch.Tensor:
    # Eager calls return an AsyncCollectiveTensor that waits on first use; one never used (e.g. the
    # logits of a step nobody reads) would still be in flight at teardown. Compiled: a no-op check,
    # the traced graph already has its wait_tensor.
    return y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else y


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _waited(funcol.all_reduce(x, "sum", dist.group.WORLD))  # the whole [B, T, dim] batch


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    return _waited(funcol.all_gather_single(x.contiguous(), x.dim() - 1, dist.group.WORLD))


class VocabShardEmbedding(nn.Embedding):
    """Rows [start, start + V/N) of the embedding; a token outside them looks up zeros, and the
    all-reduce adds the one rank's row to N-1 zeros (exact)."""

    def __init__(self, vocab_size, dim, r, n):
        super().__init__(vocab_size // n, dim)
        self.start = r * (vocab_size // n)

    def forward(self, idx):
        local = idx - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return all_reduce(rows * inside[..., None].to(rows.dtype))


# ---- the split -------------------------------------------------------------------------------------------
def rank_args(args: ModelArgs, n: int) -> ModelArgs:
    """The ModelArgs a rank's modules and caches are built from (vocab_size stays the model's:
    logits are gathered). Raises ValueError when N does not divide the heads or the FFN."""
    for what, count in (("KV heads", args.n_kv_heads), ("query heads", args.n_heads),
                        ("FFN width (intermediate_size)", args.intermediate_size)):
        if count % n:
            ok = [d for d in range(1, args.n_kv_heads + 1) if args.n_kv_heads % d == 0 and args.n_heads % d == 0
                  and args.intermediate_size % d == 0]
            raise ValueError(f"{n} ranks do not divide the model's {count} {what}; use {' or '.join(map(str, ok))} ranks")
    return replace(args, n_heads=args.n_heads // n, n_kv_heads=args.n_kv_heads // n,
                   intermediate_size=args.intermediate_size // n)


def split_dim(name: str, args: ModelArgs, n: int):
    """The dimension of checkpoint tensor `name` that ranks split (None: replicated)."""
    if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1.weight", "w3.weight", "wq.bias", "wk.bias", "wv.bias")):
        return 0
    if name.endswith(("wo.weight", "w2.weight")):
        return 1
    if name in ("tok_embeddings.weight", "output.weight") and args.vocab_size % n == 0:
        return 0
    return None


def build_rank_model(args: ModelArgs, r: int, n: int) -> Transformer:
    """The rank's module tree on the meta device, with the all-reduce/all-gather hooks."""
    with torch.device("meta"):
        model = Transformer(rank_args(args, n))
        if args.vocab_size % n == 0:
            model.tok_embeddings = VocabShardEmbedding(args.vocab_size, args.dim, r, n)
            if model.output is not None:
                model.output = nn.Linear(args.dim, args.vocab_size // n, bias=False)
    for layer in model.layers:  # wo and w2 leave partial sums: add them up over the ranks
        layer.attention.register_forward_hook(lambda m, i, out: all_reduce(out))
        layer.feed_forward.register_forward_hook(lambda m, i, out: all_reduce(out))
    if args.vocab_size % n == 0:  # (copies made by quantspec.make_draft share these hooks)
        model.register_forward_hook(lambda m, i, logits: all_gather_last(logits))
    return model


def _slice(t_shape, dim, r, n):
    rows = t_shape[dim] // n
    return slice(r * rows, (r + 1) * rows)


def shard_model(model: Transformer, r: int | None = None, n: int | None = None) -> Transformer:
    """A rank's part of a full in-memory model (tests, random weights)."""
    r, n = rank() if r is None else r, world() if n is None else n
    local = build_rank_model(model.args, r, n)
    state = {}
    for name, t in model.state_dict().items():
        d = split_dim(name, model.args, n)
        state[name] = t if d is None else t[(slice(None),) * d + (_slice(t.shape, d, r, n),)].clone()
    local.load_state_dict(state, strict=True, assign=True)
    local.fresh_buffers(model.rope.device)
    return local.eval()


def checkpoint_files(ckpt_dir: Path) -> dict:
    """tensor name -> safetensors file: model.safetensors, or the shards a
    model.safetensors.index.json names (Hugging Face's layout for large models)."""
    import json
    from safetensors import safe_open
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index: {e}") from None
        for shard in sorted(set(weight_map.values())):
            if not (ckpt_dir / shard).exists():
                raise ValueError(f"checkpoint {ckpt_dir} is missing shard {shard} (named in {index.name})")
        return {name: ckpt_dir / shard for name, shard in weight_map.items()}
    path = ckpt_dir / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: path for name in f.keys()}
    except Exception as e:  # safetensors raises its own (Rust) error types
        raise ValueError(f"cannot read {path}: {str(e).strip()[:200] or type(e).__name__}") from None


def load_model(ckpt_dir, device="cpu", dtype=torch.float32, max_seq_len=None) -> Transformer:
    """model.load_model on one rank; under torchrun each rank reads only its slices, memory-mapped
    (safe_open + get_slice). Every rank checks every tensor's name and shape first, so a bad
    checkpoint is the same error on every rank (rank 0 prints it)."""
    import model as model_mod
    if world() == 1:
        return model_mod.load_model(ckpt_dir, device=device, dtype=dtype, max_seq_len=max_seq_len)
    from safetensors import safe_open
    ckpt_dir, r, n = Path(ckpt_dir), rank(), world()
    args = read_config(ckpt_dir)
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    local = build_rank_model(args, r, n)
    with torch.device("meta"):
        want = Transformer(args).state_dict()  # the full shapes, to check the file against
    files = checkpoint_files(ckpt_dir)
    missing = [name for name in want if name not in files]
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir} has no tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    state = {}
    for path in sorted(set(files[name] for name in want), key=str):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in (nm for nm in want if files[nm] == path):
                part = f.get_slice(name)
                if tuple(part.get_shape()) != tuple(want[name].shape):
                    raise ValueError(f"{path}: {name} has shape {tuple(part.get_shape())}, the config wants {tuple(want[name].shape)}")
                d = split_dim(name, args, n)
                t = part[:] if d is None else part[(slice(None),) * d + (_slice(want[name].shape, d, r, n),)]
                state[name] = t.to(device=device, dtype=dtype)
    local.load_state_dict(state, strict=True, assign=True)
    local.fresh_buffers(device)
    return local.eval()


def random_model(name: str, device="cpu", dtype=torch.float32, max_seq_len=None, seed=0) -> Transformer:
    """model.random_model, or under torchrun the rank's slices only (tools/bench.py: a 70B's shard)."""
    import model as model_mod
    if world() == 1:
        return model_mod.random_model(name, device=device, dtype=dtype, max_seq_len=max_seq_len, seed=seed)
    args = ModelArgs.from_name(name)
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    n = world()
    return model_mod.random_weights(build_rank_model(args, rank(), n), device, dtype, seed,
                                    split=lambda nm: split_dim(nm, args, n) is not None, rank=rank())


# ---- bytes per rank (tools/bench.py --floors --tp N) ---------------------------------------------------------------
def comm_bytes(args: ModelArgs, n: int, batch: int, step_tokens: int, elem: int = 2) -> int:
    """Bytes a rank sends per decode step in ring collectives: 2 all-reduces of [B, T, dim] per layer
    plus the embedding's, and the logits' all-gather; 2(N-1)/N of the tensor per all-reduce,
    (N-1)/N per all-gather. The caches add none (top-k is per KV head, all local)."""
    if n == 1:
        return 0
    act = batch * step_tokens * args.dim * elem
    vocab_split = args.vocab_size % n == 0
    reduces = 2 * args.n_layers + (1 if vocab_split else 0)
    gather = batch * step_tokens * args.vocab_size * 4 * (n - 1) // n if vocab_split else 0
    return reduces * act * 2 * (n - 1) // n + gather


def barrier():
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=TIMEOUT_S))  # names the rank that did not come
    else:
        dist.barrier()
