"""The QA table of docs/long-context.md from results/qwen/qa16k/results.jsonl: each cache's score per task and
pooled (x100, Wilson's 95% interval, n answers), its answers paired with the fp cache's on the same samples (right
where the fp cache is wrong / wrong where it is right, with the exact two-sided sign test's p on those counts, and
that p Holm-adjusted over the table's paired tests, one a cache), and its resyncs over its decode steps. Only samples the fp cache answered are paired. The presses run in the kvpress
venv on the same prompts (results/qwen/baselines-qa, results/qwen/baselines/run-qa.sh) join the table when their rows
are there: kvpress's `no_press` (transformers' fp cache) and SnapKV with the question, paired with the project's fp
cache too. `--against METHOD` pairs every cache with another cache instead of the fp cache. From the repository root:
    python results/qwen/qa_table.py [results/qwen/qa16k/results.jsonl] [--presses results/qwen/baselines-qa/results.jsonl]
                                    [--against specache-1bit-lsq-resync-rr2-g32-sink4]"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.tasks import fmt_interval, sign_test_p, wilson  # noqa: E402

NAMES = {"full": "fp16 (fp32 here)", "kivi-1bit": "KIVI 1-bit", "kivi-2bit": "KIVI 2-bit",
         "specache-1bit": "SpeCache 1-bit, paper", "specache-2bit": "SpeCache 2-bit, paper",
         "specache-1bit-lsq-resync-rr2-g32-sink4": "SpeCache 1-bit, `--preset best`",
         "specache-2bit-lsq-resync-rr2-g32-sink4": "SpeCache 2-bit, `--preset best`",
         "infllm-p128-repr4@specache-1bit-best": "InfLLM-style at the 1-bit preset's bytes",
         "no_press": "kvpress `no_press` (transformers' fp cache)",
         "snapkv+qa@specache-1bit-best": "SnapKV with the question at the 1-bit preset's bytes"}
TASKS = ("qa_squad", "qa_hotpot")


def cell(scores):
    if not scores:
        return "-"
    p = sum(scores) / len(scores)
    return f"{fmt_interval((p, *wilson(p, len(scores))))} ({len(scores)})"


def holm(ps):
    """Holm's step-down adjustment of p-values (the family-wise error rate over all of them): the i-th smallest of
    m times (m - i + 1), made monotone in that order and capped at 1. Returned in the order given."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, run = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = run
    return out


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def press_rows(path, by):
    """The presses' rows on the QA tasks, checked to be the prompts the project's rows answer (same length in
    tokens, same gold answers): a press row of another prompt would pair wrongly, so it stops the table."""
    rows = [r for r in read(path) if r.get("cmd") == "ruler" and r["task"] in TASKS and r["method"] in NAMES]
    for r in rows:
        fp = by.get(("full", r["task"], r["sample"]))
        if fp and (fp["prompt_tokens"], fp["answers"]) != (r["prompt_tokens"], r["answers"]):
            sys.exit(f"{path}: {r['task']} sample {r['sample']} is not the prompt of the project's rows "
                     f"({r['prompt_tokens']} tokens, answers {r['answers']}; the project's: {fp['prompt_tokens']}, "
                     f"{fp['answers']})")
    return rows


def main(path, presses=None, against="full"):
    by = {(r["method"], r["task"], r["sample"]): r for r in read(path)}
    if presses and Path(presses).is_file():
        by.update({(r["method"], r["task"], r["sample"]): r for r in press_rows(presses, by)})
    present = {m for m, _, _ in by}
    methods = [m for m in NAMES if m in present]
    if against not in methods:
        sys.exit(f"--against {against}: no rows of it; the caches here: {', '.join(methods)}")
    other = "fp" if against == "full" else NAMES[against]
    print(f"| cache | SQuAD | HotpotQA | pooled | right where {other} is wrong / wrong where {other} is right "
          "(sign test p) | Holm-adjusted p | resyncs / steps |")
    print("|---|---|---|---|---|---|---|")
    lines, ps = [], []
    for m in methods:
        per = {t: [r["score"] for (mm, tt, _), r in sorted(by.items()) if mm == m and tt == t] for t in TASKS}
        keys = [k for k in by if k[0] == m]
        pairs = [(by[k]["score"], by[(against, k[1], k[2])]["score"]) for k in keys if (against, k[1], k[2]) in by]
        gain = sum(1 for c, f in pairs if c > f)
        loss = sum(1 for c, f in pairs if c < f)
        res = sum(by[k].get("resyncs") or 0 for k in keys)
        steps = sum(by[k].get("decode_steps") or 0 for k in keys)
        p = None if m == against else sign_test_p(gain, loss)
        ps += [] if p is None else [p]
        paired = "" if p is None else f"{gain} / {loss} of {len(pairs)} (p = {p:.2g})"
        counted = f"{res} / {steps}" if steps else ""  # the presses' rows count no decode steps
        lines.append((f"| {NAMES[m]} | {cell(per['qa_squad'])} | {cell(per['qa_hotpot'])} | "
                      f"{cell(per['qa_squad'] + per['qa_hotpot'])} | {paired} | ", p is not None, f" | {counted} |"))
    adjusted = iter(holm(ps))  # over the paired tests in the table, in its order
    for head, is_paired, tail in lines:
        print(head + (f"{next(adjusted):.2g} (of {len(ps)})" if is_paired else "") + tail)

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="?", type=Path, default=ROOT / "results/qwen/qa16k/results.jsonl")
    p.add_argument("--presses", type=Path, default=ROOT / "results/qwen/baselines-qa/results.jsonl",
                   help="the kvpress venv's rows on the same prompts (left out where the file is not there)")
    p.add_argument("--against", default="full", choices=list(NAMES),
                   help="the cache every other is paired with on the same samples (default: the fp cache)")
    a = p.parse_args()
    main(a.rows, a.presses, a.against)
