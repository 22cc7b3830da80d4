"""tools/eval.py's intervals and its other texts and prompts: per-token NLLs in ppl rows and the bootstrap
over them, the QA documents as perplexity text, RULER's QA prompts in hitrate, Wilson intervals in the
RULER report. The model is a tiny random Llama; the real tokenizer is used where a converted checkpoint exists."""
import json
import math
import random
import zlib
from types import SimpleNamespace

import pytest

from tests.test_eval import HashTokenizer, WordTokenizer, real_tok, tiny_runner  # noqa: F401 (real_tok: a fixture)
from tools import eval as ev
from tools import eval_report as er
from tools import tasks as tk


# ---- the bootstrap ---------------------------------------------------------------------------------------
def test_bootstrap_known_cases():
    rng = random.Random(0)
    xs = [rng.uniform(1, 4) for _ in range(300)]
    assert er.bootstrap_mean(xs, xs) == (0.0, 0.0, 0.0)  # identical caches: zero width at 0
    m, lo, hi = er.bootstrap_mean([x + 0.25 for x in xs], xs)  # a constant shift: that shift, zero width
    assert m == lo == pytest.approx(0.25, abs=1e-12) and hi == pytest.approx(0.25, abs=1e-12)
    # two values: a resample's mean is 0, 0.5 or 1 with chances 1/4, 1/2, 1/4, so the 95% interval is [0, 1]
    assert er.bootstrap_mean([0.0, 1.0]) == (0.5, 0.0, 1.0)
    assert er.bootstrap_mean([2.5]) == (2.5, 2.5, 2.5)
    # 50 zeros and 50 ones: the mean's standard error is 0.05, so about 0.5 -+ 1.96 x 0.05
    m, lo, hi = er.bootstrap_mean([0.0] * 50 + [1.0] * 50)
    assert m == 0.5 and lo == pytest.approx(0.402, abs=0.02) and hi == pytest.approx(0.598, abs=0.02)
    assert er.bootstrap_mean(xs) == er.bootstrap_mean(xs)  # deterministic in the seed
    assert er.bootstrap_mean(xs, seed=1) != er.bootstrap_mean(xs)
    assert er.bootstrap_mean([]) is None
    with pytest.raises(ValueError, match="paired bootstrap over 2 and 1 values"):
        er.bootstrap_mean([1.0, 2.0], [1.0])


def test_block_bootstrap_widens_for_runs_of_alike_values():
    """Runs of 10 alike values: resampling tokens sees 100 independent values (about 0.5 -+ 0.1), runs of 10
    see 10 (about 0.5 -+ 0.31); block=1 is the token bootstrap; values after the last whole run count in the
    mean only; a block of 0 or longer than the values is an error."""
    xs = ([0.0] * 10 + [1.0] * 10) * 5
    m1, lo1, hi1 = er.bootstrap_mean(xs)
    assert er.bootstrap_mean(xs, block=1) == (m1, lo1, hi1)
    m, lo, hi = er.bootstrap_mean(xs, block=10)
    assert m == m1 == 0.5 and hi - lo > 2.5 * (hi1 - lo1)
    assert lo == pytest.approx(0.2, abs=0.1) and hi == pytest.approx(0.8, abs=0.1)
    m, lo, hi = er.bootstrap_mean(xs + [7.0] * 5, block=10)  # 5 values past the last run of 10
    assert m == pytest.approx(sum(xs + [7.0] * 5) / 105) and hi <= 1.0
    assert er.bootstrap_mean([x + 0.5 for x in xs], xs, block=10) == (0.5, 0.5, 0.5)  # paired: the runs of differences
    for bad in (0, 101):
        with pytest.raises(ValueError, match=f"1 <= block <= 100 values, not block={bad}"):
            er.bootstrap_mean(xs, block=bad)


def ppl_row(r, label, nlls=None, nll=None, **fields):
    f = dict(cmd="ppl", model="m", method=label, length=1000, window=0, start=0, n_eval=len(nlls or [0] * 100), **fields)
    rec = dict(f, label=label, nll=nll if nll is not None else sum(nlls) / len(nlls), n=f["n_eval"], bits=16.0)
    r.add(ev.Results.key(f), dict(rec, nlls=nlls) if nlls else rec)


