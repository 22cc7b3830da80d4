#!/bin/bash
# Device call 3 (call 2's tools/gpu_check.py ran past its 540 s limit and, buffering pytest's output, left
# nothing): the CUDA tests again as two pytest processes writing as they go (the default model's
# four compiled-CLI tests beside the rest), and, beside them, one compile of the preset's 8B step
# with TORCH_LOGS=output_code (to name the fused clone/transpose kernel of call 1's profile).
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
R=$OUT/r3; mkdir -p $R
P="python3 -m pytest -m cuda -p no:cacheprovider tests/test_cuda.py -rA"
ls checkpoints/smollm2-135m-instruct > $R/ckpt.txt 2>&1
(TORCHINDUCTOR_CACHE_DIR=/tmp/ind-a timeout 500 $P -k default_model --junitxml $R/default.xml > $R/default.log 2>&1; echo "default-model tests rc=$? at $(el) s" >> $R/env.txt) &
(TORCHINDUCTOR_CACHE_DIR=/tmp/ind-c TORCH_LOGS=output_code timeout 500 nice python3 tools/bench.py --model Llama-3.1-8B --random-weights --dtype bfloat16 --compile --contexts 32768 --caches specache-1bit-best --warmup 0 --steps 1 > /tmp/oc.log 2>&1; echo "output_code rc=$? at $(el) s" >> $R/env.txt; grep -n "clone_transpose" /tmp/oc.log | head -50 > $R/oc-grep.txt; gzip -c /tmp/oc.log > $R/oc.log.gz) &
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-b timeout 520 $P -k "not default_model" --junitxml $R/rest.xml > $R/rest.log 2>&1
echo "other CUDA tests rc=$? at $(el) s" >> $R/env.txt
wait
cat $R/env.txt; tail -3 $R/rest.log $R/default.log; grep -E "^(FAILED|ERROR)" $R/*.log | head; ls -la $R
