"""Device KV bytes of Gemma 3 270M's caches at 32.7k (a 32,698-token prompt + 16 new tokens, as in
results/long-context/prefill/) in a 16-bit deployment (quant.deployed_nbytes: 2 bytes a floating-point element,
codes and 16-bit scales as stored) beside the fp32 bytes as this CPU runs them. The caches' buffers are
preallocated, so no prefill is needed. From the repository root, after `make gemma`:
    .venv/bin/python results/long-context/bytes16.py > results/long-context/bytes16.md"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from generate import setup_caches  # noqa: E402
from integrations import hf  # noqa: E402

SEQ = 32698 + 16 + 1  # generate.py's caches: prompt + new tokens + one step's lookahead


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    view, _ = hf.load(ROOT / "checkpoints" / "gemma-3-270m")
    mib = 2 ** 20
    print("| cache | device KV, 16-bit deployment | as run here (fp32) |")
    print("|---|---|---|")
    for name in ("full", "kivi-1bit", "specache-1bit", "specache-1bit-best", "specache-2bit", "specache-2bit-best"):
        c = setup_caches(view, name, 1, SEQ)
        print(f"| {c.config.name} | {c.deployed_bytes() / mib:.2f} MiB | {c.device_bytes() / mib:.2f} MiB |")


if __name__ == "__main__":
    main()
