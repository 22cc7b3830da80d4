#!/usr/bin/env bash
# The CPU side of batches of different prompts, side by side in one slot of the heavy-job lock (nothing else
# running): tools/bench_batch.py (the default model, 4 essay prompts of 1,024-2,048 tokens, one left-padded batch
# against the four one after another, compiled), then the transformers adapter's padded batch of 4 through the
# batched caches against the per-row caches of the tree before them (run_hf_ab.sh's two runs).
# From the repository root: bash results/ragged/2026-12-02-cpu/run.sh
set -euo pipefail
D=results/ragged/2026-12-02-cpu
flock /tmp/specache-heavy.lock bash -c "
  OMP_NUM_THREADS=2 /usr/bin/time -f '%e s wall, %M KB peak' .venv/bin/python tools/bench_batch.py --threads 2 \
    --lengths 1024,1280,1536,2048 --caches full,specache-1bit --compile --json $D/bench_batch.json > $D/bench_batch.log 2>&1
  SPECACHE_NO_LOCK=1 bash $D/run_hf_ab.sh"
