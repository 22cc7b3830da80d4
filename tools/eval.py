"""Accuracy evaluation of the KV caches: needle-in-a-haystack (specache.txt §4.3, Appendix B),
RULER-style tasks (rebuttal Q5), perplexity through the decode path (and Table 5's 1-bit
ablation), and SpeCache's hit rates by decode step (rebuttal Q2/Q6). The data, sample generators
and scorers are in tools/tasks.py; this file runs them through generate.py and writes the tables.

    python tools/eval.py prompt --length 3000 --depth 0.5 > needle.txt       # a NIAH prompt (user turn)
    python tools/eval.py niah --hf checkpoints/gemma-3-270m --prompt-form completion --quick --out results/gemma-niah
    python tools/eval.py niah --methods full,kivi-1bit,specache-1bit --lengths 1000,2000,4000,8000 --out results/niah
    python tools/eval.py ruler --lengths 4000 --samples 5 --out results/ruler
    python tools/eval.py ppl --methods kivi-1bit,kivi-1bit-orig,specache-1bit,specache-1bit-orig --out results/ppl
    python tools/eval.py ppl --text squad --lengths 16000 --windows 1 --out results/ppl      # SQuAD's paragraphs
    python tools/eval.py hitrate --methods specache-1bit,specache-2bit --out results/hitrate
    python tools/eval.py hitrate --prompts qa_squad,qa_hotpot --lengths 16000 --out results/hitrate   # RULER's QA prompts
    python tools/eval.py quantspec --lengths 4000,8000 --gammas 0,1,2,4,6 --out results/quantspec    # acceptance rates
    python tools/eval.py saliency --lengths 2000,4000 --out results/saliency     # ZipCache: probe vs exact saliency

Every subcommand appends one JSON line per finished cell to OUT/results.jsonl (a rerun with the
same OUT skips the cells already there, so an interrupted run resumes), rewrites OUT/results.md,
and `niah` also draws OUT/niah.png (Figure 4 style). All scores are deterministic string matches:
there is no GPT-4 judge offline (the paper's NIAH scores are GPT-4 ratings, 1-10).
Lengths are prompt tokens, chat template included. --prompt-form (niah, ruler, prompt) picks how a
task is asked (tools/tasks.py): chat (the default: a question in the model's chat template, for
instruct models) or completion (text that a base model continues: NIAH's haystack then "According to
the text above, the best thing to do in San Francisco is"; RULER's `base` template). Each results row
records it as prompt_form.
"""
import argparse
import os
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the method's modules are at the root (`python tools/eval.py` puts tools/ first)

import torch  # noqa: E402

from config import CacheConfig  # noqa: E402
from integrations import tp  # noqa: E402
from tools.eval_report import (Results, init_cells, mean, run_cells, write_hitrate_report, write_niah_report,  # noqa: E402
                               write_ppl_report, write_quantspec_report, write_ruler_report, write_saliency_report)
from tools.replay import PrefillReplay, Recorder  # noqa: E402
from tools.tasks import (NEEDLES, PPL_TEXTS, PROMPT_FORMS, RULER_TASKS, essay_window, niah, niah_score, render,  # noqa: E402
                         ruler_max_new, ruler_sample, ruler_score, summary_prompt, text_ids, text_window)

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared; see cpu-toolchain notes

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"


# ==== methods: cache configurations by name (config.CacheConfig) ============================================
METHOD_HELP = ("cache names: full, kivi-{1,2,4,8}bit, specache-{1,2,4,8}bit, -orig (1-bit eq. 2), "
               "-sequential/-oracle fetch, -zipcache/-quantspec, kN/gN/rN; see config.CacheConfig")


def parse_int_list(text: str, what: str, low: int = 1) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --{what} takes comma-separated integers, got {text!r}")
    if not values or any(v < low for v in values):
        raise SystemExit(f"error: --{what} takes integers >= {low}, got {text!r}")
    return values


def expand_methods(names: str, ks=(None,), groups=(None,), residuals=(None,)) -> list[CacheConfig]:
    """Cache names x the --k/--group/--residual sweeps that apply to them (k: SpeCache only).
    Raises ValueError for a bad name or combination."""
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        base = CacheConfig.from_name(name)
        if base.kind == "full":
            out.append(base)
            continue
        for g in groups:
            for r in residuals:
                for k in (ks if base.kind == "specache" else [None]):
                    cfg = CacheConfig.from_name(name, group=g, residual=r, k=k)
                    if cfg not in out:
                        out.append(cfg)
    return out


