#!/bin/sh
# the compiled 8k CPU SpeCache step, old tree and this branch, back to back in one lock slot
for root in /tmp/sel/base /work/wt-select; do
  cd $root && echo "== $root" && env OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/sel/ind_bench_$(basename $root) \
    .venv/bin/python tools/bench.py --compile --threads 1 --contexts 8192 --caches specache \
    --checkpoint /work/wt-select/checkpoints/smollm2-135m-instruct --json /tmp/sel/bench_$(basename $root).json 2>&1 | tail -15
done
