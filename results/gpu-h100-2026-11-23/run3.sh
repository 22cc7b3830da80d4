#!/bin/bash
# Third device call: the fixes' CUDA tests (top-k bf16, compiled preset step) in the background,
# then compiled Llama-3.1-8B steps at 32k, one process per cache, cold compiles.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=/tmp/r3; mkdir -p $R; BUDGET=${BUDGET:-500}
(timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py -k "topk_kernel or compiled_step or fp32_tokens" > $R/pytest.log 2>&1; echo "pytest rc=$? at $(el) s" >> $R/env.txt) &
B="python3 tools/bench.py --model Llama-3.1-8B --random-weights --dtype bfloat16"
for c in ${CACHES:-specache-1bit-best specache-1bit-best-rr2-k64-r64 specache kivi}; do
  l=$(( BUDGET - $(el) )); [ $l -lt 100 ] && { echo "no time for $c" >> $R/env.txt; continue; }
  if [ $c = specache ]; then export TORCH_LOGS=output_code; else unset TORCH_LOGS; fi
  timeout $l $B --compile --contexts 32768 --caches $c --warmup 5 --steps 20 --json $R/s-$c.json > $R/s-$c.log 2> $R/s-$c.err
  echo "$c rc=$? at $(el) s" >> $R/env.txt
done
wait
tar czf $OUT/run3.tgz -C /tmp r3
cat $R/env.txt; tail -3 $R/pytest.log; for f in $R/s-*.md; do grep -E "^\|" $f; done 2>/dev/null
