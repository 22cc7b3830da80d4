#!/usr/bin/env bash
# Prefill of a ~30k-token completion prompt through the transformers adapter on Gemma 3 270M (fp16
# cache = fp32 on CPU, default chunk 2,048, 2 threads): the code before the sliding-window ring
# (OLD, a checkout of bd29393) and this tree, alternating, twice each; transformers' own forward on
# the same prompt; then the device KV bytes at 32,698 prompt tokens (+16 new) of this project's caches
# beside transformers' default cache. From the repository root: bash results/long-context/prefill_ab.sh OLD
set -euo pipefail
OLD=${1:?a checkout of the code before the change}
NEW=$(pwd)
M=$NEW/checkpoints/gemma-3-270m
OUT=$NEW/results/long-context/prefill
PY=$NEW/.venv/bin/python
mkdir -p $OUT
$PY results/long-context/make_prompt.py --model $M --length 30099 --out $OUT/prompt-30k.txt
$PY results/long-context/make_prompt.py --model $M --length 32698 --out $OUT/prompt-32k.txt
run() {  # dir name cache prompt
  (cd $1 && OMP_NUM_THREADS=2 /usr/bin/time -v $PY generate.py --hf $M --cache $3 --prompt-file $4 --max-new-tokens 16 \
      --quiet --json --threads 2 > $OUT/$2.json 2> $OUT/$2.err)
}
for rep in 1 2; do
  run $OLD old-full-30k-$rep full $OUT/prompt-30k.txt
  run $NEW new-full-30k-$rep full $OUT/prompt-30k.txt
done
OMP_NUM_THREADS=2 /usr/bin/time -v $PY results/long-context/hf_prefill.py --model $M --prompt-file $OUT/prompt-30k.txt \
    --threads 2 > $OUT/transformers-30k.json 2> $OUT/transformers-30k.err
for cache in full kivi-1bit specache-1bit specache-1bit-best specache-2bit specache-2bit-best; do
  run $NEW new-$cache-32k $cache $OUT/prompt-32k.txt
done
OMP_NUM_THREADS=2 /usr/bin/time -v $PY results/long-context/hf_prefill.py --model $M --prompt-file $OUT/prompt-32k.txt \
    --threads 2 > $OUT/transformers-32k.json 2> $OUT/transformers-32k.err
