#!/usr/bin/env bash
# Phase A, the cells that answer the most: NIAH and RULER at 16k on Gemma 3 270M (base, completion prompts),
# every method at SpeCache's 16-bit bytes (the presses matched to each SpeCache configuration's bytes on
# each prompt; Quest-style and InfLLM beside them), fp32, 2 threads, this 2-core CPU. From the repository
# root after `make gemma` and `make venv-kvpress`. One piece at a time under the heavy-job lock.
source results/baselines/2026-11-27-gemma/common.sh
DEPTHS=0.1,0.3,0.5,0.7,0.9
for n in ${NEEDLES:-1 2 3 4}; do  # NIAH 16k: 4 new needles x 5 depths = 20 prompts
  step project-niah16k-n$n $E niah --hf $G $NIAH --lengths 16000 --needles $n --depths $DEPTHS --methods $MATCHED \
     --out $D/project-niah
  for part in 0.1,0.3 0.5,0.7,0.9; do
    step presses-niah16k-n$n-${part//,/_} $B niah --hf $G --prompt-form completion --threads 2 --lengths 16000 \
       --needles $n --depths $part --fixed '' --presses $PRESSES --out $D
  done
done
# RULER 16k: the fp cache alone on the three tasks where it answered no sample of the 2026-11-26 grid (if it
# answers none of 8 here either, they separate nothing and are not run further); the methods on the other five
step project-ruler16k-fp $E ruler --hf $G $RULER --lengths 16000 --methods full --out $D/project-ruler16k \
   --tasks niah_single_3,niah_multikey_2,niah_multikey_3
for task in ${TASKS:-niah_single_1 niah_single_2 niah_multikey_1 niah_multivalue niah_multiquery}; do
  step project-ruler16k-$task $E ruler --hf $G $RULER --lengths 16000 --tasks $task --methods $MATCHED \
     --out $D/project-ruler16k
  for n in 3 6 8; do  # the presses in pieces of 3, 3 and 2 samples
    step presses-ruler16k-$task-$n $B ruler --hf $G --prompt-form completion --threads 2 --length 16000 --samples $n \
       --tasks $task --fixed '' --presses $PRESSES --out $D
  done
done
