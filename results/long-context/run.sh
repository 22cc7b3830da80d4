#!/usr/bin/env bash
# The long-context evaluation of Gemma 3 270M (base, 32k context) on this 2-core CPU, fp32, 2 threads,
# with the completion-form prompts a base model needs. From the repository root, after `make gemma`.
# Every step resumes: a rerun skips the cells already in its results.jsonl.
set -euo pipefail
M=checkpoints/gemma-3-270m
R=results/long-context
E="env OMP_NUM_THREADS=2 .venv/bin/python tools/eval.py"
CACHES=full,kivi-1bit,kivi-2bit,specache-1bit,specache-2bit,specache-1bit-best,specache-2bit-best
# NIAH: 3 lengths x 5 depths x 7 caches ("32k": 32,700 prompt tokens + 24 new within the 32,768 positions)
$E niah --hf $M --prompt-form completion --threads 2 --methods $CACHES --lengths 8000,16000,32700 \
   --depths 0,0.25,0.5,0.75,1.0 --max-new-tokens 24 --out $R/niah
# perplexity of the last 1,000 tokens of a 32,700-token essay window, through the decode path
$E ppl --hf $M --threads 2 --methods full,specache-1bit,specache-1bit-best,specache-2bit-best --lengths 32700 \
   --n-eval 1000 --windows 1 --out $R/ppl
# top-k hit rates at 16k and 32k (needle prompts, completion form)
$E hitrate --hf $M --prompt-form completion --threads 2 --methods specache-1bit,specache-1bit-best,specache-2bit-best \
   --lengths 16000,32700 --samples 1 --steps 64 --prompts needle --out $R/hitrate
# RULER's NIAH-family tasks at 16k, one sample each (base-model template), six caches
$E ruler --hf $M --prompt-form completion --threads 2 --lengths 16000 --samples 1 \
   --tasks niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multiquery,niah_multivalue \
   --methods full,kivi-1bit,specache-1bit,specache-2bit,specache-1bit-best,specache-2bit-best --out $R/ruler16k
