#!/bin/bash
# Device call 1 (carry .cache/gpu-carry/a: the first half of the default model's GGUF + the gguf
# package, stashed in /tmp for call 2): kernels alone at 32k, then the compiled Llama-3.1-8B steps
# of the preset and of its equal-bytes re-ranking variant, one process each, one after the other.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_INTERPRET=0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=/tmp/r1; mkdir -p $R /tmp/dm; BUDGET=${BUDGET:-570}
cp -r .cache/gpu-carry/a/* /tmp/dm/ 2>/dev/null; ls /tmp/dm > $R/stash.txt
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"
  git log --oneline -1 2>/dev/null; } > $R/env.txt 2>&1
B="python3 tools/bench.py --model Llama-3.1-8B --random-weights --dtype bfloat16"
timeout 90 $B --kernels --contexts 32768 --json $R/kernels.json > $R/kernels.log 2>&1
echo "kernels rc=$? at $(el) s" >> $R/env.txt
for c in ${CACHES:-specache-1bit-best specache-1bit-best-rr2-k64-r64}; do
  l=$(( BUDGET - $(el) )); [ $l -lt 120 ] && { echo "no time for $c" >> $R/env.txt; continue; }
  timeout $l $B --compile --contexts 32768 --caches $c --warmup 5 --steps 20 --json $R/s-$c.json > $R/s-$c.log 2> $R/s-$c.err
  echo "$c rc=$? at $(el) s" >> $R/env.txt
done
tar czf $OUT/run1.tgz -C /tmp r1
cat $R/env.txt; grep "^|" $R/kernels.md 2>/dev/null || tail -20 $R/kernels.log
for f in $R/s-*.md; do grep -E "^\|" $f; done 2>/dev/null; tail -5 $R/s-*.err
