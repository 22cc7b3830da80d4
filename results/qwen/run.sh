#!/usr/bin/env bash
# The accuracy grid of Qwen2.5-Coder-1.5B-Instruct (native checkpoint, `make qwen`), this CPU, fp32, 2 threads,
# greedy, chat prompts. From the repository root:
#     bash results/qwen/run.sh PIECE...        # pieces below; none: all, in this order
#     bash results/qwen/run.sh niah16k@0.5     # one NIAH prompt (a piece's length at one depth)
# Every eval.py call below is one prompt (or one window) under the heavy lock, so each lock is held for one
# prefill plus the caches' decodes; every call appends to its results.jsonl and skips the cells already
# there: a stopped run goes on where it stopped.
set -euo pipefail
M=checkpoints/qwen2.5-coder-1.5b
R=results/qwen
E="flock /tmp/specache-heavy.lock env OMP_NUM_THREADS=2 .venv/bin/python tools/eval.py"
CACHES=full,kivi-1bit,kivi-2bit,specache-1bit,specache-2bit,specache-1bit-best,specache-2bit-best
D10="0.5 0 1 0.25 0.75 0.1111 0.3333 0.6667 0.8889 0.4444"  # 10 depths, the informative ones first
D5="0.5 0 1 0.25 0.75"

niah() {  # LENGTH "DEPTHS": one call per prompt
  for d in $2; do
    $E niah --checkpoint $M --threads 2 --methods $CACHES --lengths $1 --depths $d --max-new-tokens 32 --out $R/niah
  done
}
ruler() {  # LENGTH SAMPLES: one call per task and sample
  for i in $(seq 1 $2); do
    for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multiquery niah_multivalue; do
      $E ruler --checkpoint $M --threads 2 --lengths $1 --samples $i --tasks $t \
         --methods full,kivi-1bit,specache-1bit,specache-2bit,specache-1bit-best,specache-2bit-best --out $R/ruler16k
    done
  done
}
# InfLLM-style retrieval at the 1-bit preset's 16-bit bytes, on the same prefill; QA_BASELINE= leaves it out (a
# sample whose seven caches ran but not this one costs a whole prefill for it alone)
QA_BASELINE=${QA_BASELINE-infllm@specache-1bit-best}
qa() {  # LENGTH FIRST LAST: RULER's two QA tasks over real documents, samples FIRST..LAST (1-based), one call per
  # sample and task (alternating)
  for i in $(seq $2 $3); do
    for t in qa_squad qa_hotpot; do
      $E ruler --checkpoint $M --threads 2 --lengths $1 --first-sample $((i - 1)) --samples $i --tasks $t \
         --methods $CACHES${QA_BASELINE:+,$QA_BASELINE} --out $R/qa16k
    done
  done
}
ppl() {  # LENGTH: the last 1,000 tokens of one essay window, teacher-forced through the decode path
  $E ppl --checkpoint $M --threads 2 --methods full,kivi-1bit,specache-1bit,specache-1bit-best,specache-2bit-best \
     --lengths $1 --n-eval 1000 --windows 1 --out $R/ppl
}
hit() {  # LENGTH "SAMPLES": needle prompts, 64 decode steps, one call per sample
  for s in $2; do
    $E hitrate --checkpoint $M --threads 2 --methods specache-1bit,specache-1bit-best,specache-2bit-best \
       --lengths $1 --samples $s --steps 64 --prompts needle --out $R/hitrate
  done
}
ppldocs() {  # LENGTH N_EVAL: ppl's window and caches over the essays again (the rows now keep every token's NLL, for
  # the intervals) and over the text of RULER's QA documents, SQuAD's then HotpotQA's; into ppl-tokens/. A scored
  # token costs about 4.6 s over the five caches at 16k, beside one 8-minute prefill a window.
  for t in essays squad hotpot; do
    $E ppl --checkpoint $M --threads 2 --methods full,kivi-1bit,specache-1bit,specache-1bit-best,specache-2bit-best \
       --lengths $1 --n-eval $2 --windows 1 --text $t --out $R/ppl-tokens
  done
}
hitqa() {  # LENGTH FIRST LAST: RULER's QA prompts (qa's, the same seed), samples FIRST..LAST (1-based), 64 decode
  # steps, one call per sample and task
  for i in $(seq $2 $3); do
    for t in qa_squad qa_hotpot; do
      $E hitrate --checkpoint $M --threads 2 --methods specache-1bit,specache-1bit-best,specache-2bit-best \
         --lengths $1 --samples $i --steps 64 --prompts $t --out $R/hitrate
    done
  done
}

for piece in "${@:-niah16k niah8k niah32k ruler16k ppl16k ppl32k hit16k hit32k}"; do
  for p in $piece; do
    case $p in
      niah8k@*) niah 8000 "${p#*@}" ;;
      niah16k@*) niah 16000 "${p#*@}" ;;
      niah32k@*) niah 32700 "${p#*@}" ;;
      niah8k) niah 8000 "$D10" ;;
      niah16k) niah 16000 "$D10" ;;
      niah32k) niah 32700 "$D5" ;;
      ruler16k) ruler 16000 4 ;;
      ruler16k@*) ruler 16000 "${p#*@}" ;;  # the first N samples of each task
      qa16k) qa 16000 1 20 ;;
      qa16k@*-*) r=${p#*@}; qa 16000 "${r%-*}" "${r#*-}" ;;  # samples A..B
      qa16k@*) qa 16000 1 "${p#*@}" ;;
      ppl16k) ppl 16000 ;;
      ppl32k) ppl 32700 ;;
      hit16k) hit 16000 "1" ;;
      hit32k) hit 32700 "1" ;;
      ppl16k-docs) ppldocs 16000 1000 ;;
      ppl16k-docs@*) ppldocs 16000 "${p#*@}" ;;
      hitqa16k) hitqa 16000 1 5 ;;
      hitqa16k@*-*) r=${p#*@}; hitqa 16000 "${r%-*}" "${r#*-}" ;;  # samples A..B
      hitqa16k@*) hitqa 16000 1 "${p#*@}" ;;
      *) echo "unknown piece $p" >&2; exit 1 ;;
    esac
  done
done
