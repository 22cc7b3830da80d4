"""tools/eval.py's results and tables: the results file (one JSON line per finished cell, resumable; under
torchrun the cells spread over the ranks, one file each, folded into one; `run_cells` runs them, a batch of
prompts at a time if asked), the markdown report of
each subcommand and its plots (NIAH heatmap, per-layer hit rates)."""
import json
import math
import sys
import textwrap
import time
from pathlib import Path

import torch

from integrations import tp
from tools.tasks import KEY_PHRASES, RULER_TASKS, fmt_interval, wilson


class Results:
    def __init__(self, out_dir: Path, name="results.jsonl"):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / name
        self.records = []
        text = self.path.read_text() if self.path.exists() else ""
        if text and not text.endswith("\n"):  # end a line cut by an interruption before appending
            with open(self.path, "a") as f:
                f.write("\n")
        for line in text.splitlines():
            try:
                self.records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by an interruption: that cell reruns
                pass
        self.done = {r["key"] for r in self.records if "key" in r}

    @staticmethod
    def key(fields: dict) -> str:
        return json.dumps(fields, sort_keys=True)

    def add(self, key: str, record: dict):
        record = dict(record, key=key)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self.done.add(key)

    def of(self, cmd: str) -> list[dict]:
        return [r for r in self.records if r.get("cmd") == cmd]

    def write_md(self, title: str, *blocks: str):
        (self.dir / "results.md").write_text("\n\n".join([f"# {title}", *blocks]) + "\n")


# ---- cells over ranks: one results file ------------------------------------------------------------
def init_cells(device, results_path: Path):
    """tools/eval.py, under torchrun or not: one whole model per rank (gloo carries only barriers).
    Rank 0 first folds in the rank files a killed run left, so every rank resumes from them."""
    if tp.launched() > 1:
        device = tp.init(None, device, backend="gloo")
    if tp.rank() == 0:
        fold_rank_files(results_path)
    if tp.world() > 1:
        tp.barrier()
    return device


def my_cells(todo: list) -> list:
    """A contiguous 1/N of the cells (cells are prompt-major: neighbours share a prefill)."""
    n, r = tp.world(), tp.rank()
    return todo[r * len(todo) // n:(r + 1) * len(todo) // n]


def rank_file(results) -> Path:
    return results.dir / f"{results.path.stem}.rank{tp.rank()}.jsonl"


def fold_rank_files(results_path: Path):
    """Append the per-rank files of a run (finished or killed) to the one results file, then remove
    them: a rerun resumes from every cell any rank finished."""
    parts = sorted(results_path.parent.glob(f"{results_path.stem}.rank*.jsonl"))
    if not parts:
        return
    text = results_path.read_text() if results_path.exists() else ""
    with open(results_path, "a") as out:
        if text and not text.endswith("\n"):
            out.write("\n")
        for part in parts:
            lines = [ln for ln in part.read_text().splitlines() if ln.endswith("}")]  # a cut last line reruns
            out.write("".join(ln + "\n" for ln in lines))
    for part in parts:
        part.unlink()


def run_cells(cells, results: Results, fn, desc: str, batch: int = 1):
    """cells: [(key fields, payload)]; fn(fields, payload) -> record. Skips cells already in the results.
    batch > 1: fn([(fields, payload)]) -> [record] for the cells of up to `batch` prompts and one method at a
    time (cells with the same fields but the method's and the prompt's: `batches`)."""
    from tqdm import tqdm

    todo = [(f, p) for f, p in cells if Results.key(f) not in results.done]
    if len(todo) < len(cells):
        print(f"{len(cells) - len(todo)} of {len(cells)} cells already in {results.path}: skipped", file=sys.stderr)
    begin_cells(results)  # under torchrun: each rank takes a share and appends to its own file
    groups = batches(my_cells(todo), batch) if batch > 1 else [[c] for c in my_cells(todo)]
    for group in tqdm(groups, desc=desc, unit="cell" if batch == 1 else "batch", dynamic_ncols=True):
        t0 = time.perf_counter()
        records = fn(group) if batch > 1 else [fn(*group[0])]
        for (fields, _), record in zip(group, records):
            results.add(Results.key(fields), dict(fields, **record, seconds=round(time.perf_counter() - t0, 2)))
    end_cells(results)  # rank 0 folds the ranks' files into the one results file; the others end here


def batches(todo, n: int) -> list:
    """The cells of each `n` consecutive prompts (a prompt: the cells' fields but the method), one method at a
    time in the cells' order: what one left-padded batch decodes."""
    prompt = lambda f: Results.key({k: v for k, v in f.items() if k not in ("method",)})  # noqa: E731
    order = list(dict.fromkeys(prompt(f) for f, _ in todo))
    out = []
    for i in range(0, len(order), n):
        chunk = set(order[i:i + n])
        by_method = {}  # (and by answer length: a batch decodes one length)
        for f, m in todo:
            if prompt(f) in chunk:
                by_method.setdefault((f["method"], f.get("max_new")), []).append((f, m))
        out += list(by_method.values())
    return out


def begin_cells(results):
    """Under torchrun every rank appends its cells to its own file (one writer per file, on any
    file system); end_cells folds them into the one results file."""
    if tp.world() > 1:
        results.path = rank_file(results)


def end_cells(results):
    """After the cells: wait for every rank (a dead one is an error after TIMEOUT_S, torchrun
    usually ends the run first), rank 0 folds the rank files into the results file and goes on to
    write the report; the other ranks are done."""
    if tp.world() == 1:
        return
    name = results.path.name.split(".rank")[0] + ".jsonl"
    tp.barrier()
    if tp.rank():
        torch.distributed.destroy_process_group()
        raise SystemExit(0)
    fold_rank_files(results.dir / name)
    results.__init__(results.dir, name)


# ---- tables -----------------------------------------------------------------------------------------
def md_table(header, rows) -> str:
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else ("-" if x is None else str(x))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows])


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def pct(x):
    return None if x is None else 100 * x


