#!/bin/sh
# The by-hand checks of docs/tp.md (CPU, gloo), run under `flock /tmp/specache-heavy.lock`.
# 1. SmolLM2-135M-Instruct over 3 ranks against one process, on the ~1000-token needle prompt.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
CK=checkpoints/smollm2-135m-instruct
ARGS="--checkpoint $CK --cache specache --bits 1 --k 64 --chat --prompt-file $CK/needle_prompt.txt --max-new-tokens 20 --json --quiet"
.venv/bin/python generate.py $ARGS > results/tp/needle-1proc.json 2> results/tp/needle-1proc.err
.venv/bin/torchrun --nproc-per-node 3 generate.py $ARGS > results/tp/needle-tp3.json 2> results/tp/needle-tp3.err
echo "tp3 rc=$?"
# 2. Inductor's lowering of the collectives: a compiled step on 2 ranks (tiny checkpoint from tests/test_tp.py)
if [ -d /tmp/tiny-tp-ckpt ]; then
  T="--checkpoint /tmp/tiny-tp-ckpt --cache specache-2bit --k 8 --group 16 --residual 32 --max-new-tokens 8 --prompt The_quick_brown_fox --json --quiet"
  .venv/bin/python generate.py $T > results/tp/tiny-1proc-eager.json 2>/dev/null
  TORCHINDUCTOR_CACHE_DIR=/tmp/tp-inductor .venv/bin/torchrun --nproc-per-node 2 generate.py $T --compile > results/tp/tiny-tp2-inductor.json 2> results/tp/tiny-tp2-inductor.err
  echo "inductor tp2 rc=$?"
fi
# 3. tools/eval.py niah on the default model: 2 ranks against one process (8 cells)
E="--checkpoint $CK --methods full,specache-1bit --lengths 500,1000 --depths 0.2,0.8 --max-new-tokens 16"
rm -rf results/tp/niah-1proc results/tp/niah-tp2
.venv/bin/python tools/eval.py niah $E --out results/tp/niah-1proc > /dev/null 2> results/tp/niah-1proc.err
.venv/bin/torchrun --nproc-per-node 2 tools/eval.py niah $E --out results/tp/niah-tp2 > /dev/null 2> results/tp/niah-tp2.err
echo "eval tp2 rc=$?"
