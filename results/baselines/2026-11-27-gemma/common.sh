# What the grid's scripts share: paths, commands, the methods, and `step`, which runs one piece (at most
# ~35 min on this 2-core CPU) under the machine's heavy-job lock, with its log and its start and end times.
# Every piece resumes: a rerun skips the cells already in its results.jsonl.
set -euo pipefail
G=checkpoints/gemma-3-270m
D=results/baselines/2026-11-27-gemma
export OMP_NUM_THREADS=2
E=".venv/bin/python tools/eval.py"
B=".venv/bin/python tools/baselines_grid.py"
# The project's caches at SpeCache's bytes: the fp cache, SpeCache (paper, 1-bit and 2-bit presets), Quest-style
# pages of 16 and 8 (at about those bytes) and at its authors' token budget (1,024), InfLLM at each one's bytes.
MATCHED=full,specache-1bit,specache-1bit-best,specache-2bit-best,quest-p16-k64,quest-p8-k64,quest-p16-k1024
MATCHED=$MATCHED,infllm@specache-1bit,infllm@specache-1bit-best,infllm@specache-2bit-best
FIXED=infllm@1/4,infllm@1/8  # the paper's fixed budgets (Table 2: against 2-bit and 1-bit SpeCache)
PRESSES=no_press,streaming_llm,h2o,h2o+qa,snapkv,snapkv+qa,pyramidkv,knorm,quantized-2bit,quantized-4bit
NIAH="--prompt-form completion --threads 2 --max-new-tokens 24"
RULER="--prompt-form completion --threads 2 --samples 8"
mkdir -p $D/logs
step() {
  local name=$1; shift
  echo "$(date -u +%FT%TZ) start $name" >> $D/logs/steps.log
  flock /tmp/specache-heavy.lock /usr/bin/time -f "$name: %e s wall, %M KB peak" "$@" >> $D/logs/$name.log 2>&1
  echo "$(date -u +%FT%TZ) done $name" >> $D/logs/steps.log
}
