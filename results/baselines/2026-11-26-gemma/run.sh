#!/usr/bin/env bash
# The baselines' grid on Gemma 3 270M (base, completion prompts), fp32, 2 threads, this 2-core CPU, one
# step at a time, in priority order. From the repository root after `make gemma`, `make venv-kvpress`.
# Every step resumes (a rerun skips the cells already in its results.jsonl).
source results/baselines/2026-11-26-gemma/common.sh
RULER=niah_single_2,niah_multikey_1
mkdir -p $D/logs
# 1. the project's caches on the NIAH prompts (8k and 16k x 5 depths); 2. the presses on the same prompts
step project-niah $E niah --hf $G --prompt-form completion --threads 2 --methods $CACHES --lengths 8000,16000 \
   --depths 0,0.25,0.5,0.75,1.0 --max-new-tokens 24 --out $D/project-niah
step presses-niah8k $B niah --hf $G --prompt-form completion --threads 2 --lengths 8000 --out $D
# (at 16k H2O's eager attention weights do not fit in memory: its error line per prompt)
step presses-niah16k $B niah --hf $G --prompt-form completion --threads 2 --lengths 16000 --out $D
# 3. RULER's NIAH family at 8k, 2 tasks x 4 samples: the project's caches, then the presses at the
#    matched budgets (the fixed 1/4 and 1/8 are in the NIAH grid only)
step project-ruler8k $E ruler --hf $G --prompt-form completion --threads 2 --lengths 8000 --samples 4 --tasks $RULER \
   --methods $CACHES --out $D/project-ruler8k
step presses-ruler8k $B ruler --hf $G --prompt-form completion --threads 2 --length 8000 --samples 4 --tasks $RULER --fixed '' --out $D
$B report --out $D --project $D/project-niah $D/project-ruler8k --figure
