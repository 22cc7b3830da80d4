"""How often a left-padded batch of different prompts changes a row's greedy answer.

Batches of 4 chat NIAH prompts of different lengths (SmolLM2-135M-Instruct, its chat template), each
row's padding (longest - its length) NOT a multiple of 64 (so not of any cache's residual window: 64
SpeCache, 128 KIVI), run once as one `generate.py --prompts-file` batch and each prompt alone
(`generate.py --prompt-file --chat`), for four caches. One JSON line per generate.py run in runs.jsonl
(resumable: runs already there are skipped); `python run.py --report` writes the counts.

    cd <repo root> && python results/ragged/2026-12-06-answers/run.py [--batches 8] [--report]

The prompts are tools/tasks.niah(tok, length, depth, "chat", needle), what `tools/eval.py prompt
--length L --depth D` prints for needle 0, with the needle drawn from tools/tasks.NEEDLES (0-4).
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

CKPT = ROOT / "checkpoints" / "smollm2-135m-instruct"
CACHES = {  # label -> generate.py flags
    "fp": ["--cache", "full"],
    "kivi-1bit": ["--cache", "kivi", "--bits", "1"],
    "specache-1bit": ["--cache", "specache", "--bits", "1", "--k", "64"],
    "preset-1bit": ["--cache", "specache-1bit-best"],
}
NEW_TOKENS = 32
SEED = 20261206
B = 4
LO, HI = 500, 1600  # prompt tokens
WINDOW = 64  # a padding that is a multiple of 64 would be exact for every cache here


def draw_batches(tok, n):
    from tasks import niah
    rng = random.Random(SEED)
    batches = []
    while len(batches) < n:
        specs = [dict(length=rng.randint(LO, HI), depth=round(rng.choice([0.1, 0.3, 0.5, 0.7, 0.9]), 1),
                      needle=rng.randrange(5)) for _ in range(B)]
        rows = []
        for s in specs:
            sample = niah(tok, s["length"], s["depth"], "chat", s["needle"])
            ids = tok.encode_prompt(sample.prompt, chat=True)
            rows.append(dict(s, prompt=sample.prompt, tokens=len(ids)))
        longest = max(r["tokens"] for r in rows)
        pads = [longest - r["tokens"] for r in rows]
        if sorted(pads)[1] == 0 or any(p and p % WINDOW == 0 for p in pads):
            continue  # two rows of the longest length, or a padding that would be exact: draw again
        for r, p in zip(rows, pads):
            r["pad"] = p
        batches.append(rows)
    return batches


def generate(argv):
    import generate as g
    t = time.perf_counter()
    out = g.main(argv)
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args()
    if a.report:
        return report()
    import torch
    from tokenizer import load_tokenizer
    torch.set_num_threads(2)
    tok = load_tokenizer(CKPT)
    batches = draw_batches(tok, a.batches)
    pdir = HERE / "prompts"
    pdir.mkdir(exist_ok=True)
    out_path = HERE / "runs.jsonl"
    done = set()
    if out_path.exists():
        done = {(r["batch"], r["cache"], r["run"]) for r in map(json.loads, out_path.read_text().splitlines())}
    for b, rows in enumerate(batches):
        bf = pdir / f"batch{b:02d}.jsonl"
        bf.write_text("".join(json.dumps({"role": "user", "content": r["prompt"]}) + "\n" for r in rows))
        for i, r in enumerate(rows):
            (pdir / f"batch{b:02d}-row{i}.txt").write_text(r["prompt"], encoding="utf-8")
        meta = [{k: r[k] for k in ("length", "depth", "needle", "tokens", "pad")} for r in rows]
        for label, flags in CACHES.items():
            common = ["--checkpoint", str(CKPT), "--max-new-tokens", str(NEW_TOKENS), "--json", "--quiet", *flags]
            runs = [("batch", ["--prompts-file", str(bf)])] + [
                (f"alone{i}", ["--prompt-file", str(pdir / f"batch{b:02d}-row{i}.txt"), "--chat"]) for i in range(B)]
            for run, extra in runs:
                if (b, label, run) in done:
                    continue
                res, wall = generate(common + extra)
                texts = res["texts"] if run == "batch" else [res["text"]]
                toks = res["tokens"] if run == "batch" else [res["tokens"]]
                rec = dict(batch=b, cache=label, cache_name=res["cache"], run=run, rows=meta, texts=texts, tokens=toks,
                           prompt_tokens=res["prompt_tokens"], resyncs=res["resyncs"],
                           spec_exact_hit_rate=res["spec_exact_hit_rate"], wall_s=round(wall, 2),
                           argv=["python", "generate.py", *common, *extra])
                with out_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"batch {b} {label} {run}: {wall:.1f}s {texts}", flush=True)


def report():
    """counts.json and the tables of results.md: per cache, over the rows whose padding is not a multiple of 64
    (three of each batch's four), how many gave other greedy tokens than the prompt alone, and how many changed
    the needle's score (right = all three key phrases, tools/tasks.niah_score); the longest rows (padding 0)
    apart, as the check that a batch of exact rows equals alone."""
    from tasks import NEEDLES, niah_score, wilson
    recs = [json.loads(line) for line in (HERE / "runs.jsonl").read_text().splitlines()]
    by = {(r["batch"], r["cache"], r["run"]): r for r in recs}
    out = {}
    detail = []
    for label in CACHES:
        c = dict(n_padded=0, differ=0, score_changed=0, right_to_wrong=0, wrong_to_right=0, right_alone=0,
                 right_batch=0, n_longest=0, longest_differ=0, rows=[])
        for b in sorted({r["batch"] for r in recs}):
            if (b, label, "batch") not in by or any((b, label, f"alone{i}") not in by for i in range(B)):
                continue  # (a batch not finished)
            batch = by[(b, label, "batch")]
            for i, meta in enumerate(batch["rows"]):
                alone = by[(b, label, f"alone{i}")]
                assert alone["prompt_tokens"] == meta["tokens"] == batch["prompt_tokens"][i]
                phrases = NEEDLES[meta["needle"]].phrases
                tb, ta = batch["texts"][i], alone["texts"][0]
                sb, sa = niah_score(tb, phrases), niah_score(ta, phrases)
                same = batch["tokens"][i] == alone["tokens"][0]
                first = next((j for j, (x, y) in enumerate(zip(batch["tokens"][i], alone["tokens"][0])) if x != y),
                             None if same else min(len(batch["tokens"][i]), len(alone["tokens"][0])))
                c["rows"].append(dict(batch=b, row=i, pad=meta["pad"], tokens=meta["tokens"], needle=meta["needle"],
                                      same_tokens=same, first_diff=first, score_batch=sb, score_alone=sa))
                detail.append((label, b, i, meta, same, first, sa, sb, ta, tb))
                if meta["pad"] == 0:  # the longest row: its padding 0 is exact
                    c["n_longest"] += 1
                    c["longest_differ"] += not same
                    continue
                c["n_padded"] += 1
                c["differ"] += not same
                c["score_changed"] += sb != sa
                c["right_to_wrong"] += sa == 1 and sb < 1
                c["wrong_to_right"] += sa < 1 and sb == 1
                c["right_alone"] += sa == 1
                c["right_batch"] += sb == 1
        out[label] = c
    (HERE / "counts.json").write_text(json.dumps(out, indent=1) + "\n")

    def fmt(k, n):
        lo, hi = wilson(k / n, n) if n else (0, 1)
        return f"{k} / {n} ({100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}])" if n else "-"
    print("| cache | padded rows whose greedy tokens differ from alone | needle score changed | right -> wrong | "
          "wrong -> right | right alone / in the batch | longest rows (padding 0) that differ |")
    print("|---|---|---|---|---|---|---|")
    for label, c in out.items():
        n = c["n_padded"]
        print(f"| {label} ({by[next(k for k in by if k[1] == label)]['cache_name']}) | {fmt(c['differ'], n)} | "
              f"{fmt(c['score_changed'], n)} | {fmt(c['right_to_wrong'], n)} | {fmt(c['wrong_to_right'], n)} | "
              f"{c['right_alone']} / {c['right_batch']} | {c['longest_differ']} / {c['n_longest']} |")
    print("\nEvery row (score: the share of the needle's three key phrases, alone -> in the batch; first token that "
          "differs, counted from the first new token):\n")
    print("| cache | batch | row | prompt tokens | padding | needle | same tokens | first difference | score alone -> batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, b, i, meta, same, first, sa, sb, ta, tb in detail:
        print(f"| {label} | {b} | {i} | {meta['tokens']} | {meta['pad']} | {meta['needle']} | {'yes' if same else 'no'} | "
              f"{'' if same else first} | {sa:.2f} -> {sb:.2f} |")

if __name__ == "__main__":
    main()
