#!/usr/bin/env bash
# The compiled CPU decode step of the full and the KIVI 1-bit cache at 8k on the default model, 2 threads:
# the code of 2026-11-23 (b02a423, checked out at $OLD) against this tree, two alternating runs each (40 timed steps a cache),
# side by side in one run, with a third side: this tree with inductor's default CPU argument cap
# (bench_uncapped.py); then the preset's step with its resync forwards (this tree only).
# From the repository root: bash results/bench/kivi-ab-2026-11-25/run.sh /tmp/kivi-old
set -euo pipefail
OLD=${1:?a checkout of b02a423}
NEW=$(pwd)
OUT=$NEW/results/bench/kivi-ab-2026-11-25
PY=$NEW/.venv/bin/python
CK=$NEW/checkpoints/smollm2-135m-instruct
for rep in 1 2; do
  for side in old new uncapped; do
    case $side in
      old) dir=$OLD; script=bench.py ;;
      new) dir=$NEW; script=tools/bench.py ;;
      uncapped) dir=$NEW; script=results/bench/kivi-ab-2026-11-25/bench_uncapped.py ;;
    esac
    (cd $dir && OMP_NUM_THREADS=2 TORCHINDUCTOR_CACHE_DIR=${TMPDIR:-/tmp}/kivi-ab-inductor-$side $PY $script --checkpoint $CK --compile \
        --threads 2 --contexts 8192 --caches full,kivi --steps 40 --json $OUT/$side-$rep.json > $OUT/$side-$rep.log 2>&1)
  done
done
OMP_NUM_THREADS=2 $PY tools/bench.py --checkpoint $CK --compile --threads 2 --contexts 8192 \
    --caches specache-1bit-best --steps 20 --json $OUT/preset.json > $OUT/preset.log 2>&1
