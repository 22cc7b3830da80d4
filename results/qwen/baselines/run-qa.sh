#!/usr/bin/env bash
# The best press of docs/baselines.md on Qwen2.5-Coder-1.5B-Instruct's RULER QA prompts at 16k (the samples of
# results/qwen/run.sh qa16k: SQuAD and HotpotQA over real documents, chat prompts): SnapKV with the question
# compressed, at the 1-bit SpeCache preset's 16-bit device bytes, and kvpress's `no_press` beside it as the fp cache
# there (the kvpress venv, transformers, `make qwen-hf`). InfLLM-style retrieval at the same bytes ran on the native
# checkpoint with the QA grid itself (results/qwen/qa16k, one prefill). fp32, 2 threads, this CPU.
# From the repository root, after `make qwen qwen-hf venv-kvpress`:
#     bash results/qwen/baselines/run-qa.sh [SAMPLES]      # the first SAMPLES (default 10) of each task
# Each call is one prompt under the heavy-job lock and skips the cells already in its results.jsonl.
set -euo pipefail
R=results/qwen/baselines-qa
mkdir -p $R/logs
log() { echo "$(date -u +%FT%TZ) $*" >> $R/logs/steps.log; }
for i in $(seq 1 ${1:-10}); do
  for t in qa_squad qa_hotpot; do
    log "start presses-$t@$i"
    flock /tmp/specache-heavy.lock env OMP_NUM_THREADS=2 /usr/bin/time -f "presses-$t@$i: %e s wall, %M KB peak" \
      .venv/bin/python tools/baselines_grid.py ruler --hf checkpoints/qwen2.5-coder-1.5b-hf --prompt-form chat \
      --threads 2 --length 16000 --samples $i --tasks $t --presses no_press,snapkv+qa --match specache-1bit-best \
      --fixed '' --out $R >> $R/logs/presses.log 2>&1
    log "done presses-$t@$i"
  done
done
