#!/bin/sh
# The compiled 8k CPU decode step of the default model, the tree before the fused selection (BASE, a git
# worktree of commit 1e9767c) and after it (NEW), back to back in one slot of the heavy-job lock, one thread,
# fresh inductor caches. Usage: sh results/fused-selection/bench_cpu_8k.sh BASE NEW OUTDIR
BASE=$1; NEW=$2; OUT=$3
mkdir -p "$OUT"
for caches in specache specache-1bit-best kivi-1bit; do
  for root in "$BASE" "$NEW"; do
    tag=$(basename "$root")
    echo "== $root $caches"
    (cd "$root" && env OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR="$OUT/inductor-$tag" \
      "$NEW/.venv/bin/python" tools/bench.py --compile --threads 1 --contexts 8192 --caches "$caches" \
      --checkpoint "$NEW/checkpoints/smollm2-135m-instruct" --json "$OUT/$tag-$caches.json" 2>&1 | tail -4)
  done
done
