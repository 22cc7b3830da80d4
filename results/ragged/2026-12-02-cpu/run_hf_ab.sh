#!/usr/bin/env bash
# The transformers adapter's left-padded batch of 4 different prompts (Gemma 3 270M base, `make gemma`, 4k, fp32,
# 2 threads): through the batched caches with the rows' starts (this tree) against the per-row caches and their
# loop (the tree before them, commit ad26d6f, in a worktree), one after the other under the heavy-job lock, cold
# inductor caches both. From the repository root: bash results/ragged/2026-12-02-cpu/run_hf_ab.sh
set -euo pipefail
ROOT=$PWD
OLD=/tmp/specache-rowloop
D=$ROOT/results/ragged/2026-12-02-cpu
[ -d $OLD ] || git worktree add --detach $OLD ad26d6f
ln -sfn $ROOT/checkpoints $OLD/checkpoints
rm -rf $OLD/.cache/inductor-hf-ab $ROOT/.cache/inductor-hf-ab  # cold inductor caches, so the graph build times compare
ARGS="--hf checkpoints/gemma-3-270m --contexts 4096 --caches full,specache-1bit-best --batch-caches full,specache-1bit-best --batch 4 --threads 2"
LOCK="flock /tmp/specache-heavy.lock"
[ -n "${SPECACHE_NO_LOCK:-}" ] && LOCK=""  # (run.sh holds it already)
$LOCK bash -c "
  cd $OLD && OMP_NUM_THREADS=2 TORCHINDUCTOR_CACHE_DIR=$OLD/.cache/inductor-hf-ab /usr/bin/time -f '%e s wall' $ROOT/.venv/bin/python tools/bench_hf.py $ARGS --json $D/hf-rowloop.json > $D/hf-rowloop.log 2>&1
  cd $ROOT && OMP_NUM_THREADS=2 TORCHINDUCTOR_CACHE_DIR=$ROOT/.cache/inductor-hf-ab /usr/bin/time -f '%e s wall' .venv/bin/python tools/bench_hf.py $ARGS --json $D/hf-batched.json > $D/hf-batched.log 2>&1"
