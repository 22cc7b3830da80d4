#!/usr/bin/env bash
# One 16k prefill of the native path (the card's command: 1-bit SpeCache, k 64, chat), this CPU, 2 threads, fp32.
# From the repository root after `make qwen`; the prompt is `tools/eval.py prompt --length 16000 --depth 0.5`.
set -euo pipefail
R=results/qwen/prefill
M=checkpoints/qwen2.5-coder-1.5b
.venv/bin/python tools/eval.py prompt --checkpoint $M --length 16000 --depth 0.5 > $R/prompt-16k.txt
flock /tmp/specache-heavy.lock /usr/bin/time -v env OMP_NUM_THREADS=2 .venv/bin/python generate.py --checkpoint $M \
  --bits 1 --k 64 --chat --prompt-file $R/prompt-16k.txt --max-new-tokens 32 --threads 2 --json --quiet \
  > $R/specache-1bit-16k.json 2> $R/specache-1bit-16k.err
