#!/bin/bash
# A first partial grid of the baselines on the default model (SmolLM2-135M-Instruct as a transformers
# directory), RULER niah_single_1/2 at 4k, 2 samples each, chat prompts, fp32, 1 thread, this 2-core CPU.
# Usage (repository root): flock /tmp/specache-heavy.lock bash results/baselines/2026-11-26-smollm2-ruler4k/run.sh
set -e
export OMP_NUM_THREADS=1
D=results/baselines/2026-11-26-smollm2-ruler4k
TASKS=niah_single_1,niah_single_2
# The project's caches on the same samples (tools/eval.py, hf.py: one prefill per prompt, replayed).
.venv/bin/python tools/eval.py ruler --hf checkpoints/smollm2-135m-hf --methods full,specache-1bit,specache-1bit-best \
  --lengths 4000 --samples 2 --tasks $TASKS --out $D/project > $D/project.log 2>&1
# kvpress presses at the device bytes of 1-bit SpeCache (paper) and of the preset; transformers' QuantizedCache.
.venv/bin/python tools/baselines.py ruler --out $D --tasks $TASKS --length 4000 --samples 2 \
  --presses no_press,streaming_llm,h2o,snapkv,snapkv+qa,knorm,quantized-2bit,quantized-4bit \
  --match specache-1bit,specache-1bit-best > $D/baselines.log 2>&1
.venv/bin/python tools/baselines.py report --out $D > /dev/null   # results.md
