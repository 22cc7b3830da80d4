#!/bin/bash
# Device call 2 (carry .cache/gpu-carry/b: the GGUF's second half): join the GGUF stashed by call 1,
# convert it to bf16 in checkpoints/smollm2-135m-instruct, then the CUDA tests (tools/gpu_check.py
# --skip-speed), which include generate.py --compile on the default model.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_INTERPRET=0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=/tmp/r2; mkdir -p $R
if [ -f /tmp/dm/part0 ]; then
  cat /tmp/dm/part0 .cache/gpu-carry/b/part1 > /tmp/dm/smollm2.gguf
  sha256sum /tmp/dm/smollm2.gguf | cut -c1-16 > $R/convert.log
  PYTHONPATH=/tmp/dm python3 convert_hf.py /tmp/dm/smollm2.gguf --dtype bfloat16 --name smollm2-135m-instruct \
    --out checkpoints/smollm2-135m-instruct >> $R/convert.log 2>&1; echo "convert rc=$? at $(el) s" >> $R/env.txt
else echo "no /tmp/dm/part0: the machine went cold between calls; default model not converted" >> $R/env.txt; fi
timeout ${TEST_S:-540} python3 tools/gpu_check.py --skip-speed --out $R/check > $R/check.log 2>&1
echo "gpu_check rc=$? at $(el) s" >> $R/env.txt
tar czf $OUT/run2.tgz -C /tmp r2
cat $R/env.txt $R/convert.log 2>/dev/null | tail -8; grep -E "FAIL|Error|^\||passed|failed" $R/check.log | tail -30
