"""The QA hit-rate table of docs/long-context.md from results/qwen/hitrate/results.jsonl: for each SpeCache cache and
RULER QA task (and both pooled), the mean over decode steps and layers of the top-k hit rate (the share of the real
token's exact top-k that the fetched fp rows hold) with the range of the prompts' own means, the attention output's
relative error (with the fetched rows, with the exact top-k, with no fp rows), how often the speculative token was
the real one, and the range of the per-layer hit rates (each prompt's layer mean weighed by its steps, as the report's
per-layer table). From the repository root:
    python results/qwen/hit_table.py [results/qwen/hitrate/results.jsonl]"""
import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"specache-1bit": "SpeCache 1-bit, paper",
         "specache-1bit-lsq-resync-rr2-g32-sink4": "SpeCache 1-bit, `--preset best`",
         "specache-2bit-lsq-resync-rr2-g32-sink4": "SpeCache 2-bit, `--preset best`"}
TASKS = {"qa_squad": "SQuAD", "qa_hotpot": "HotpotQA"}


def steps(r, key):
    return [v for v in r.get(key) or [] if v is not None]


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def step_mean(rs, key):
    vs = [v for r in rs for v in steps(r, key)]
    return sum(vs) / len(vs) if vs else None


def layer_means(rs):
    w = [len(steps(r, "hit")) for r in rs]
    n = min(len(r["layer_hit"]) for r in rs)
    return [sum(wi * r["layer_hit"][i] for wi, r in zip(w, rs)) / sum(w) for i in range(n)] if sum(w) else []


def row(name, task, rs):
    own = [m for m in (step_mean([r], "hit") for r in rs) if m is not None]
    layers = layer_means(rs)
    span = f"{100 * min(own):.0f}-{100 * max(own):.0f}%" if own else "-"
    lay = f"{100 * min(layers):.0f}-{100 * max(layers):.0f}%" if layers else "-"
    return (f"| {name} | {task} | {len(rs)} | {sum(len(steps(r, 'hit')) for r in rs)} | {pct(step_mean(rs, 'hit'))} | "
            f"{span} | {pct(step_mean(rs, 'err'))} | {pct(step_mean(rs, 'err_topk'))} | {pct(step_mean(rs, 'err_none'))} | "
            f"{pct(step_mean(rs, 'exact'))} | {lay} |")


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
