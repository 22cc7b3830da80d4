"""Device KV bytes of each cache on Qwen2.5-Coder-1.5B-Instruct's shapes as a 16-bit deployment would hold
them (2 bytes per fp K/V element, codes and 16-bit scales as stored): the caches built for a one-layer
fp16 model of the same attention shapes, times 28 layers. No weights needed.

    python results/qwen/device_bytes.py 8000,16000,32700 full,kivi-1bit,specache-1bit ...
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generate import setup_caches  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

ARGS = ModelArgs.from_name("Qwen2.5-1.5B")


def deployed_bytes(cache: str, tokens: int, new: int = 34) -> int:
    """Sized as tools/eval.py sizes a cell's caches: prompt + new tokens + 2."""
    one = ModelArgs(**{**ARGS.__dict__, "n_layers": 1, "vocab_size": 16})
    model = Transformer(one).to(torch.float16)
    return ARGS.n_layers * setup_caches(model, cache, 1, tokens + new + 2).device_bytes()


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lengths", help="prompt lengths in tokens, comma-separated")
    p.add_argument("caches", help="cache names (config.CacheConfig), comma-separated")
    a = p.parse_args()
    lengths, caches = [int(x) for x in a.lengths.split(",")], a.caches.split(",")
    print("| cache | " + " | ".join(f"{L:,} tokens" for L in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for c in caches:
        print(f"| {c} | " + " | ".join(f"{deployed_bytes(c, L) / 2**20:.2f} MiB" for L in lengths) + " |")