def test_ppl_report_intervals_paired_against_the_fp_cache(tmp_path):
    """Each cache's perplexity with its bootstrap interval; its change against `full` paired over the same
    tokens (a constant shift of log 1.1 a token: +10.0% with no width), over tokens and over runs of 50; rows
    without per-token NLLs: '-'; with two texts at a length, an `all` row pools both texts' windows."""
    r = ev.Results(tmp_path)
    rng = random.Random(0)
    full = [round(rng.uniform(0.5, 4.0), 5) for _ in range(400)]
    ppl_row(r, "full", full)
    ppl_row(r, "specache-1bit", [x + math.log(1.1) for x in full])
    ppl_row(r, "kivi-1bit", nll=3.0)  # an old row: the mean only
    ppl_row(r, "full", [2.0] * 100, text="squad")
    ppl_row(r, "specache-1bit", [2.0] * 100, text="squad")
    ev.write_ppl_report(r)
    md = (tmp_path / "results.md").read_text()
    m, lo, hi = er.bootstrap_mean(full)
    assert lo < m < hi
    assert f"| full | essays | 1000 | 400 | {math.exp(m):.3f} [{math.exp(lo):.3f}, {math.exp(hi):.3f}] |  |  |" in md
    assert "| specache-1bit | essays | 1000 | 400 | " in md and " | +10.0% [+10.0, +10.0] | +10.0% [+10.0, +10.0] |" in md
    assert "| kivi-1bit | essays | 1000 | 100 | 20.086 - | - | - |" in md
    assert "| specache-1bit | squad | 1000 | 100 | 7.389 [7.389, 7.389] | +0.0% [+0.0, +0.0] | +0.0% [+0.0, +0.0] |" in md
    # pooled: 400 tokens shifted by log 1.1 and 100 not, so 1.1 ** 0.8 - 1 = +7.9%, now with a width
    pooled = next(line for line in md.splitlines() if line.startswith("| specache-1bit | all | 1000 | 500 | "))
    change, runs = pooled.split(" | ")[5:7]
    assert change.startswith("+7.9% [") and change != "+7.9% [+7.9, +7.9]" and runs.startswith("+7.9% [")
    assert "| kivi-1bit | all | 1000 | 100 | 20.086 - | - | - |" in md
    # the summary table: essays under their old header, the squad window in a column of its own
    assert "| method | bits | ppl @1000 | ppl squad @1000 | mean NLL | cells |" in md
    assert "| kivi-1bit | 16.00 | 20.086 | - |" in md


def test_ppl_rows_keep_every_token_and_resume(tmp_path, monkeypatch):
    """tools/eval.py ppl on a tiny model: every row keeps its tokens' NLLs (5 decimals, their mean the row's
    nll) through the results file; --text joins the key (not for the essays: older rows resume); a window
    past the text's end is one error line."""
    r = tiny_runner()
    stream = {"essays": [random.Random(1).randrange(256) for _ in range(600)],
              "squad": [random.Random(2).randrange(256) for _ in range(300)]}
    monkeypatch.setattr(ev, "text_ids", lambda tok, text, n: stream[text][:n])
    monkeypatch.setattr(ev, "text_window", lambda tok, text, s, L: stream[text][s:s + L])
    a = SimpleNamespace(checkpoint=tmp_path / "tiny", lengths=[200], windows=2, stride=None, n_eval=12,
                        prefill_chunk=2048, text="essays")
    results = ev.Results(tmp_path)
    ev.cmd_ppl(a, r, ev.expand_methods("full,kivi-1bit"), results)
    a.text = "squad"
    a.windows = 1
    ev.cmd_ppl(a, r, ev.expand_methods("full,kivi-1bit"), results)
    rows = ev.Results(tmp_path).of("ppl")  # read back from the file
    assert len(rows) == 6
    for row in rows:
        assert len(row["nlls"]) == row["n"] == 12 and all(x == round(x, 5) for x in row["nlls"])
        assert sum(row["nlls"]) / 12 == pytest.approx(row["nll"], abs=1e-5)
        assert ('"text"' in row["key"]) == (row["text"] == "squad")
    assert [row["start"] for row in rows] == [0, 0, 200, 200, 0, 0]
    assert rows[0]["nlls"] != rows[4]["nlls"]  # another text, other tokens
    md = (tmp_path / "results.md").read_text()
    assert "| kivi-1bit | squad | 200 | 12 |" in md and "| full | essays | 200 | 24 |" in md
    n = len(ev.Results(tmp_path).records)
    ev.cmd_ppl(a, r, ev.expand_methods("full,kivi-1bit"), results)  # resumes: nothing to run
    assert len(ev.Results(tmp_path).records) == n
    a.windows = 2
    with pytest.raises(SystemExit, match=r"^error: window 1 of 200 tokens at stride 200 runs past the squad \(300 tokens"):
        ev.cmd_ppl(a, r, ev.expand_methods("full"), results)
    assert ev.parse_args(["ppl", "--out", "x"]).text == "essays"
    assert ev.parse_args(["ppl", "--out", "x", "--text", "hotpot"]).text == "hotpot"
    with pytest.raises(SystemExit):
        ev.parse_args(["ppl", "--out", "x", "--text", "novels"])


