#!/bin/bash
# One device call: CUDA tests + kernels alone, then compiled Llama-3.1-8B steps at 32k.
# Phase A warms the inductor cache with parallel compiles (16 CPU cores) while the CUDA tests run;
# phase B times each cache alone, one process each, with nothing else on the GPU.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=/tmp/r; mkdir -p $R
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"; } > $R/env.txt 2>&1
B="python3 tools/bench.py --model Llama-3.1-8B --random-weights --dtype bfloat16"
CACHES="${CACHES:-full kivi specache specache-1bit-best specache-1bit-best-rr2-k64-r64 specache-1bit-best-rr2}"
BUDGET=${BUDGET:-560}
# phase A
[ -z "$SKIP_TESTS" ] && { (timeout ${TEST_S:-330} python3 tools/gpu_check.py --skip-speed --out $R/check > $R/check.log 2>&1; echo "rc=$?" >> $R/check.log) & TPID=$!; }
set -- $CACHES
while [ $# -gt 0 ]; do
  PIDS=""
  for c in $1 $2 $3; do
    (timeout 240 $B --compile --contexts 32768 --caches $c --warmup 0 --steps 1 --profile-steps 0 > $R/warm-$c.log 2>&1; echo "rc=$?" >> $R/warm-$c.log) & PIDS="$PIDS $!"
  done
  wait $PIDS; echo "warm wave ($1 $2 $3) done at $(el) s" >> $R/env.txt
  [ $# -ge 3 ] && shift 3 || shift $#
done
[ -n "$TPID" ] && wait $TPID; echo "phase A done at $(el) s" >> $R/env.txt
[ -z "$SKIP_KERNELS" ] && timeout 90 $B --kernels --contexts 32768 --json $R/kernels.json > $R/kernels.log 2>&1
# phase B
for c in $CACHES; do
  l=$(( BUDGET - $(el) )); [ $l -lt 40 ] && { echo "no time for $c" >> $R/env.txt; continue; }
  timeout $l $B --compile --contexts 32768 --caches $c --warmup 5 --steps 20 --json $R/s-$c.json > $R/s-$c.log 2>&1
  echo "$c rc=$? at $(el) s" >> $R/env.txt
done
# the compiled steps' output code (for the unexplained fused copy kernel)
grep -rl "def call(args)" /tmp/ind --include=*.py 2>/dev/null | head -60 > $R/output_code_files.txt
tar czf $OUT/run.tgz -C /tmp r $(sed 's|^/tmp/||' $R/output_code_files.txt) 2>/dev/null
cp $R/env.txt $OUT/; cat $R/env.txt; grep -E "FAIL|^# " $R/check.log 2>/dev/null; cat $R/kernels.md 2>/dev/null | grep "^|"
for f in $R/s-*.md; do grep -E "^\|" $f; done 2>/dev/null
