"""The docs' figures, regenerated from the raw results committed under results/.

    python tools/figures.py [--results results] [--out docs]

Writes docs/h100-step-time.png, docs/h100-kernels.png, docs/niah.png, docs/hitrate-per-layer.png,
docs/long-context-niah.png, docs/baselines-score-vs-bytes.png, docs/qwen-qa.png and docs/vllm-capacity.png.
Every number comes from a results file (JSON/JSONL; the 2026-11-22 kernel table exists only as markdown,
so that one is parsed). A missing input ends with one `error:` line naming what is missing.
"""
import argparse
import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python tools/figures.py` puts tools/ first; the baselines figure imports tools.baselines_grid
CPU = "CPU (2-core AMD EPYC), fp32, SmolLM2-135M-Instruct"
PRESET = "lsq-resync-rr2-g32-sink4"  # `--preset best` spelled out (config.py)
NAMES = {  # canonical cache names -> what the figures call them, in plotting order
    "full": "fp16 cache (full)",
    "kivi-1bit": "KIVI 1-bit",
    "specache-1bit": "SpeCache 1-bit, paper config",
    "specache-1bit-lsq-resync-k96-g32-r32-sink4": "k96 preset (before 2026-11-23)",
    f"specache-1bit-{PRESET}": "--preset best (re-ranking, k 64)",
}


class MissingInput(FileNotFoundError):
    """A results file a figure needs is not there."""


def run_name(folder: Path) -> str:
    """gpu-h100-2026-11-23b -> '2026-11-23, second run' (when the date has more than one folder)."""
    m = re.fullmatch(r"gpu-h100-(\d{4}-\d{2}-\d{2})([a-z]?)", folder.name)
    if not m:
        return folder.name
    same_day = list(folder.parent.glob(f"gpu-h100-{m[1]}*"))
    if len(same_day) < 2:
        return m[1]
    nth = ["first", "second", "third", "fourth"][" bcd".index(m[2] or " ")]
    return f"{m[1]}, {nth} run"


def commit_days(path: Path, *log_args: str) -> list:
    """The days of the commits that touched a path, newest first (none outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", *log_args, "--format=%ad", "--date=short",
                              "--", str(path.resolve())], capture_output=True, text=True, timeout=20)
        return out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        return []


def run_date(path: Path) -> str:
    """The day a results folder was first committed (else its file's modification day)."""
    days = commit_days(path, "--diff-filter=A")
    return days[-1] if days else datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()


def commit_span(*paths: Path) -> str:
    """The days results files were committed, first to last ("2026-12-02 to 2026-12-06", or one day)."""
    days = [d for path in paths for d in commit_days(path)]
    if not days:
        return run_date(paths[0])
    first, last = min(days), max(days)
    return first if first == last else f"{first} to {last}"


def read_jsonl(folder: Path):
    f = folder / "results.jsonl"
    if not f.exists():
        raise MissingInput(f"{f} (run the eval command that writes it; see docs/results.md)")
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def save(fig, out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def step_time(results: Path, out: Path):
    """H100 compiled step time per cache, one bar per cache and run, with each cache's byte floor."""
    files = sorted(results.glob("gpu-h100-*/**/s-*.json"))
    if not files:
        raise MissingInput(f"H100 step results (s-*.json) under {results}/gpu-h100-*/")
    bars, gpus = [], set()
    for f in files:
        d = json.loads(f.read_text())
        run = run_name(next(p for p in f.parents if p.name.startswith("gpu-h100-")))
        gpus.add(d["environment"].get("gpu", "?"))
        for g in d["grid"]:
            label = NAMES.get(g["label"], g["label"])
            if "_rerank_rows_kernel" in g.get("profile", {}).get("kernels_us_per_step", {}):
                label += " [first re-rank kernel]"
            order = list(NAMES).index(g["label"]) if g["label"] in NAMES else len(NAMES)
            bars.append((run, order, label, g["step_ms_median"], g.get("floor_ms_h100"), g["context"], g["batch"]))
    bars.sort(key=lambda b: (b[0], b[1]))
    runs = list(dict.fromkeys(b[0] for b in bars))
    colors = dict(zip(runs, plt.cm.tab10.colors))
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(bars) + 1.6))
    y = np.arange(len(bars))[::-1]
    ax.barh(y, [b[3] for b in bars], color=[colors[b[0]] for b in bars])
    for yi, b in zip(y, bars):
        ax.text(b[3] + 0.15, yi, f"{b[3]:.2f} ms", va="center", fontsize=8)
        if b[4]:
            ax.plot([b[4]] * 2, [yi - 0.4, yi + 0.4], color="black", lw=2)
    ax.set_yticks(y, [f"{b[2]}  ({b[0]})" for b in bars], fontsize=8)
    ax.set_xlabel("compiled decode step, ms (median; black tick: byte floor at 3.35 TB/s)")
    ax.set_xlim(0, max(b[3] for b in bars) * 1.18)
    ctx = sorted({f"{b[5] // 1024}k, batch {b[6]}" for b in bars})
    ax.set_title(f"Compiled decode step on {', '.join(sorted(gpus))}, Llama-3.1-8B shapes, random bf16 weights, "
                 f"{'; '.join(ctx)}\n"
                 f"runs of {'; '.join(runs)}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out)


def parse_kernel_md(path: Path) -> dict:
    """A `tools/bench.py --kernels` markdown table -> the same shape as its JSON (`environment`, `kernels`)."""
    text = path.read_text()
    head = re.search(r"^# bench\.py: cuda \((.*?)\).*?(\d{4}-\d{2}-\d{2})T", text, re.M)
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    if not head or not rows or rows[0][0] != "kernel":
        raise MissingInput(f"a `tools/bench.py --kernels` table in {path}")
    col = {name: i for i, name in enumerate(rows[0])}
    num = lambda s: float(s.split()[0].replace(",", ""))  # noqa: E731  ("48.6 (47.7)" -> 48.6)
    return dict(environment=dict(gpu=head[1], date=head[2]),
                kernels=[dict(kernel=r[col["kernel"]], context=int(num(r[col["context"]])), us=num(r[col["us (min)"]]),
                              floor_us_h100=num(r[col["floor H100 us"]])) for r in rows[1:]])


def kernels(results: Path, out: Path):
    """Each kernel alone (CUDA-graph replays) against its H100 byte floor, one bar per run."""
    runs = {}
    for folder in sorted(results.glob("gpu-h100-*")):
        found = sorted(folder.rglob("kernels*.json")) or sorted(folder.rglob("kernels*.md"))
        for f in found[:1]:
            runs[run_name(folder)] = json.loads(f.read_text()) if f.suffix == ".json" else parse_kernel_md(f)
    if not runs:
        raise MissingInput(f"H100 kernel results (kernels*.json or kernels*.md) under {results}/gpu-h100-*/")
    names = list(dict.fromkeys(k["kernel"] for d in runs.values() for k in d["kernels"]))
    floors = {k["kernel"]: k["floor_us_h100"] for d in runs.values() for k in d["kernels"]}
    fig, ax = plt.subplots(figsize=(9, 0.75 * len(names) + 1.6))
    h = 0.8 / len(runs)
    for i, (run, d) in enumerate(runs.items()):
        us = {k["kernel"]: k["us"] for k in d["kernels"]}
        for j, name in enumerate(names):
            if name in us:
                yj = len(names) - 1 - j + 0.4 - h * (i + 0.5)
                ax.barh(yj, us[name], height=h, color=plt.cm.tab10.colors[i], label=run)
                ax.text(us[name] * 1.05, yj, f"{us[name]:.1f}", va="center", fontsize=7)
    for j, name in enumerate(names):
        yj = len(names) - 1 - j
        ax.plot([floors[name]] * 2, [yj - 0.45, yj + 0.45], color="black", lw=2,
                label="byte floor at 3.35 TB/s" if j == 0 else None)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names))[::-1], names, fontsize=8)
    ax.set_xlabel("us per layer (log scale)")
    gpus = sorted({d["environment"].get("gpu", "?") for d in runs.values()})
    ctx = sorted({k["context"] for d in runs.values() for k in d["kernels"]})
    ax.set_title(f"Kernels alone on {', '.join(gpus)}, Llama-3.1-8B shapes, bf16, batch 1, "
                 f"{'/'.join(f'{c // 1024}k' for c in ctx)}\nruns of {'; '.join(runs)}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    ax.legend(keep.values(), keep.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(axis="x", alpha=0.3, which="both")
    return save(fig, out)


NIAH_DIRS = ["policies/niah", "policies/niah-busbytes-bits1", "policies/niah-busbytes-bits2",
             "policies/niah-busbytes-8k"]


def niah_cells(results: Path, dirs) -> tuple[dict, dict]:
    """{(method, depth, length): score} and {method: run date} of the NIAH results in `dirs`."""
    cells, when = {}, {}
    for sub in dirs:
        folder = results / sub
        for r in read_jsonl(folder):
            cells.setdefault((r["method"], r["depth"], r["length"]), r["score"])
            when.setdefault(r["method"], run_date(folder))
    return cells, when


def niah_heatmaps(cells, when, dirs, avg_lengths, suptitle):
    """Two rows (1 and 2 bits) of heatmaps (depth x length): fp16, KIVI, SpeCache paper config, the
    preset; each titled with its mean score over the lengths avg_lengths picks."""
    rows = [[("full", "fp16 cache"), (f"kivi-{b}bit", f"KIVI {b}-bit"),
             (f"specache-{b}bit", f"SpeCache {b}-bit, paper"), (f"specache-{b}bit-{PRESET}", f"{b}-bit --preset best")]
            for b in (1, 2)]
    lengths = sorted({k[2] for k in cells})
    depths = sorted({k[1] for k in cells})
    avg_cols, avg_name = avg_lengths(lengths)
    fig, axes = plt.subplots(2, 4, figsize=(13, 7.4), sharey=True, gridspec_kw=dict(hspace=0.45))
    for ax_row, panels in zip(axes, rows):
        for ax, (method, title) in zip(ax_row, panels):
            if method not in when:
                raise MissingInput(f"NIAH cells of {method} in {', '.join(dirs)}")
            grid = np.array([[cells.get((method, d, n), np.nan) for n in lengths] for d in depths])
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                if not np.isnan(v):
                    ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [f"{n / 1000:g}k" for n in lengths], fontsize=8)
            ax.set_title(f"{title}\n(avg {avg_name} {100 * np.nanmean(grid[:, avg_cols]):.1f}; {when[method]})", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_yticks(range(len(depths)), [f"{round(100 * d)}%" for d in depths], fontsize=8)
        ax.set_ylabel("needle depth")
    fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.02, label="score (share of the needle's key phrases)")
    fig.suptitle(suptitle, fontsize=10)
    return fig


def niah(results: Path, out: Path):
    """Needle-in-a-haystack heatmaps of the default model (1k-8k): fp16, KIVI, SpeCache paper config, the preset."""
    cells, when = niah_cells(results, NIAH_DIRS)
    return save(niah_heatmaps(cells, when, NIAH_DIRS, lambda ns: ([n <= 4000 for n in ns], "1k-4k"),
                              f"Needle in a haystack, {CPU}, greedy; context length on x (blank: not run)"), out)


LONG_NIAH_DIRS = ["long-context/niah"]


def long_context_niah(results: Path, out: Path):
    """The same heatmaps for Gemma 3 270M (base, 32k context) at 8k, 16k and 32k, completion prompts."""
    cells, when = niah_cells(results, LONG_NIAH_DIRS)
    return save(niah_heatmaps(cells, when, LONG_NIAH_DIRS, lambda ns: ([True] * len(ns), "8k-32k"),
                              "Needle in a haystack, Gemma 3 270M (base), CPU (2-core AMD EPYC), fp32, greedy, completion prompts; "
                              "context length on x"), out)


def hitrate_per_layer(results: Path, out: Path):
    """Per layer: share of the real token's exact top-k that the fetched rows hold (essay prompts, 2k)."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
    days = set()
    for ax, b in zip(axes, (1, 2)):
        lines = [(f"hitmass-paper-bits{b}", f"specache-{b}bit", "layer_hit", "paper config", "-"),
                 (f"hitmass-bits{b}", f"specache-{b}bit-lsq-resync-k96-g32-r32-sink4", "layer_hit", "k96 preset", "-"),
                 (f"busbytes-bits{b}", f"specache-{b}bit-{PRESET}", "layer_hit", "--preset best", "-"),
                 (f"busbytes-bits{b}", f"specache-{b}bit-{PRESET}", "layer_hit_mass", "--preset best, most-mass rule",
                  "--")]
        for sub, method, key, label, style in lines:
            folder = results / "policies" / sub
            recs = [r for r in read_jsonl(folder) if r["method"] == method and r.get("prompt") == "essay"]
            if not recs or key not in recs[0]:
                raise MissingInput(f"{key} of {method} (essay) in {folder}/results.jsonl")
            per = np.nanmean(np.array([[np.nan if v is None else v for v in r[key]] for r in recs], float), axis=0)
            ax.plot(range(len(per)), 100 * per, style, lw=1.4, label=f"{label} (mean {100 * np.nanmean(per):.1f})")
            days.add(run_date(folder))
        target = 80 if b == 1 else 90  # the hit-rate targets: 80% at 1 bit, 90% at 2 bits
        ax.axhline(target, color="grey", ls=":", lw=1, label=f"target for the mean ({target}%)")
        ax.set_title(f"{b}-bit", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    axes[0].set_ylabel("top-k hit % (vs the exact top-k)")
    fig.suptitle(f"Top-k hit rate per layer, {CPU}; 2k-token essay prompts, 100 decode steps; "
                 f"{', '.join(sorted(days))}", fontsize=10)
    return save(fig, out)


BASELINES_DIR = "baselines/2026-11-27-gemma"  # the grid docs/baselines.md reports


def baselines(results: Path, out: Path):
    """Score (95% interval) against 16-bit device bytes for every method of the baselines' grid: the points
    `tools/baselines_grid.py report` wrote to summary.json, drawn as its own figure draws them."""
    from tools.baselines_grid import figure
    path = results / BASELINES_DIR / "summary.json"
    if not path.exists():
        raise MissingInput(f"{path} (tools/baselines_grid.py report --out {path.parent} ... writes it)")
    figure(json.loads(path.read_text()), out)
    return out


QA_DIR = "qwen/qa16k"  # RULER's question answering over real documents, Qwen2.5-Coder-1.5B-Instruct at 16k
QA_NAMES = {"full": "fp16 cache", "kivi-1bit": "KIVI 1-bit", "kivi-2bit": "KIVI 2-bit",
            "specache-1bit": "SpeCache 1-bit, paper", "specache-2bit": "SpeCache 2-bit, paper",
            f"specache-1bit-{PRESET}": "SpeCache 1-bit, --preset best",
            f"specache-2bit-{PRESET}": "SpeCache 2-bit, --preset best",
            "infllm-p128-repr4@specache-1bit-best": "InfLLM-style at the 1-bit preset's bytes",
            "snapkv+qa@specache-1bit-best": "SnapKV with the question at the 1-bit preset's bytes"}
QA_PRESSES_DIR = "qwen/baselines-qa"  # the kvpress venv's rows on the same prompts (results/qwen/baselines/run-qa.sh)


def qa(results: Path, out: Path):
    """RULER qa_squad / qa_hotpot at 16k: each cache's share of answers holding a gold answer, Wilson's 95%
    interval over the samples (n under each bar), one bar per task and cache; SnapKV's bars where its rows are there."""
    from tools.tasks import wilson
    rows = read_jsonl(results / QA_DIR)
    files = [results / QA_DIR / "results.jsonl"]
    if (results / QA_PRESSES_DIR / "results.jsonl").exists():
        rows += [r for r in read_jsonl(results / QA_PRESSES_DIR) if r.get("cmd") == "ruler"]
        files.append(results / QA_PRESSES_DIR / "results.jsonl")
    tasks = ("qa_squad", "qa_hotpot")
    methods = [m for m in QA_NAMES if any(r["method"] == m for r in rows)]
    if not methods:
        raise ValueError(f"{results / QA_DIR}: no rows of the caches {sorted(QA_NAMES)}")
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(tasks)
    for j, task in enumerate(tasks):
        for i, m in enumerate(methods):
            scores = [r["score"] for r in rows if r["method"] == m and r["task"] == task]
            if not scores:
                continue
            p = sum(scores) / len(scores)
            lo, hi = wilson(p, len(scores))
            x = i + (j - (len(tasks) - 1) / 2) * width
            ax.bar(x, 100 * p, width, color=f"C{j}", label=task if i == 0 else None)
            ax.errorbar(x, 100 * p, yerr=[[100 * (p - lo)], [100 * (hi - p)]], color="k", capsize=3, lw=1)
            ax.text(x, 2, f"n={len(scores)}", ha="center", fontsize=7, rotation=90, color="w")
    ax.set_xticks(range(len(methods)), [QA_NAMES[m] for m in methods], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("answers with a gold answer (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    ax.set_title("RULER QA at 16k, Qwen2.5-Coder-1.5B-Instruct (chat, greedy; CPU fp32); Wilson 95% intervals; "
                 f"{commit_span(*files)}", fontsize=9)
    return save(fig, out)


VLLM_DIR = "vllm/2026-12-06-cpu"


def vllm(results: Path, out: Path):
    """vLLM at one KV budget: each cache's maximum concurrency at max_model_len (the engine's own count) and the
    requests it ran at once, beside the batch's tokens/s (tools/bench_vllm.py)."""
    path = results / VLLM_DIR / "bench.jsonl"
    if not path.exists():
        raise MissingInput(f"{path}: the vLLM benchmark's rows (tools/bench_vllm.py --out)")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    names = {"full": "vLLM's own attention (fp32 pages)", "kivi-1bit": "KIVI 1-bit pages", "specache-1bit-lag": "SpeCache 1-bit pages (lag)"}
    labels = [names.get(r["cache"], r["cache"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(len(rows))
    a1.bar(x - 0.2, [r["max_concurrency"] for r in rows], 0.4, label="max concurrency (engine's count)")
    a1.bar(x + 0.2, [r["most_running"] for r in rows], 0.4, label=f"requests run at once (of {rows[0]['requests']})")
    a1.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    a1.legend(fontsize=8)
    a1.set_title(f"{rows[0]['kv_bytes'] / 1e6:.0f} MB of KV, requests of {rows[0]['max_model_len']} tokens", fontsize=9)
    a2.bar(x, [r["tokens_per_s"] for r in rows], 0.5, color="C2")
    a2.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    a2.set_ylabel("tokens/s (prompt + new), the batch")
    a2.set_title(f"{rows[0]['requests']} requests of {rows[0]['prompt_tokens']} + {rows[0]['new_tokens']} tokens; one run each",
                 fontsize=9)
    fig.suptitle(f"SmolLM2-135M in vLLM 0.32 (CPU, 2 cores, fp32), {commit_span(path)}", fontsize=10)
    return save(fig, out)


FIGURES = {"h100-step-time.png": step_time, "h100-kernels.png": kernels, "niah.png": niah,
           "hitrate-per-layer.png": hitrate_per_layer, "long-context-niah.png": long_context_niah,
           "baselines-score-vs-bytes.png": baselines, "qwen-qa.png": qa, "vllm-capacity.png": vllm}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "results")
    p.add_argument("--out", type=Path, default=ROOT / "docs")
    a = p.parse_args(argv)
    try:
        for name, fn in FIGURES.items():
            print(fn(a.results, a.out / name))
    except (MissingInput, KeyError, ValueError) as e:
        print(f"error: figures.py: missing or malformed input: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
