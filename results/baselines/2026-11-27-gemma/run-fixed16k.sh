#!/usr/bin/env bash
# Phase B: the paper's fixed budgets at 16k (Table 2: 1/4 of the KV against 2-bit SpeCache, 1/8 against
# 1-bit): each press keeps 1/4 and 1/8 of the compressed entries in the global layers, InfLLM keeps 1/4 and
# 1/8 of the sequence as token rows; the same prompts as run-16k.sh. One piece at a time under the lock.
source results/baselines/2026-11-27-gemma/common.sh
DEPTHS=0.1,0.3,0.5,0.7,0.9
FIXED_PRESSES=streaming_llm,h2o,h2o+qa,snapkv,snapkv+qa,pyramidkv,knorm
for n in ${NEEDLES:-1 2 3 4}; do
  step project-niah16k-fixed-n$n $E niah --hf $G $NIAH --lengths 16000 --needles $n --depths $DEPTHS --methods $FIXED \
     --out $D/project-niah
  step presses-niah16k-fixed-n$n $B niah --hf $G --prompt-form completion --threads 2 --lengths 16000 --needles $n \
     --depths $DEPTHS --match '' --presses $FIXED_PRESSES --out $D
done
for task in ${TASKS:-niah_single_1 niah_single_2 niah_multikey_1 niah_multivalue niah_multiquery}; do
  step project-ruler16k-fixed-$task $E ruler --hf $G $RULER --lengths 16000 --tasks $task --methods $FIXED \
     --out $D/project-ruler16k
  for n in 4 8; do
    step presses-ruler16k-fixed-$task-$n $B ruler --hf $G --prompt-form completion --threads 2 --length 16000 \
       --samples $n --tasks $task --match '' --presses $FIXED_PRESSES --out $D
  done
done