# ---- the QA documents as perplexity text -----------------------------------------------------------------
def test_qa_documents_are_qa_datas_in_file_order():
    for dataset in ("squad", "hotpotqa"):
        docs = tk.qa_documents(dataset)
        assert len(docs) == len(set(docs)) and set(docs) == set(tk.qa_data(dataset)[1])
    squad = json.loads(tk.ruler_json("squad.json").read_text())["data"]
    assert tk.qa_documents("squad")[:2] == [p["context"] for p in squad[0]["paragraphs"][:2]]


def test_text_streams_word_tokenizer():
    """Each text's stream is deterministic and prefix-stable (a longer stream starts with a shorter one);
    a window is BOS (where the tokenizer adds one) and the stream from its start."""
    tok = WordTokenizer()
    for text in ("squad", "hotpot"):
        ids = tk.text_ids(tok, text, 20000)
        assert len(ids) == 20000 and ids[:5000] == tk.text_ids(tok, text, 5000)
        assert tk.text_window(tok, text, 1000, 3000) == ids[1000:4000]
    assert tk.text_ids(tok, "squad", 100) != tk.text_ids(tok, "hotpot", 100)
    assert tk.text_ids(tok, "squad", 8)[:3] == tk.qa_documents("squad")[0].split()[:3]
    assert tk.text_window(tok, "essays", 100, 50) == tk.essay_window(tok, 100, 50)

    class Bos(WordTokenizer):
        bos_id, add_bos = "<s>", True
    w = tk.text_window(Bos(), "hotpot", 10, 100)
    assert len(w) == 100 and w[0] == "<s>" and w[1:] == tk.text_ids(Bos(), "hotpot", 109)[10:]


def test_text_streams_fill_a_16k_window_with_the_real_tokenizer(real_tok):  # noqa: F811
    for text in ("squad", "hotpot"):
        tk.text_ids.cache_clear()
        ids = tk.text_ids(real_tok, text, 16000)
        tk.text_ids.cache_clear()
        assert len(ids) == 16000 and tk.text_ids(real_tok, text, 16000) == ids  # deterministic
        w = tk.text_window(real_tok, text, 0, 16000)
        assert len(w) == 16000 and max(w) < 49152  # SmolLM2's vocabulary
        doc = tk.qa_documents(tk.PPL_TEXTS[text])[0]
        assert real_tok.decode(ids[:2000]).startswith(doc)