# ==== the model side ============================================================================================
class Runner:
    """One model + tokenizer; fresh caches for every prompt (each prompt prefilled once)."""

    def __init__(self, a):
        import generate
        from model import load_model
        from tokenizer import load_tokenizer

        self.torch, self.gen = torch, generate
        if a.threads:
            torch.set_num_threads(a.threads)
        if not a.hf and not (a.checkpoint / "config.json").exists():
            raise SystemExit(f"error: no checkpoint at {a.checkpoint} (run `python convert_hf.py smollm2 --out {a.checkpoint}`)")
        self.device = torch.device(a.device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if a.hf:  # a transformers model directory through hf.py
            from integrations import hf
            try:
                self.model, self.tok = hf.load(a.hf, self.device, dtype)
            except ValueError as e:
                raise SystemExit(f"error: {e}")
        else:
            self.model = load_model(a.checkpoint, device=self.device, dtype=dtype)
            self.tok = load_tokenizer(a.checkpoint)
        self.chunk = a.prefill_chunk
        self.replay = PrefillReplay(a.prefill_chunk, a.method_list)
        # Compiled steps need one cache shape for the whole run, or every prompt recompiles.
        self.fixed_len = a.cache_len if a.compile else None
        self.steps = generate.Steps().compiled(self.device) if a.compile else generate.Steps()

    def setup(self, m: CacheConfig, seq_len: int, row_start=None):
        """Fresh caches for one prompt, or a left-padded batch of several (row_start: each row's first real slot;
        kept in self.caches); one error line for a cache this prompt cannot hold (an InfLLM budget below its
        smallest layout, a sibling's cache and padding), the rows before it kept."""
        from generate import setup_caches
        seq_len = self.fixed_len or seq_len
        try:
            self.caches = setup_caches(self.model, m, 1 if row_start is None else len(row_start), seq_len, row_start)
        except ValueError as e:
            raise SystemExit(f"error: {e} (a sequence of {seq_len} positions)")

    def prefill_step(self):
        """The recorded prefill's replay, or (replay None) each cache's own chunked prefill."""
        from functools import partial
        return getattr(self, "replay", None) or partial(self.gen.prefill, chunk=self.chunk)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tok.encode(text, bos=False)  # chat text carries its own special tokens

    def generate(self, m: CacheConfig, ids: list[int], max_new: int, on_step=None, eos=True, before=None):
        """Greedy answer text (cut at the first EOS) and generate()'s stats. `before(caches)` runs
        once the caches exist (eval probes attach there)."""
        self.setup(m, len(ids) + max_new + 2)
        if before:
            before(self.caches)
        prompt = self.torch.tensor([ids], device=self.device)
        decoding = self.gen.Decoding(max_new, eos_ids=frozenset(self.tok.eos_ids) if eos else frozenset())
        out, stats = self.gen.generate(self.model, prompt, decoding,
                                       replace(self.steps, prefill=self.prefill_step()), on_step)
        row = [int(t) for t in out[0]]
        ends = [i for i, t in enumerate(row) if t in self.tok.eos_ids]
        return self.tok.decode(row[:ends[0]] if ends else row), stats

    def generate_rows(self, m: CacheConfig, rows: list, max_new: int):
        """Greedy answers (cut at the first EOS) to several prompts decoded together, left-padded to the longest
        (the caches' row_start), and the batch's stats."""
        if len(rows) == 1:
            text, stats = self.generate(m, rows[0], max_new)
            return [text], stats
        from generate import left_padded
        prompt, starts = left_padded(rows, 0, self.device)  # (the padding is never attended: any id)
        self.setup(m, prompt.shape[1] + max_new + 2, starts)
        decoding = self.gen.Decoding(max_new, eos_ids=frozenset(self.tok.eos_ids))
        out, stats = self.gen.generate(self.model, prompt, decoding, replace(self.steps, prefill=self.prefill_step()))
        texts = []
        for row in out.tolist():
            ends = [i for i, t in enumerate(row) if t in self.tok.eos_ids]
            texts.append(self.tok.decode(row[:ends[0]] if ends else row))
        return texts, stats

    def nll_decode_path(self, m: CacheConfig, ids: list[int], n_eval: int) -> list[float]:
        """Teacher-forced NLL of the last n_eval tokens through the decode path: prefill ids[:L-n_eval-1],
        then one decode step per true token (generate()'s loop with the true token forced in).
        Speculative SpeCache feeds [true token, its own speculative guess from the previous step]."""
        F = self.torch.nn.functional
        L = len(ids)
        P = L - n_eval - 1
        truth = self.torch.tensor(ids, device=self.device)
        nll = []

        def force(step, logits, token, fed):
            if step > 0:  # logits of the real row predict token P + step
                nll.append(float(F.cross_entropy(logits.float(), truth[P + step][None])))
            return truth[P + step][None]

        self.generate(m, ids[:P], n_eval + 1, on_step=force, eos=False)
        return nll

    def hit_trace(self, m: CacheConfig, ids: list[int], steps: int) -> dict:
        """Greedy decode (up to `steps` decode steps, stopped at EOS) with a probe.FetchProbe on every
        layer. Per decode step: each probe measure (probe.KEYS: hit rates, attention mass, output
        errors; the mean over layers, None while nothing is quantized) and "exact", whether the
        speculative token fed at the step equalled the real token it produced (None without one).
        Per layer: each measure's mean over the steps ("layer_<key>")."""
        from tools.probe import KEYS, FetchProbe

        trace = {key: [] for key in KEYS}
        trace["exact"] = []
        probes, seen = [], [0]

        def on_step(step, logits, token, fed):
            if step == 0:
                return
            n = min((len(r) for r in probes[0].records), default=0)
            for key in KEYS:
                trace[key].append(probes[0].per_step(key)[-1] if n > seen[0] else None)
            seen[0] = n
            trace["exact"].append(bool(int(fed[0, 1]) == int(token[0])) if fed.shape[1] == 2 else None)

        self.generate(m, ids, steps + 1, on_step=on_step, before=lambda caches: probes.append(FetchProbe(caches)))
        probes[0].remove()
        self.last_probe = probes[0]
        trace.update({f"layer_{key}": probes[0].per_layer(key) for key in KEYS})
        return trace


# ==== subcommands ===================================================================================================
def base_fields(cmd, a, m: CacheConfig) -> dict:
    return dict(cmd=cmd, model=a.checkpoint.name, method=m.name)


def form_fields(a) -> dict:
    """The prompt form in a cell's key: chat, the default, is left out, so results files without
    the field resume as chat cells. Every row records the form (prompt_form)."""
    return {} if a.prompt_form == "chat" else dict(prompt_form=a.prompt_form)


def answer(runner: Runner, m: CacheConfig, samples, max_new: int) -> list[dict]:
    """Greedy answers to task samples, decoded together (a left-padded batch) when there are several: the
    fields every generation cell records (plus the text; the stats are the batch's, `batch` its rows)."""
    rows = [runner.encode_prompt(render(runner.tok, s)) for s in samples]
    texts, stats = runner.generate_rows(m, rows, max_new)
    common = dict(spec_exact_hit_rate=stats["spec_exact_hit_rate"], prefill_s=round(stats["prefill_s"], 2),
                  resyncs=stats["resyncs"], decode_steps=stats["decode_steps"], decode_tok_s=round(stats["decode_tok_s"], 2),
                  bits=m.bits_per_value(runner.model.args.head_dim, runner.model.args.n_heads // runner.model.args.n_kv_heads),
                  **({"batch": len(rows)} if len(rows) > 1 else {}))
    return [dict(output=text, prompt_tokens=len(ids), **common) for text, ids in zip(texts, rows)]


def cmd_niah(a, runner, methods, results):
    cells = [(dict(base_fields("niah", a, m), length=L, depth=d, max_new=a.max_new_tokens, **form_fields(a),
                   **({"needle": n} if n else {})), m)  # (needle 0, Kamradt's, left out of the key: older rows)
             for L in a.lengths for n in a.needles for d in a.depths for m in methods]  # prompt-major: a prefill each
    sample = lru_cache(1)(lambda L, d, n: niah(runner.tok, L, d, a.prompt_form, n))

    def run(group):
        m = group[0][1]
        ss = [niah(runner.tok, f["length"], f["depth"], a.prompt_form, f.get("needle", 0)) if len(group) > 1 else
              sample(f["length"], f["depth"], f.get("needle", 0)) for f, _ in group]
        return [dict(label=m.name, score=niah_score(out["output"], s.answers), **out, prompt_form=s.form,
                     needle_depth=round(s.meta["needle_char"] / max(1, s.meta["context_chars"]), 4))
                for s, out in zip(ss, answer(runner, m, ss, group[0][0]["max_new"]))]

    batch = getattr(a, "batch", 1)
    run_cells(cells, results, run if batch > 1 else lambda f, m: run([(f, m)])[0], "niah", batch)
    write_niah_report(results)


def cmd_ruler(a, runner, methods, results):
    tasks = a.tasks.split(",") if a.tasks else list(RULER_TASKS)
    unknown = [t for t in tasks if t not in RULER_TASKS]
    if unknown:
        raise SystemExit(f"error: unknown RULER task {unknown[0]!r}; known: {', '.join(RULER_TASKS)}")
    cells = [(dict(base_fields("ruler", a, m), task=t, length=L, sample=i, seed=a.seed,
                   max_new=a.max_new_tokens or ruler_max_new(t), **form_fields(a)), m)
             for m in methods for L in a.lengths for t in tasks for i in range(a.first_sample, a.samples)]
    # task-major order, so that a sample is built once and reused by every method
    cells.sort(key=lambda c: (c[0]["length"], c[0]["task"], c[0]["sample"]))
    sample = lru_cache(1)(lambda t, L, i: ruler_sample(runner.tok, t, L, i, seed=a.seed, form=a.prompt_form))

    def run(group):
        m = group[0][1]
        ss = [ruler_sample(runner.tok, f["task"], f["length"], f["sample"], seed=a.seed, form=a.prompt_form)
              if len(group) > 1 else sample(f["task"], f["length"], f["sample"]) for f, _ in group]
        return [dict(label=m.name, score=ruler_score(f["task"], out["output"], s.answers), answers=s.answers, **out,
                     prompt_form=s.form)
                for (f, _), s, out in zip(group, ss, answer(runner, m, ss, max(f["max_new"] for f, _ in group)))]

    batch = getattr(a, "batch", 1)
    run_cells(cells, results, run if batch > 1 else lambda f, m: run([(f, m)])[0], "ruler", batch)
    write_ruler_report(results)


def cmd_ppl(a, runner, methods, results):
    text = getattr(a, "text", "essays")
    # the text in a cell's key, but for the essays: results files without the field resume as essay cells
    in_key = {} if text == "essays" else dict(text=text)
    need = max((a.windows - 1) * (a.stride or L) + L for L in a.lengths)
    n_stream = len(text_ids(runner.tok, text, need))
    cells = []
    for L in a.lengths:
        stride = a.stride or L
        for w in range(a.windows):
            if w * stride + L > n_stream:
                raise SystemExit(f"error: window {w} of {L} tokens at stride {stride} runs past the {text} ({n_stream} tokens)")
            cells += [(dict(base_fields("ppl", a, m), length=L, window=w, start=w * stride, n_eval=a.n_eval,
                            chunk=a.prefill_chunk, **in_key), m) for m in methods]

    def run(f, m):
        nll = runner.nll_decode_path(m, text_window(runner.tok, text, f["start"], f["length"]), f["n_eval"])
        # every token's NLL: the report's bootstrap intervals, paired with the fp cache's on the same tokens
        return dict(label=m.name, text=text, nll=sum(nll) / len(nll), n=len(nll), nlls=[round(x, 5) for x in nll],
                    bits=m.bits_per_value(runner.model.args.head_dim))

    run_cells(cells, results, run, "ppl")
    write_ppl_report(results)


def cmd_hitrate(a, runner, methods, results):
    bad = [m.name for m in methods if m.kind != "specache"]
    if bad:
        raise SystemExit(f"error: hitrate measures SpeCache fetches (specache-...), not {', '.join(bad)}")
    cells = [(dict(base_fields("hitrate", a, m), prompt=kind, length=L, sample=i, steps=a.steps, **form_fields(a),
                   **({"seed": a.seed} if kind in RULER_TASKS else {})), m)
             for kind in a.prompts.split(",") for L in a.lengths for i in range(a.samples) for m in methods]

    def run(f, m):
        if f["prompt"] == "needle":  # the needle at depths spread over the samples
            text = render(runner.tok, niah(runner.tok, f["length"], (f["sample"] + 0.5) / a.samples, a.prompt_form))
        elif f["prompt"] in RULER_TASKS:  # the prompt `ruler` asks at this task, length, sample and seed
            s = ruler_sample(runner.tok, f["prompt"], f["length"], f["sample"], f["seed"], a.prompt_form)
            text = render(runner.tok, s)
        else:  # (completion: the essay window itself, which a base model continues)
            text = summary_prompt(runner.tok, f["length"], f["sample"], a.prompt_form)
        ids = runner.encode_prompt(text)
        return dict(label=m.name, **runner.hit_trace(m, ids, f["steps"]), prompt_tokens=len(ids))

    run_cells(cells, results, run, "hitrate")
    write_hitrate_report(results)


def cmd_quantspec(a, runner, methods, results):
    """QuantSpec's acceptance rate by draft length (quantspec.txt Table 3's measure): greedy summaries
    of essay windows, gamma = 0 (the target alone over the same cache) as the reference every gamma
    must equal token for token."""
    from siblings import quantspec
    bad = [m.name for m in methods if m.kind != "quantspec"]
    if bad:
        raise SystemExit(f"error: quantspec runs the quantspec cache (quantspec[-gN]), not {', '.join(bad)}")
    draft = quantspec.make_draft(runner.model, a.draft_group)
    steps = quantspec.Steps().compiled(runner.device) if a.compile else quantspec.Steps()
    cells = [(dict(base_fields("quantspec", a, m), length=L, sample=i, gamma=g, max_new=a.max_new_tokens,
                   draft_group=a.draft_group), m)
             for L in a.lengths for i in range(a.samples) for m in methods for g in a.gammas]

    def run(f, m):
        ids = runner.encode_prompt(summary_prompt(runner.tok, f["length"], f["sample"]))
        g = f["gamma"]
        seq_len = runner.fixed_len or len(ids) + f["max_new"] + g + 2
        quantspec.setup_caches(runner.model, m, 1, seq_len, gamma=max(g, 1))
        quantspec.share_caches(draft, runner.model)
        out, st = quantspec.generate_quantspec(runner.model, draft, runner.torch.tensor([ids], device=runner.device), g,
                                                runner.gen.Decoding(f["max_new"], eos_ids=frozenset(runner.tok.eos_ids)),
                                                replace(steps, prefill=runner.prefill_step()))
        return dict(label=m.name, tokens=[int(t) for t in out[0]], prompt_tokens=len(ids),
                    acceptance=st["acceptance_rate"], rounds=st["rounds"], accepted=st["accepted"],
                    drafted=st["drafted"], decode_tok_s=round(st["decode_tok_s"], 2))

    run_cells(cells, results, run, "quantspec")
    write_quantspec_report(results)


def cmd_saliency(a, runner, methods, results):
    """ZipCache's saliency from probe tokens (eq. 9: 5% recent + 5% random) against the exact
    normalized attention (eq. 8, every token a probe), per layer, on essay windows: how much of the
    exact salient set the probes select, per key group (what the cache keeps: round(ratio x group)
    per group) and over the whole prompt (the paper's top ratio); and the same for H2O's accumulated
    attention (eq. 7), the metric eq. 8 corrects."""
    from siblings.zipcache import normalized_attention, probe_positions
    cells = [(dict(cmd="saliency", model=a.checkpoint.name, length=L, sample=i, ratio=a.salient_ratio, group=g), None)
             for L in a.lengths for i in range(a.samples) for g in a.group_list]

    def overlap(score, want, n, group=None):
        """|top-n of score ∩ top-n of want| / n, per (group of) row(s), averaged."""
        if group:
            score, want = score.unflatten(-1, (-1, group)), want.unflatten(-1, (-1, group))
        a_idx, b_idx = score.topk(n, -1).indices, want.topk(n, -1).indices
        hits = torch.zeros_like(score, dtype=torch.bool).scatter(-1, a_idx, True).gather(-1, b_idx)
        return float(hits.float().mean())

    def run(f, _):
        L, g = f["length"], f["group"]
        ids = essay_window(runner.tok, f["sample"] * 2 * L, L)
        L = L // g * g  # whole key groups
        prompt = torch.tensor([ids[:L]], device=runner.device)
        w, args = runner.model.tok_embeddings.weight, runner.model.args
        recorders = runner.model.setup_caches(lambda i: Recorder(1, args.n_kv_heads, L, args.head_dim, w.dtype, w.device))
        with torch.no_grad():
            runner.model(prompt, torch.arange(L, device=runner.device), mode="prefill")
        out = {key: [] for key in ("group", "global", "accumulated")}
        sm_scale = args.head_dim ** -0.5
        for rec in recorders:
            k, _, _, q = rec.recording()
            acc, cnt = torch.zeros(k.shape[:3]), torch.zeros(k.shape[:3])
            for c0 in range(0, L, 256):  # every token a probe, in chunks of queries
                a_c, n_c = normalized_attention(q[:, :, c0:c0 + 256], k, torch.arange(c0, min(L, c0 + 256)), sm_scale)
                acc, cnt = acc + a_c, cnt + n_c
            exact = acc / cnt
            probes = probe_positions(L)
            p_acc, p_cnt = normalized_attention(q[:, :, probes], k, probes, sm_scale)
            approx = p_acc / p_cnt.clamp(min=1)
            n_group, n_all = round(f["ratio"] * g), round(f["ratio"] * L)
            out["group"].append(overlap(approx, exact, n_group, g))
            out["global"].append(overlap(approx, exact, n_all))
            out["accumulated"].append(overlap(acc, exact, n_all))
        return dict(label=f"ratio {f['ratio']:g}, group {g}", prompt_tokens=L, probes=len(probe_positions(L)),
                    **{f"layer_{key}": v for key, v in out.items()}, **{key: mean(v) for key, v in out.items()})

    run_cells(cells, results, run, "saliency")
    write_saliency_report(results)


def cmd_prompt(a):
    """A NIAH prompt of about --length tokens as generate.py counts them: the chat form's user turn
    (generate.py --chat wraps it) or the completion form's text (generate.py adds the BOS)."""
    from tokenizer import load_tokenizer

    if a.hf:
        from integrations import hf
        try:
            tok = hf.load_tokenizer(a.hf)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
    elif not (a.checkpoint / "config.json").exists():
        raise SystemExit(f"error: no checkpoint at {a.checkpoint} (its tokenizer measures the length)")
    else:
        tok = load_tokenizer(a.checkpoint)
    s = niah(tok, a.length, a.depth, a.prompt_form)
    # no newline after a completion: it would be the prompt's last token, where the answer starts
    sys.stdout.write(s.prompt + ("\n" if s.form == "chat" else ""))


# ==== CLI =============================================================================================================
QUICK = {  # a few minutes each on 1 CPU thread with SmolLM2-135M, still showing the methods apart
    "niah": dict(methods="full,kivi-1bit,specache-1bit", lengths="1000,2000", depths="0,0.5,1.0"),
    "ruler": dict(methods="full,kivi-1bit,specache-1bit", lengths="1000", samples=1,
                  tasks="niah_single_1,niah_single_2,niah_multikey_2,niah_multivalue,vt,qa_squad"),
    "ppl": dict(methods="full,kivi-1bit,specache-1bit", lengths="1024,2048", n_eval=64, windows=1),
    "hitrate": dict(methods="specache-1bit,specache-2bit", lengths="2000", samples=1, steps=120),
    "quantspec": dict(lengths="1000", samples=1, gammas="0,2,4", max_new_tokens=32),
    "saliency": dict(lengths="1000", samples=1),
}
DEFAULTS = {
    "niah": dict(methods="full,kivi-1bit,specache-1bit", lengths="1000,2000,3000,4000", depths="0,0.25,0.5,0.75,1.0"),
    "ruler": dict(methods="full,kivi-2bit,specache-2bit,kivi-1bit,specache-1bit", lengths="4000", samples=5, tasks=""),
    "ppl": dict(methods="full,kivi-1bit,kivi-1bit-orig,specache-1bit,specache-1bit-orig", lengths="2048,4096,8192",
                n_eval=256, windows=2),
    "hitrate": dict(methods="specache-1bit,specache-2bit", lengths="4000", samples=2, steps=500),
    "quantspec": dict(methods="quantspec", lengths="4000,8000", samples=2, gammas="0,1,2,4,6", max_new_tokens=128),
    "saliency": dict(methods="full", lengths="2000,4000", samples=2),
}
HIT_PROMPTS = ("essay", "needle", "qa_squad", "qa_hotpot")
BATCH_HELP = ("decode this many prompts of a cache together, one left-padded batch (the same rows as alone where "
              "the paddings are multiples of the residual window; the rows' stats are the batch's)")
PROMPT_FORM_HELP = ("chat (default): the question in the model's chat template (instruct models); completion: "
                    "text that a base model continues (tools/tasks.py)")
SUBCOMMANDS = {  # name: (help, its own options)
    "niah": ("needle in a haystack grid + heatmap", [
        ("--prompt-form", dict(default="chat", choices=PROMPT_FORMS, help=PROMPT_FORM_HELP)),
        ("--depths", dict(default=None, help="needle depths in [0, 1]")),
        ("--needles", dict(default="0", help="which needles (tools/tasks.py NEEDLES; 0: Kamradt's)")),
        ("--max-new-tokens", dict(type=int, default=32)),
        ("--batch", dict(type=int, default=1, help=BATCH_HELP))]),
    "ruler": ("RULER-style tasks", [
        ("--prompt-form", dict(default="chat", choices=PROMPT_FORMS, help=PROMPT_FORM_HELP)),
        ("--tasks", dict(default=None, help=f"comma list of: {', '.join(RULER_TASKS)} (default all)")),
        ("--samples", dict(type=int, default=None)),
        ("--first-sample", dict(type=int, default=0, help="run samples FIRST_SAMPLE..SAMPLES-1 only (0-based)")),
        ("--max-new-tokens", dict(type=int, default=None, help="default per task (32-64)")),
        ("--batch", dict(type=int, default=1, help=BATCH_HELP))]),
    "ppl": ("perplexity through the decode path", [
        ("--n-eval", dict(type=int, default=None, help="scored tokens at the end of each window")),
        ("--windows", dict(type=int, default=None, help="windows per length")),
        ("--stride", dict(type=int, default=None, help="tokens between window starts (default: the length)")),
        ("--text", dict(default="essays", choices=list(PPL_TEXTS), help="the windows' text: the essays, or RULER QA's "
                        "documents one after another (squad: SQuAD's paragraphs, hotpot: HotpotQA's)"))]),
    "hitrate": ("SpeCache fetch quality (hit rates, attention mass, output error) by step and layer", [
        ("--prompt-form", dict(default="chat", choices=PROMPT_FORMS, help=PROMPT_FORM_HELP)),
        ("--samples", dict(type=int, default=None)),
        ("--steps", dict(type=int, default=None, help="decode steps (stops earlier at EOS)")),
        ("--prompts", dict(default="essay", help="comma list of: essay (summaries), needle (NIAH prompts), qa_squad, "
                           "qa_hotpot (RULER's QA prompts, as `ruler` asks them at --seed)"))]),
    "quantspec": ("QuantSpec acceptance rates by draft length (quantspec cache)", [
        ("--samples", dict(type=int, default=None)),
        ("--gammas", dict(default=None, help="draft lengths (0 = the target alone, the reference)")),
        ("--draft-group", dict(type=int, default=32, choices=[32, 64, 128, 256], help="INT4 weight group")),
        ("--max-new-tokens", dict(type=int, default=None))]),
    "saliency": ("ZipCache: probe-token saliency against exact normalized attention", [
        ("--samples", dict(type=int, default=None)),
        ("--salient-ratio", dict(type=float, default=0.4, help="share of tokens called salient"))]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prompt", help="print a NIAH prompt (chat: the user turn) of about --length tokens")
    pr.add_argument("--length", type=int, default=3000)
    pr.add_argument("--depth", type=float, default=0.5)
    pr.add_argument("--prompt-form", default="chat", choices=PROMPT_FORMS, help=PROMPT_FORM_HELP)
    pr.add_argument("--checkpoint", type=Path, default=None, help=f"default {DEFAULT_CHECKPOINT.relative_to(ROOT)}")
    pr.add_argument("--hf", type=Path, default=None, help="the tokenizer of a transformers model directory instead")
    for cmd, (helptext, options) in SUBCOMMANDS.items():
        s = sub.add_parser(cmd, help=helptext)
        s.add_argument("--out", type=Path, required=True, help="results folder (reruns resume into it)")
        s.add_argument("--quick", action="store_true", help="a few-minute smoke grid (explicit options still win)")
        s.add_argument("--methods", default=None, help=METHOD_HELP)
        s.add_argument("--k", default=None, help="SpeCache rows fetched per layer and kv head (64); a list sweeps")
        s.add_argument("--group", default=None, help="quantization group size (64); a list sweeps")
        s.add_argument("--residual", default=None, help="fp residual window (default 128 KIVI, 64 SpeCache); a list sweeps")
        s.add_argument("--lengths", default=None, help="prompt lengths in tokens")
        s.add_argument("--checkpoint", type=Path, default=None, help=f"default {DEFAULT_CHECKPOINT.relative_to(ROOT)}")
        s.add_argument("--hf", type=Path, default=None, help="a transformers model directory instead (hf.py)")
        s.add_argument("--device", default="cpu")
        s.add_argument("--threads", type=int, default=1)
        s.add_argument("--compile", action="store_true", help="compile the decode step (one cache size per run)")
        s.add_argument("--prefill-chunk", type=int, default=2048)
        s.add_argument("--seed", type=int, default=0)
        for flag, kw in options:
            s.add_argument(flag, **kw)
    a = p.parse_args(argv)
    if a.hf and a.checkpoint:
        raise SystemExit("error: --hf DIR and --checkpoint DIR both name the model: give one")
    a.checkpoint = a.checkpoint or DEFAULT_CHECKPOINT
    if a.cmd == "prompt":
        if a.length < 1 or not 0 <= a.depth <= 1:
            raise SystemExit("error: --length must be >= 1 and --depth in [0, 1]")
        return a
    if a.hf:
        a.checkpoint = a.hf  # its name labels the results
    for name, value in {**DEFAULTS[a.cmd], **(QUICK[a.cmd] if a.quick else {})}.items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    a.lengths = parse_int_list(a.lengths, "lengths")
    if a.cmd == "niah":
        a.depths, a.needles = [float(x) for x in a.depths.split(",")], parse_int_list(a.needles, "needles", low=0)
        if max(a.needles) >= len(NEEDLES):
            raise SystemExit(f"error: --needles: there are {len(NEEDLES)} needles (0-{len(NEEDLES) - 1})")
        if any(not 0 <= d <= 1 for d in a.depths):
            raise SystemExit("error: --depths are fractions in [0, 1]")
    if a.cmd == "hitrate":
        bad = [k for k in a.prompts.split(",") if k not in HIT_PROMPTS]
        if bad:
            raise SystemExit(f"error: --prompts: unknown prompt kind {bad[0]!r}; known: {', '.join(HIT_PROMPTS)}")
    if a.cmd == "quantspec":
        a.gammas = parse_int_list(a.gammas, "gammas", low=0)
    if a.cmd == "saliency":
        a.group_list = parse_int_list(a.group or "64", "group")
        if not 0 < a.salient_ratio <= 1:
            raise SystemExit(f"error: --salient-ratio must be in (0, 1], got {a.salient_ratio}")
    for flag in ("samples", "steps", "n_eval", "windows", "max_new_tokens", "threads", "prefill_chunk", "stride", "batch"):
        value = getattr(a, flag, None)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1, got {value}")
    if a.cmd == "ruler" and not 0 <= a.first_sample < a.samples:
        raise SystemExit(f"error: --first-sample must be in [0, --samples), got {a.first_sample}")
    sweep = lambda text, what: parse_int_list(text, what) if text else [None]  # noqa: E731
    try:
        a.method_list = expand_methods(a.methods, sweep(a.k, "k"), sweep(a.group, "group"), sweep(a.residual, "residual"))
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if not a.method_list:
        raise SystemExit("error: --methods names no cache")
    a.cache_len = max(a.lengths) + 600  # --compile: every prompt gets caches of this size
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.cmd == "prompt":
        return cmd_prompt(a)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    sys.path.insert(0, str(ROOT))
    # torchrun: the cells are spread over the ranks, one model per rank (docs/tp.md)
    a.device = str(init_cells(torch.device(a.device), a.out / "results.jsonl"))
    runner = Runner(a)
    results = Results(a.out)
    print(f"{a.cmd}: {', '.join(m.name for m in a.method_list)} -> {a.out}", file=sys.stderr)
    {"niah": cmd_niah, "ruler": cmd_ruler, "ppl": cmd_ppl, "hitrate": cmd_hitrate,
     "quantspec": cmd_quantspec, "saliency": cmd_saliency}[a.cmd](a, runner, a.method_list, results)
    print((results.dir / "results.md").read_text())


if __name__ == "__main__":
    tp.main(main)
