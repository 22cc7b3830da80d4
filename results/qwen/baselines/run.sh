#!/usr/bin/env bash
# The best baselines of docs/baselines.md on Qwen2.5-Coder-1.5B-Instruct's NIAH 16k prompts (the 10 depths of
# results/qwen/run.sh niah16k, chat prompts, 32 new tokens), at SpeCache's 16-bit device bytes: SnapKV with the
# question compressed (kvpress venv, transformers, `make qwen-hf`; kvpress's `no_press` beside it as the fp cache
# there), Quest-style and InfLLM-style retrieval (the native checkpoint, `make qwen`). fp32, 2 threads, this CPU.
# From the repository root, after `make qwen qwen-hf venv-kvpress`:
#     bash results/qwen/baselines/run.sh            # every depth, the project's caches first, then the press
#     bash results/qwen/baselines/run.sh 0.5 0      # some depths
# Each call below is one prompt under the heavy-job lock and skips the cells already in its results.jsonl: a
# stopped run goes on where it stopped. The report beside the native rows of results/qwen/niah:
#     python tools/baselines_grid.py report --out results/qwen/baselines --hf checkpoints/qwen2.5-coder-1.5b-hf \
#         --project results/qwen/niah results/qwen/baselines/project-niah --figure
set -euo pipefail
R=results/qwen/baselines
D10="0.5 0 1 0.25 0.75 0.1111 0.3333 0.6667 0.8889 0.4444"  # results/qwen/run.sh's order
LOCK="flock /tmp/specache-heavy.lock env OMP_NUM_THREADS=2"
MATCHED=quest-p16-k64,quest-p8-k64,quest-p16-k1024,infllm@specache-1bit,infllm@specache-1bit-best,infllm@specache-2bit-best
mkdir -p $R/logs
log() { echo "$(date -u +%FT%TZ) $*" >> $R/logs/steps.log; }
for d in ${@:-$D10}; do
  log "start project-niah16k@$d"
  $LOCK /usr/bin/time -f "project-niah16k@$d: %e s wall, %M KB peak" .venv/bin/python tools/eval.py niah \
    --checkpoint checkpoints/qwen2.5-coder-1.5b --threads 2 --methods $MATCHED --lengths 16000 --depths $d \
    --max-new-tokens 32 --out $R/project-niah >> $R/logs/project-niah16k.log 2>&1
  log "done project-niah16k@$d"
done
for d in ${@:-$D10}; do
  log "start presses-niah16k@$d"
  $LOCK /usr/bin/time -f "presses-niah16k@$d: %e s wall, %M KB peak" .venv/bin/python tools/baselines_grid.py niah \
    --hf checkpoints/qwen2.5-coder-1.5b-hf --prompt-form chat --threads 2 --lengths 16000 --depths $d \
    --max-new-tokens 32 --presses no_press,snapkv+qa --fixed '' --out $R >> $R/logs/presses-niah16k.log 2>&1
  log "done presses-niah16k@$d"
done
