#!/usr/bin/env bash
# Phase C: NIAH and RULER at 8k on Gemma 3 270M, every budget (SpeCache's bytes and the fixed 1/4, 1/8), the
# same methods and prompts' recipe as at 16k. One piece at a time under the lock.
source results/baselines/2026-11-27-gemma/common.sh
DEPTHS=0.1,0.3,0.5,0.7,0.9
for n in ${NEEDLES:-1 2 3 4}; do
  step project-niah8k-n$n $E niah --hf $G $NIAH --lengths 8000 --needles $n --depths $DEPTHS --methods $MATCHED,$FIXED \
     --out $D/project-niah
  step presses-niah8k-n$n $B niah --hf $G --prompt-form completion --threads 2 --lengths 8000 --needles $n \
     --depths $DEPTHS --presses $PRESSES --out $D
done
for task in ${TASKS:-niah_single_2 niah_multikey_1}; do
  step project-ruler8k-$task $E ruler --hf $G $RULER --lengths 8000 --tasks $task --methods $MATCHED,$FIXED \
     --out $D/project-ruler8k
  for n in 4 8; do
    step presses-ruler8k-$task-$n $B ruler --hf $G --prompt-form completion --threads 2 --length 8000 --samples $n \
       --tasks $task --presses $PRESSES --out $D
  done
done
