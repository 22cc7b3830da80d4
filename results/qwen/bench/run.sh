#!/usr/bin/env bash
# The native compiled decode step of Qwen2.5-Coder-1.5B-Instruct on this CPU (fp32, 2 threads): fp16 (fp32 here),
# KIVI 1-bit, SpeCache 1-bit (paper) and --preset best side by side, one run per context. Each context is
# prefilled once (essay text) and replayed into every cache (--shared-prefill). From the repository root:
#     bash results/qwen/bench/run.sh 8192 32700
set -euo pipefail
for L in "${@:-8192}"; do
  flock /tmp/specache-heavy.lock env OMP_NUM_THREADS=2 .venv/bin/python tools/bench.py \
    --checkpoint checkpoints/qwen2.5-coder-1.5b --compile --shared-prefill --threads 2 --contexts $L \
    --caches full,kivi-1bit,specache-1bit,specache-1bit-best --warmup 2 --steps 5 \
    --json results/qwen/bench/cpu-$L.json 2> results/qwen/bench/cpu-$L.log
done
