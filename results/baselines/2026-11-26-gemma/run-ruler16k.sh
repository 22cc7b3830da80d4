#!/usr/bin/env bash
# RULER's NIAH family at 16k on Gemma 3 270M (after run.sh; same set-up): 3 tasks x 4 samples, one task
# at a time (the project's caches, then the presses at the matched budgets), so a cut run still holds
# whole tasks. No H2O at 16k: its eager weights for the three pressed layers do not fit in memory together,
# so each H2O cell would need an eager prefill of its own (about 10 min a cell here). Every step resumes.
set -euo pipefail
G=checkpoints/gemma-3-270m
D=results/baselines/2026-11-26-gemma
export OMP_NUM_THREADS=2
E=".venv/bin/python tools/eval.py"
B=".venv/bin/python tools/baselines_grid.py"
CACHES=full,kivi-1bit,kivi-2bit,specache-1bit,specache-1bit-best,specache-2bit-best,quest-p16-k64,quest-p8-k64
step() { local name=$1; shift; echo "$(date -u +%FT%TZ) start $name"; /usr/bin/time -f "$name: %e s wall, %M KB peak" "$@" > $D/logs/$name.log 2>&1; echo "$(date -u +%FT%TZ) done $name"; }
for task in ${TASKS:-niah_single_1 niah_single_2 niah_multikey_1}; do
  step project-ruler16k-$task $E ruler --hf $G --prompt-form completion --threads 2 --lengths 16000 --samples 4 \
     --tasks $task --methods $CACHES --out $D/project-ruler16k
  step presses-ruler16k-$task $B ruler --hf $G --prompt-form completion --threads 2 --length 16000 --samples 4 \
     --tasks $task --fixed '' --presses no_press,streaming_llm,snapkv,snapkv+qa,pyramidkv,knorm,quantized-2bit,quantized-4bit --out $D
done
$B report --out $D --project $D/project-niah $D/project-ruler8k $D/project-ruler16k --figure
