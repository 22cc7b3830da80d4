#!/bin/bash
# Device call 3: compiled Llama-3.1-8B steps at 32k of full, KIVI and the paper configuration,
# one process each, one after the other.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_INTERPRET=0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=/tmp/r3; mkdir -p $R; BUDGET=${BUDGET:-570}
B="python3 bench.py --model Llama-3.1-8B --random-weights --dtype bfloat16"
for c in ${CACHES:-full kivi specache}; do
  l=$(( BUDGET - $(el) )); [ $l -lt 90 ] && { echo "no time for $c" >> $R/env.txt; continue; }
  timeout $l $B --compile --contexts 32768 --caches $c --warmup 5 --steps 20 --json $R/s-$c.json > $R/s-$c.log 2> $R/s-$c.err
  echo "$c rc=$? at $(el) s" >> $R/env.txt
done
tar czf $OUT/run3.tgz -C /tmp r3
cat $R/env.txt; for f in $R/s-*.md; do grep -E "^\|" $f; done 2>/dev/null; tail -3 $R/s-*.err
