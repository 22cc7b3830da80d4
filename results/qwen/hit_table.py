"""The QA hit-rate table of docs/long-context.md from results/qwen/hitrate/results.jsonl: for each SpeCache cache and
RULER QA task (and both pooled), the mean over decode steps and layers of the top-k hit rate (the share of the real
token's exact top-k that the fetched fp rows hold) with the range of the prompts' own means, the attention output's
relative error (with the fetched rows, with the exact top-k, with no fp rows), how often the speculative token was
the real one, and the range of the per-layer hit rates (each prompt's layer mean weighed by its steps, as the report's
per-layer table). From the repository root:
    python results/qwen/hit_table.py [results/qwen/hitrate/results.jsonl]"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.eval_report import layer_series, step_mean  # noqa: E402  (the report's own means)

NAMES = {"specache-1bit": "SpeCache 1-bit, paper",
         "specache-1bit-lsq-resync-rr2-g32-sink4": "SpeCache 1-bit, `--preset best`",
         "specache-2bit-lsq-resync-rr2-g32-sink4": "SpeCache 2-bit, `--preset best`"}
TASKS = {"qa_squad": "SQuAD", "qa_hotpot": "HotpotQA"}


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def span(xs):
    xs = [x for x in xs if x is not None]
    return f"{100 * min(xs):.0f}-{100 * max(xs):.0f}%" if xs else "-"


def row(name, task, rs):
    layers = layer_series([dict(r, prompt="pooled") for r in rs])  # one series: the records' tasks pooled
    steps = sum(v is not None for r in rs for v in r.get("hit") or [])
    return (f"| {name} | {task} | {len(rs)} | {steps} | {pct(step_mean(rs, 'hit'))} | "
            f"{span(step_mean([r], 'hit') for r in rs)} | {pct(step_mean(rs, 'err'))} | {pct(step_mean(rs, 'err_topk'))} | "
            f"{pct(step_mean(rs, 'err_none'))} | {pct(step_mean(rs, 'exact'))} | {span(next(iter(layers.values()), []))} |")


def main(path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("prompt") in TASKS]
    print("| cache | task | prompts | steps | hit | prompts' means | output error | with the exact top-k | "
          "with no fp rows | speculative token right | hit, layers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, name in NAMES.items():
        mine = [r for r in rows if r["method"] == m]
        for t, task in TASKS.items():
            if any(r["prompt"] == t for r in mine):
                print(row(name, task, [r for r in mine if r["prompt"] == t]))
        if mine:
            print(row(name, "both", mine))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="?", type=Path, default=ROOT / "results/qwen/hitrate/results.jsonl")
    main(p.parse_args().rows)
