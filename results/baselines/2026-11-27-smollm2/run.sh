#!/usr/bin/env bash
# The baselines' grid on SmolLM2-135M-Instruct (chat prompts): RULER niah_single_1/2 at 3,800 tokens with
# seed 1, 8 samples a task (the 1-bit preset was chosen on seed 0 at 2,000 and 4,000 tokens: these samples
# and this length are new to it), every budget, fp32, 2 threads, this 2-core CPU. From the repository root
# after `make venv-kvpress` and `make checkpoints/smollm2-135m-hf/config.json`. Every step resumes.
set -euo pipefail
S=checkpoints/smollm2-135m-hf
D=results/baselines/2026-11-27-smollm2
export OMP_NUM_THREADS=2
source results/baselines/2026-11-27-gemma/common.sh  # the methods and `step` (its log goes to $D/logs)
D=results/baselines/2026-11-27-smollm2
mkdir -p $D/logs
TASKS=niah_single_1,niah_single_2
step project .venv/bin/python tools/eval.py ruler --hf $S --threads 2 --lengths 3800 --samples 8 --seed 1 --tasks $TASKS \
   --methods $MATCHED,$FIXED --out $D/project
for n in 2 4 6 8; do
  step presses-$n .venv/bin/python tools/baselines_grid.py ruler --hf $S --threads 2 --length 3800 --samples $n --seed 1 \
     --tasks $TASKS --presses $PRESSES --out $D
done
.venv/bin/python tools/baselines_grid.py report --out $D --project $D/project --figure