def with_interval(scores) -> str:
    """'mean [lo, hi] (n)' x100 over the prompts' scores, the interval Wilson's 95%; '-' for none."""
    if not scores:
        return "-"
    m = sum(scores) / len(scores)
    return f"{fmt_interval((m, *wilson(m, len(scores))))} ({len(scores)})"


def where(recs, **match) -> list[dict]:
    return [r for r in recs if all(r.get(k) == v for k, v in match.items())]


def labels_of(recs) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in recs))


def by_label_and_length(recs):
    """(label, length, its records) for each label (first-seen order) and length (ascending)."""
    for lb in labels_of(recs):
        for L in sorted({r["length"] for r in where(recs, label=lb)}):
            yield lb, L, where(recs, label=lb, length=L)


def bits_column(recs, lb):
    """The cache's device bits per stored K/V element (CacheConfig.bits_per_value), as recorded."""
    bits = mean([r["bits"] for r in where(recs, label=lb) if "bits" in r])
    return None if bits is None else f"{bits:.2f}"


PROMPT_FORMS_SAID = {"chat": "chat (the question in the model's chat template)",
                     "completion": "completion (text that a base model continues to the answer)"}


def by_prompt_form(recs):
    """(records, the sentence naming their prompt forms). Rows without the field are chat rows;
    with several forms in one file the form joins each label, so the tables keep them apart."""
    form = lambda r: r.get("prompt_form", "chat")  # noqa: E731
    forms = sorted({form(r) for r in recs})
    if len(forms) > 1:
        recs = [dict(r, label=f"{r['label']} ({form(r)})") for r in recs]
    return recs, "Prompt form: " + "; ".join(PROMPT_FORMS_SAID.get(f, f) for f in forms) + "."


def write_niah_report(results: Results):
    recs, forms = by_prompt_form(results.of("niah"))
    lengths = sorted({r["length"] for r in recs})
    rows = [[lb, bits_column(recs, lb)] + [pct(mean([r["score"] for r in where(recs, label=lb, length=L)])) for L in lengths]
            + [pct(mean([r["score"] for r in where(recs, label=lb)]))] for lb in labels_of(recs)]
    spread = [[lb] + [with_interval([r["score"] for r in where(recs, label=lb, length=L)]) for L in lengths]
              for lb in labels_of(recs)]
    results.write_md("Needle in a haystack",
                     "Score: share of the needle's key phrases (" + ", ".join(KEY_PHRASES) + " for Kamradt's needle; "
                     "tools/tasks.py NEEDLES) in the greedy answer, x100, mean over depths and needles. Deterministic string match: no GPT-4 judge offline (the paper rates 1-10 "
                     "with GPT-4). bits: device bits per stored K/V element (codes, scales, refinement; "
                     "config.CacheConfig.bits_per_value). " + forms,
                     md_table(["method", "bits"] + [f"{L} tok" for L in lengths] + ["avg"], rows),
                     "Per length: the mean x100 with Wilson's 95% interval over the prompts (how many in brackets).",
                     md_table(["method"] + [f"{L} tok" for L in lengths], spread),
                     "![niah](niah.png)")
    plot_niah(recs, labels_of(recs), results.dir / "niah.png")


