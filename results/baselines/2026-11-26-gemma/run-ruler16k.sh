#!/usr/bin/env bash
# RULER's NIAH family at 16k on Gemma 3 270M (after run.sh; same set-up): 8 tasks x 4 samples, one task
# at a time (the project's caches, then the presses at the matched budgets), so a cut run still holds
# whole tasks. No H2O at 16k: its eager weights for the three pressed layers do not fit in memory together,
# so each H2O cell would need an eager prefill of its own (about 10 min a cell here). Every step resumes.
source results/baselines/2026-11-26-gemma/common.sh
for task in ${TASKS:-niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 \
                  niah_multivalue niah_multiquery}; do
  step project-ruler16k-$task $E ruler --hf $G --prompt-form completion --threads 2 --lengths 16000 --samples 4 \
     --tasks $task --methods $CACHES --out $D/project-ruler16k
  step presses-ruler16k-$task $B ruler --hf $G --prompt-form completion --threads 2 --length 16000 --samples 4 \
     --tasks $task --fixed '' --presses no_press,streaming_llm,snapkv,snapkv+qa,pyramidkv,knorm,quantized-2bit,quantized-4bit --out $D
done
$B report --out $D --project $D/project-niah $D/project-ruler8k $D/project-ruler16k --figure
