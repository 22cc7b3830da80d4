#!/usr/bin/env bash
# The transformers adapter side by side on this 2-core CPU (fp32, 2 threads), 2026-11-26: transformers'
# own compiled static-cache generate(), and through hf.py the fp cache, KIVI 1-bit and the 1-bit preset,
# eager and compiled, batch 1; the preset on a left-padded batch of 4 different prompts.
# From the repository root after `make gemma` and `make checkpoints/smollm2-135m-hf/config.json`.
set -euo pipefail
B=results/bench/2026-11-26-hf-cpu
flock /tmp/specache-heavy.lock .venv/bin/python tools/bench_hf.py --hf checkpoints/gemma-3-270m --contexts 4096,8192 \
    --caches full,kivi-1bit,specache-1bit-best --batch-caches specache-1bit-best --batch 4 --threads 2 --json $B/gemma-3-270m.json > $B/gemma-3-270m.log 2>&1
flock /tmp/specache-heavy.lock .venv/bin/python tools/bench_hf.py --hf checkpoints/smollm2-135m-hf --contexts 4096 \
    --caches full,kivi-1bit,specache-1bit-best --batch-caches specache-1bit-best --batch 4 --threads 2 --json $B/smollm2-135m.json > $B/smollm2-135m.log 2>&1