def plot_niah(recs, labels, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, depths = sorted({r["length"] for r in recs}), sorted({r["depth"] for r in recs})
    fig, axes = plt.subplots(1, len(labels), figsize=(1.5 + 0.9 * len(lengths) * len(labels), 0.5 * len(depths) + 1.6),
                             squeeze=False, sharey=True)
    for ax, lb in zip(axes[0], labels):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for d in depths:  # the mean over the needles at that depth and length
            for L in lengths:
                m = mean([r["score"] for r in where(recs, label=lb, depth=d, length=L)])
                grid[depths.index(d), lengths.index(L)] = np.nan if m is None else m
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{L / 1000:g}k" for L in lengths])
        # a long label (a preset's name) wrapped at its hyphens to the panel's width, so titles do not overlap
        ax.set_title("\n".join(textwrap.wrap(lb, max(12, 11 * len(lengths)))), fontsize=9)
        ax.set_xlabel("context length", fontsize=8)
    axes[0][0].set_yticks(range(len(depths)), [f"{round(100 * d)}%" for d in depths])
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03, label="score (key phrases found)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def write_ruler_report(results: Results):
    recs, forms = by_prompt_form(results.of("ruler"))
    tasks = [t for t in RULER_TASKS if where(recs, task=t)]
    rows = []
    for L in sorted({r["length"] for r in recs}):
        for lb in labels_of(recs):
            cells = [where(recs, label=lb, length=L, task=t) for t in tasks]
            per = [mean([r["score"] for r in c]) for c in cells]
            if any(p is not None for p in per):
                rows.append([lb, L, min(map(len, cells))] + [pct(p) for p in per] + [pct(mean(per))])
    spread = []
    for L in sorted({r["length"] for r in recs}):
        for lb in labels_of(recs):
            cells = [[r["score"] for r in where(recs, label=lb, length=L, task=t)] for t in tasks]
            if any(cells):
                spread.append([lb, L] + [with_interval(c) for c in cells] + [with_interval(sum(cells, []))])
    results.write_md("RULER-style tasks",
                     "Recall of the expected strings in the greedy output (RULER's string_match_all; QA: "
                     "string_match_part), x100, case and punctuation insensitive. Samples generated locally with a "
                     "fixed seed; n = samples per task. " + forms,
                     md_table(["method", "length", "n"] + [RULER_TASKS[t][2] for t in tasks] + ["Average"], rows),
                     "Per task: the mean x100 with Wilson's 95% interval over the samples (how many in brackets; a QA "
                     "answer scores 0 or 1, a multi-value NIAH answer a fraction, for which Wilson's is wider than "
                     "needed); pooled: every answer of the row's tasks together, weighed alike.",
                     md_table(["method", "length"] + [RULER_TASKS[t][2] for t in tasks] + ["pooled"], spread))


def bootstrap_mean(xs, ys=None, resamples=2000, seed=0, level=0.95, block=1):
    """(mean, lo, hi): the mean of xs, or (ys given) of xs - ys, and its percentile interval over
    `resamples` resamples of the indices with replacement, deterministic in seed. Paired: a resample
    takes the same indices of xs and ys, which is resampling the differences. block > 1: a block
    bootstrap, resampling runs of `block` neighbours (the values after the last whole run are left out
    of the interval, not of the mean), for values that are not independent of their neighbours."""
    x = torch.tensor(xs, dtype=torch.float64)
    if ys is not None:
        y = torch.tensor(ys, dtype=torch.float64)
        if y.shape != x.shape:
            raise ValueError(f"paired bootstrap over {len(xs)} and {len(ys)} values")
        x = x - y
    if len(x) == 0:
        return None
    if block < 1 or len(x) < block:
        raise ValueError(f"a block bootstrap needs 1 <= block <= {len(x)} values, not block={block}")
    units = x[:len(x) // block * block].view(-1, block).mean(1)  # equal runs: their mean of means is a mean
    n = len(units)
    g = torch.Generator().manual_seed(seed)
    per = max(1, 2 ** 22 // n)  # resamples a batch: 4M indices at most
    means = torch.cat([units[torch.randint(n, (min(per, resamples - i), n), generator=g)].mean(1)
                       for i in range(0, resamples, per)])
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return float(x.mean()), lo, hi


PPL_TEXTS_SAID = {"essays": "Paul Graham's essays", "squad": "SQuAD's paragraphs, article by article",
                  "hotpot": "HotpotQA's paragraphs, question by question"}


def ppl_text(r) -> str:
    return r.get("text", "essays")  # rows before --text: essay windows


def paired_key(r) -> str:
    """The cell's key without the cache: the rows of one window, whatever the cache."""
    fields = json.loads(r["key"]) if "key" in r else dict(r)
    fields.pop("method", None)
    return json.dumps(fields, sort_keys=True)


PPL_BLOCK = 50  # tokens a run in the block bootstrap's interval


def ppl_interval_rows(recs, text, L, ref="full"):
    """[method, text, length, tokens, perplexity [95%], vs the fp cache [95%], the same over runs of PPL_BLOCK
    tokens [95%]] per cache: a bootstrap over the scored tokens of every window (text None: of every text's);
    against `ref`, paired over the windows both have per-token NLLs for. The block interval resamples runs of
    neighbouring tokens within a window (each window cut to whole runs), as neighbours are not independent."""
    cell = [r for r in where(recs, length=L) if text is None or ppl_text(r) == text]
    refs = {paired_key(r): r["nlls"] for r in where(cell, label=ref) if r.get("nlls")}
    rows = []
    for lb in labels_of(cell):
        mine = where(cell, label=lb)
        b = bootstrap_mean([x for r in mine for x in r["nlls"]]) if all(r.get("nlls") for r in mine) else None
        point = b[0] if b else mean([r["nll"] for r in mine])
        ppl = f"{math.exp(point):.3f}" + (f" [{math.exp(b[1]):.3f}, {math.exp(b[2]):.3f}]" if b else " -")
        pairs = [(r["nlls"], refs[paired_key(r)]) for r in mine if r.get("nlls") and paired_key(r) in refs]
        d = bootstrap_mean(sum((p[0] for p in pairs), []), sum((p[1] for p in pairs), [])) if pairs else None
        runs = [(x[:k], y[:k]) for x, y in pairs if (k := len(x) // PPL_BLOCK * PPL_BLOCK)]  # whole runs a window
        db = bootstrap_mean(sum((p[0] for p in runs), []), sum((p[1] for p in runs), []), block=PPL_BLOCK) \
            if runs else None
        change = ["" if lb == ref else "-" if e is None else "{:+.1f}% [{:+.1f}, {:+.1f}]".format(
            *(100 * math.expm1(x) for x in (d[0], e[1], e[2]))) for e in (d, db)]
        rows.append([lb, text or "all", L, sum(r["n"] for r in mine), ppl] + change)
    return rows


def write_ppl_report(results: Results):
    recs = results.of("ppl")
    cols = sorted({(ppl_text(r), r["length"]) for r in recs}, key=lambda c: (c[0] != "essays", c))
    rows = []
    for lb in labels_of(recs):
        nlls = [mean([r["nll"] for r in where(recs, label=lb, length=L) if ppl_text(r) == t]) for t, L in cols]
        rows.append([lb, bits_column(recs, lb)] + [None if x is None else f"{math.exp(x):.3f}" for x in nlls]
                    + [f"{mean(nlls):.4f}", len(where(recs, label=lb))])
    n_eval = "/".join(map(str, sorted({r["n_eval"] for r in recs})))
    texts = "; ".join(f"{t}: {PPL_TEXTS_SAID.get(t, t)}" for t in dict.fromkeys(t for t, _ in cols))
    spread = [row for t, L in cols for row in ppl_interval_rows(recs, t, L)]
    for L in sorted({L for _, L in cols}):  # every text's windows together, where a length has more than one
        if len({t for t, L2 in cols if L2 == L}) > 1:
            spread += ppl_interval_rows(recs, None, L)
    results.write_md("Perplexity through the decode path",
                     f"Perplexity of the last {n_eval} tokens of each window, teacher-forced one decode step "
                     "at a time after a prefill of the rest (speculative SpeCache: [true token, own speculative token]). "
                     "`-orig` = original KIVI 1-bit zero/scale (paper eq. 2) instead of eq. 3 (Table 5's ablation). "
                     f"Texts: {texts}.",
                     md_table(["method", "bits"] + [f"ppl @{L}" if t == "essays" else f"ppl {t} @{L}" for t, L in cols]
                              + ["mean NLL", "cells"], rows),
                     "With 95% intervals, a bootstrap over the scored tokens (2,000 resamples, seed 0; \"-\": rows "
                     "without per-token NLLs): each cache's perplexity, and its change against the fp cache (`full`) "
                     "as its perplexity over the fp cache's, - 1, the same resampled tokens for both. Resampling "
                     "tokens takes them as independent; neighbouring tokens are not, so the last column resamples runs of "
                     f"{PPL_BLOCK} neighbouring tokens of a window instead (the same change, its interval over whole runs "
                     "only). `all`: every text's windows together.",
                     md_table(["method", "text", "length", "tokens", "perplexity [95%]", "vs full [95%]",
                               f"vs full, {PPL_BLOCK}-token runs [95%]"], spread))


HIT_INTERVALS = [(1, 10), (11, 50), (51, 100), (101, 200), (201, None)]  # decode steps, as in rebuttal Q2


HIT_SERIES = {"hit": "top-k hit % (vs exact top-k)", "hit_mass": "hit % (vs most-mass top-k)",
              "hit_own": "hit % (vs own low-bit top-k)", "mass": "attention mass held %",
              "mass_topk": "mass of exact top-k %", "mass_best": "mass of most-mass top-k %", "err": "output error %",
              "err_topk": "error with exact top-k %", "err_own": "error with own low-bit top-k %",
              "err_none": "error with no fp16 rows %", "exact": "exact token hit %",
              "reuse": "fetched rows already in the ring %"}


OLD_SERIES = {"topk": "hit", "topk_lowbit": "hit_own"}  # results written before the probe's names


def write_quantspec_report(results: Results):
    recs = results.of("quantspec")
    rows = []
    for lb, L, cell in by_label_and_length(recs):
        ref = {r["sample"]: r["tokens"] for r in where(cell, gamma=0)}
        for g in sorted({r["gamma"] for r in cell}):
            rs = where(cell, gamma=g)
            same = [r["tokens"] == ref[r["sample"]] for r in rs if r["sample"] in ref]
            acc = sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs))
            per_round = sum(r["accepted"] + r["rounds"] for r in rs) / max(1, sum(r["rounds"] for r in rs))
            rows.append([lb, L, g, len(rs), pct(acc) if g else None, per_round,
                         f"{sum(same)}/{len(same)}" if same else None, mean([r["decode_tok_s"] for r in rs])])
    results.write_md("QuantSpec: acceptance by draft length",
                     "Greedy summaries of essay windows (chat template). acceptance = accepted drafts / drafted "
                     "(quantspec.txt's acceptance rate); tokens per round = accepted + 1 (the target's own token); "
                     "= gamma 0: outputs equal to the target decoding alone over the same cache (INT8 view), token "
                     "for token, which greedy QuantSpec must give; tok/s on this machine (CPU timings are not the "
                     "GPU's: the draft's INT4 matmuls and the INT4-plane reads only pay off where decoding is bound "
                     "by memory bandwidth).",
                     md_table(["method", "length", "gamma", "n", "acceptance %", "tokens per round", "= gamma 0",
                               "decode tok/s"], rows))


def write_saliency_report(results: Results):
    recs = results.of("saliency")
    rows = []
    for lb, L, rs in by_label_and_length(recs):
        rows.append([lb, L, len(rs), rs[0]["probes"]] + [pct(mean([r[key] for r in rs])) for key in
                                                       ("group", "global", "accumulated")]
                    + [f"{100 * min(min(r['layer_group']) for r in rs):.1f}"])
    results.write_md("ZipCache saliency: probe tokens against exact normalized attention",
                     "Share of the exact salient set (eq. 8 with every token a probe, top ratio) that a cheaper metric "
                     "selects, mean over layers and kv heads: probes (eq. 9, 5% recent + 5% random tokens) per key group "
                     "(the cache keeps round(ratio x group) tokens of each group) and over the whole prompt; H2O's "
                     "accumulated attention (eq. 7, every token a probe, no normalization) over the whole prompt. "
                     "Essay windows, one exact prefill each.",
                     md_table(["setting", "length", "n", "probes", "probe overlap per group %", "probe overlap global %",
                               "accumulated (eq. 7) overlap global %", "worst layer per group %"], rows))


def step_mean(recs, key, lo=1, hi=None):
    """Mean of a per-step series over decode steps lo..hi (1-based, inclusive) of all records."""
    return mean([float(v) for r in recs for i, v in enumerate(r.get(key) or [], 1)
                 if lo <= i and (hi is None or i <= hi) and v is not None])


def write_hitrate_report(results: Results):
    recs = results.of("hitrate")
    for r in recs:
        for old, new in OLD_SERIES.items():
            if old in r and new not in r:
                r[new] = r[old]
    kinds = sorted({r.get("prompt", "essay") for r in recs})
    used = [iv for iv in HIT_INTERVALS if any(len(r["exact"]) >= iv[0] for r in recs)]
    names = [f"[{lo}, {hi if hi else ''}]" for lo, hi in used]
    totals, by_step = [], []
    for kind in kinds:
        for lb in labels_of(recs):
            mine = where(recs, label=lb, **({"prompt": kind} if any("prompt" in r for r in recs) else {}))
            if not mine:
                continue
            totals.append([lb, kind, sum(len(r["exact"]) for r in mine)] + [pct(step_mean(mine, key)) for key in HIT_SERIES])
            if kind == kinds[0]:
                by_step += [[lb, name] + [pct(step_mean(mine, key, lo, hi)) for lo, hi in used]
                            for key, name in HIT_SERIES.items() if key in ("hit", "mass", "err", "exact")]
    results.write_md("SpeCache fetches: hit rates, attention mass and output error",
                     "Per layer and decode step, against the real token's exact attention (fp16 keys and values "
                     "from the host store), mean over layers (tools/probe.py): the share of its exact top-k the fp16 rows "
                     "hold (rebuttal Q6) and of its own low-bit top-k, the share of its attention mass they carry "
                     "(and the exact top-k's), and the relative error of its attention output with the rows it "
                     "attended in fp16, with the exact top-k's, with its own low-bit top-k's, and with none. "
                     "Exact token: the speculative token fed at a step equals the real token it produces. Greedy "
                     "decoding of essay summaries, needle prompts or RULER's QA prompts (qa_squad, qa_hotpot), stopped "
                     "at EOS; steps with nothing quantized are not counted.",
                     md_table(["method", "prompts", "steps"] + list(HIT_SERIES.values()), totals),
                     "By decode step (rebuttal Q2), first prompt kind:", md_table(["method", "measure"] + names, by_step),
                     "Per layer: top-k hit % (vs exact top-k), each prompt's per-layer mean weighed by its steps:",
                     layer_table(recs), "![per layer](layers.png)")
    plot_layers(recs, results.dir / "layers.png")


def layer_series(recs, key="layer_hit"):
    """{(label, prompt kind): per-layer mean of `key` over the records, each weighed by its counted steps}."""
    out = {}
    for kind in sorted({r.get("prompt", "essay") for r in recs}):
        for lb in labels_of(recs):
            mine = [r for r in where(recs, label=lb) if r.get("prompt", "essay") == kind and r.get(key)]
            if not mine:
                continue
            steps = [max(1, sum(v is not None for v in r.get("hit") or [])) for r in mine]
            out[lb, kind] = [weighted_mean([(w, r[key][i]) for w, r in zip(steps, mine)])
                             for i in range(min(len(r[key]) for r in mine))]
    return out


def weighted_mean(pairs):
    """Mean of the values of [(weight, value)], None values left out; None for none."""
    pairs = [(w, v) for w, v in pairs if v is not None]
    return sum(w * v for w, v in pairs) / sum(w for w, _ in pairs) if pairs else None


def layer_table(recs) -> str:
    series = layer_series(recs)
    if not series:
        return "(no per-layer rows)"
    n = max(map(len, series.values()))
    rows = [[i] + [pct(s[i]) if i < len(s) else None for s in series.values()] for i in range(n)]
    return md_table(["layer"] + [f"{lb} ({kind})" for lb, kind in series], rows)


def plot_layers(recs, path):
    """Per-layer means of the output error and the hit rate, one line per method (and prompt kind:
    one line style each, where there are several)."""
    recs = [r for r in recs if r.get("layer_err")]
    if not recs:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    kinds = sorted({r.get("prompt", "essay") for r in recs})
    colors, styles = {lb: f"C{i}" for i, lb in enumerate(labels_of(recs))}, ["-", "--", ":", "-."]
    for ax, key in zip(axes, ("layer_err", "layer_hit")):
        for (lb, kind), per in layer_series(recs, key).items():
            ax.plot(range(len(per)), [None if x is None else 100 * x for x in per], color=colors[lb], lw=1.2,
                    ls=styles[kinds.index(kind) % len(styles)], label=lb if len(kinds) == 1 else f"{lb} ({kind})")
    axes[0].set_title("attention output error % (vs exact)", fontsize=9)
    axes[1].set_title("top-k hit % (vs exact top-k)", fontsize=9)
    for ax in axes:
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
