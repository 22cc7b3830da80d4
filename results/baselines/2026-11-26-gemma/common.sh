# What run.sh and run-ruler16k.sh share: the paths, the commands, the cache names, and `step`, which runs one
# step with its log and its start and end times.
set -euo pipefail
G=checkpoints/gemma-3-270m
D=results/baselines/2026-11-26-gemma
export OMP_NUM_THREADS=2
E=".venv/bin/python tools/eval.py"
B=".venv/bin/python tools/baselines_grid.py"
CACHES=full,kivi-1bit,kivi-2bit,specache-1bit,specache-1bit-best,specache-2bit-best,quest-p16-k64,quest-p8-k64
step() { local name=$1; shift; echo "$(date -u +%FT%TZ) start $name"; /usr/bin/time -f "$name: %e s wall, %M KB peak" "$@" > $D/logs/$name.log 2>&1; echo "$(date -u +%FT%TZ) done $name"; }