# ---- RULER's QA prompts in hitrate ------------------------------------------------------------------------
def test_hitrate_qa_prompts(tmp_path):
    """hitrate --prompts qa_squad,qa_hotpot: the prompt `ruler` asks (the same sample and seed, chat form),
    the seed in the key; the report has the per-layer hit table by prompt kind; unknown kinds are an error."""
    from tests.helpers import tiny_model
    r = tiny_runner()
    r.tok, r.model = HashTokenizer(), tiny_model(max_seq_len=2048)  # (HotpotQA's two gold documents: 800 words)
    asked = []
    r.encode_prompt = lambda text: asked.append(text) or [zlib.crc32(w.encode()) % 256 for w in text.split()]
    a = SimpleNamespace(checkpoint=tmp_path / "tiny", prompts="qa_squad,qa_hotpot", lengths=[1200], samples=1, steps=4,
                        prompt_form="chat", seed=3)
    results = ev.Results(tmp_path)
    ev.cmd_hitrate(a, r, ev.expand_methods("specache-1bit-k8-g16-r16"), results)
    rows = results.of("hitrate")
    assert [x["prompt"] for x in rows] == ["qa_squad", "qa_hotpot"]
    assert all(x["seed"] == 3 and '"seed": 3' in x["key"] and x["prompt_tokens"] <= 1200 for x in rows)
    assert asked == [tk.render(r.tok, tk.ruler_sample(r.tok, t, 1200, 0, seed=3)) for t in ("qa_squad", "qa_hotpot")]
    assert asked[0].startswith("<user> Answer the question based on the given documents.")
    md = (tmp_path / "results.md").read_text()
    assert "| layer | specache-1bit-k8-g16-r16 (qa_hotpot) | specache-1bit-k8-g16-r16 (qa_squad) |" in md
    hot, squad = rows[1]["layer_hit"], rows[0]["layer_hit"]
    assert f"| 1 | {100 * hot[1]:.1f} | {100 * squad[1]:.1f} |" in md
    assert (tmp_path / "layers.png").stat().st_size > 1000
    assert ev.parse_args(["hitrate", "--out", "x", "--prompts", "needle,qa_hotpot"]).prompts == "needle,qa_hotpot"
    with pytest.raises(SystemExit, match=r"^error: --prompts: unknown prompt kind 'qa'; known: essay, needle, qa_squa"):
        ev.parse_args(["hitrate", "--out", "x", "--prompts", "needle,qa"])


def test_hitrate_qa_prompts_at_16k_with_the_real_tokenizer(real_tok):  # noqa: F811
    for task in ("qa_squad", "qa_hotpot"):
        s = tk.ruler_sample(real_tok, task, 16000, 0)
        n = len(real_tok.encode(tk.render(real_tok, s)))
        assert 15840 <= n <= 16000 and any(a in s.prompt for a in s.answers)


# ---- the RULER report's intervals --------------------------------------------------------------------------
def test_ruler_report_has_wilson_intervals_per_task(tmp_path):
    r = ev.Results(tmp_path)
    for lb, task, scores in (("full", "qa_squad", [1, 1, 1, 1]), ("full", "qa_hotpot", [0, 0]),
                             ("kivi-1bit", "qa_squad", [0.0])):
        for i, score in enumerate(scores):
            f = dict(cmd="ruler", method=lb, task=task, length=16000, sample=i)
            r.add(ev.Results.key(f), dict(f, label=lb, score=float(score)))
    ev.write_ruler_report(r)
    md = (tmp_path / "results.md").read_text()
    assert "| full | 16000 | 2 | 100.0 | 0.0 | 50.0 |" in md  # n: the fewest samples of a task
    # Wilson at n = 4, all right: [4 / (4 + 1.96^2), 1]; n = 2, none: [0, 1.96^2 / (2 + 1.96^2)]
    pooled = tk.fmt_interval((4 / 6, *tk.wilson(4 / 6, 6)))
    assert f"| full | 16000 | 100.0 [51, 100] (4) | 0.0 [0, 66] (2) | {pooled} (6) |" in md
    assert "| kivi-1bit | 16000 | 0.0 [0, 79] (1) | - | 0.0 [0, 79] (1) |" in md
    assert "| method | length | QA-1 | QA-2 | pooled |" in md


def test_sign_test_known_cases():
    assert tk.sign_test_p(0, 10) == pytest.approx(2 / 2 ** 10)  # every discordant prompt one way
    assert tk.sign_test_p(10, 0) == tk.sign_test_p(0, 10)
    assert tk.sign_test_p(1, 3) == pytest.approx(2 * (1 + 4) / 16)  # P(X <= 1 | n = 4), both tails
    assert tk.sign_test_p(0, 5) == pytest.approx(0.0625)  # five of five: not below 0.05
    assert tk.sign_test_p(5, 5) == 1.0 and tk.sign_test_p(0, 0) == 1.0  # capped; no discordant prompt


