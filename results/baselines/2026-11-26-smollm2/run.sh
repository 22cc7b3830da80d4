#!/usr/bin/env bash
# The baselines' grid on SmolLM2-135M-Instruct (chat prompts): RULER niah_single_1/2 at 4k, 8 samples a
# task (first run with 2, then resumed to 8), fp32, 2 threads, this 2-core CPU. From the repository root
# after `make venv-kvpress` and `make checkpoints/smollm2-135m-hf/config.json`. Every step resumes.
set -euo pipefail
S=checkpoints/smollm2-135m-hf
D=results/baselines/2026-11-26-smollm2
export OMP_NUM_THREADS=2
CACHES=full,kivi-1bit,kivi-2bit,specache-1bit,specache-1bit-best,specache-2bit-best,quest-p16-k64,quest-p8-k64
TASKS=niah_single_1,niah_single_2
step() { local name=$1; shift; echo "$(date -u +%FT%TZ) start $name"; /usr/bin/time -f "$name: %e s wall, %M KB peak" "$@" > $D/logs/$name.log 2>&1; echo "$(date -u +%FT%TZ) done $name"; }
mkdir -p $D/logs
step project .venv/bin/python tools/eval.py ruler --hf $S --threads 2 --lengths 4000 --samples 8 --tasks $TASKS \
   --methods $CACHES --out $D/project
step presses .venv/bin/python tools/baselines_grid.py ruler --hf $S --threads 2 --length 4000 --samples 8 --tasks $TASKS \
   --fixed '' --out $D
.venv/bin/python tools/baselines_grid.py report --out $D --project $D/project --figure