def test_qwen_hit_table_pools_steps_and_weighs_layers_by_steps(tmp_path, capsys):
    import importlib.util
    from tests.helpers import ROOT
    spec = importlib.util.spec_from_file_location("hit_table", ROOT / "results/qwen/hit_table.py")
    ht = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ht)
    m = "specache-1bit"
    rows = [dict(method=m, label=m, prompt="qa_squad", sample=0, hit=[0.5, 0.7, None], err=[0.2, 0.2], err_topk=[0.1, 0.1],
                 err_none=[0.6, 0.6], exact=[1, 0], layer_hit=[0.4, 0.8]),
            dict(method=m, label=m, prompt="qa_squad", sample=1, hit=[0.9], err=[0.5], err_topk=[0.4], err_none=[0.9],
                 exact=[1], layer_hit=[1.0, 0.5]),
            dict(method=m, label=m, prompt="needle", sample=0, hit=[0.0], layer_hit=[0.0, 0.0])]  # not a QA prompt: left out
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ht.main(path)
    out = capsys.readouterr().out
    # hit: (0.5 + 0.7 + 0.9) / 3 steps; prompts' means 60% and 90%; layers (2 x 0.4 + 1 x 1.0) / 3 = 60%,
    # (2 x 0.8 + 1 x 0.5) / 3 = 70%
    assert "| SpeCache 1-bit, paper | SQuAD | 2 | 3 | 70.0% | 60-90% | 30.0% | 20.0% | 70.0% | 66.7% | 60-70% |" in out
    assert "| SpeCache 1-bit, paper | both | 2 | 3 | 70.0% |" in out and "HotpotQA" not in out


def test_qwen_qa_table_pairs_the_presses_with_the_fp_cache_and_refuses_other_prompts(tmp_path, capsys):
    import importlib.util
    from tests.helpers import ROOT
    spec = importlib.util.spec_from_file_location("qa_table", ROOT / "results/qwen/qa_table.py")
    qt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qt)

    def row(method, task, sample, score, **f):
        return dict(cmd="ruler", method=method, task=task, sample=sample, score=score, prompt_tokens=100,
                    answers=[f"a{sample}"], **f)
    project = [row("full", "qa_squad", 0, 1.0, resyncs=0, decode_steps=5), row("full", "qa_squad", 1, 0.0, decode_steps=7),
               row("full", "qa_hotpot", 0, 1.0, decode_steps=4)]
    presses = [row("no_press", "qa_squad", 0, 1.0), row("no_press", "qa_squad", 1, 0.0),
               row("snapkv+qa@specache-1bit-best", "qa_squad", 0, 0.0),
               row("snapkv+qa@specache-1bit-best", "qa_squad", 1, 1.0),
               row("snapkv+qa@specache-1bit-best", "qa_hotpot", 0, 0.0),
               dict(row("snapkv+qa@specache-1bit", "qa_squad", 0, 1.0)),  # another budget: not in the table
               dict(row("no_press", "niah", 0, 1.0), cmd="niah")]
    rows, press = tmp_path / "rows.jsonl", tmp_path / "presses.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in project))
    press.write_text("".join(json.dumps(r) + "\n" for r in presses))
    qt.main(rows, press)
    out = capsys.readouterr().out.splitlines()
    snap = next(line for line in out if line.startswith("| SnapKV with the question"))
    assert "| 50.0 [9, 91] (2) | 0.0 [0, 79] (1) | 33.3 [6, 79] (3) | 1 / 2 of 3 (p = 1) | 1 (of 2) |  |" in snap
    assert any(line.startswith("| kvpress `no_press`") and "0 / 0 of 2" in line for line in out)
    assert "| 0 / 16 |" in next(line for line in out if line.startswith("| fp16"))
    qt.main(rows, press, against="no_press")  # paired with kvpress's fp cache instead (2 samples in common)
    out = capsys.readouterr().out.splitlines()
    assert "right where kvpress `no_press`" in out[0]
    assert "| 1 / 1 of 2 (p = 1) |" in next(line for line in out if line.startswith("| SnapKV with the question"))
    assert "| 0 / 0 of 2 (p = 1) |" in next(line for line in out if line.startswith("| fp16"))
    with pytest.raises(SystemExit, match="--against kivi-1bit: no rows of it"):
        qt.main(rows, press, against="kivi-1bit")
    qt.main(rows, tmp_path / "absent.jsonl")  # no presses' rows yet: the project's table alone
    assert "SnapKV" not in capsys.readouterr().out
    # Holm: the i-th smallest p times (m - i + 1), kept monotone, in the order given
    assert qt.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert qt.holm([0.002, 0.6]) == pytest.approx([0.004, 0.6]) and qt.holm([0.4, 0.3]) == pytest.approx([0.6, 0.6])
    press.write_text(json.dumps(dict(presses[2], prompt_tokens=99)) + "\n")  # a prompt of another length
    with pytest.raises(SystemExit, match="qa_squad sample 0 is not the prompt"):
        qt.main(rows, press)
