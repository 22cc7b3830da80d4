"""tools/tasks.py (task generators, scorers) and tools/eval.py (results resume, reports, method names). No model
needed; the real tokenizer is used where a converted checkpoint exists (else those checks are skipped)."""
import json
import re
from pathlib import Path

import pytest

from tools import eval as ev
from tools import eval_report
from tools import tasks as tk
from tools.replay import PrefillReplay

CKPT = Path(ev.DEFAULT_CHECKPOINT)


class WordTokenizer:
    """Tokenizer-free length check: one token per whitespace-separated word; a chat template
    that adds a fixed number of tokens, like a real one."""
    eos_ids, bos_id, add_bos, bos_text = set(), None, False, ""

    def encode(self, text, bos=False):
        return re.findall(r"\S+", text)

    def decode(self, ids):
        return " ".join(ids)

    def chat(self, prompt):
        return f"<user> {prompt} <assistant>"


@pytest.fixture(scope="module")
def real_tok():
    if not (CKPT / "config.json").exists():
        pytest.skip(f"no converted checkpoint at {CKPT} (run `make demo`): real-tokenizer lengths not checked")
    from tokenizer import load_tokenizer
    return load_tokenizer(CKPT)


def n_tok(tok, s):
    return len(tok.encode(tk.render(tok, s)))


# ---- NIAH ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_niah_needle_once_at_depth_and_length(depth):
    tok = WordTokenizer()
    s = tk.niah(tok, 2000, depth)
    assert s.prompt.count(tk.NEEDLE) == 1
    assert abs(n_tok(tok, s) - 2000) <= 20  # within 1%
    context = s.prompt[: s.prompt.rindex("\n\n" + tk.QUESTION)]
    at = context.index(tk.NEEDLE)
    assert at == s.meta["needle_char"]
    frac = at / (len(context) - len(tk.NEEDLE))
    assert abs(frac - depth) < 0.03, (frac, depth)
    if 0 < depth < 1:  # at a sentence boundary: the needle starts after a sentence end
        assert re.search(r"[.!?][\"')\]]*\s+$", context[:at])
    assert s.prompt.endswith(f"{tk.QUESTION} {tk.RETRIEVAL_CUE}")


def test_niah_deterministic_and_real_tokenizer_length(real_tok):
    for L, d in ((1000, 0.5), (4000, 0.1)):
        s = tk.niah(real_tok, L, d)
        assert s.prompt == tk.niah(real_tok, L, d).prompt
        assert abs(n_tok(real_tok, s) - L) <= 0.01 * L
        assert s.prompt.count(tk.NEEDLE) == 1


class BosWordTokenizer(WordTokenizer):
    """A base model's tokenizer: adds BOS ("<s>", one word), no chat template."""
    bos_id, add_bos, bos_text = "<s>", True, "<s>"

    def chat(self, prompt):
        return prompt


@pytest.mark.parametrize("tok", [WordTokenizer(), BosWordTokenizer()], ids=["chat-template", "base"])
def test_niah_completion_form(tok):
    """The completion form: the haystack with the needle once, then the start of the needle's sentence
    for the model to finish (no question); BOS first where the tokenizer adds one; the length fits."""
    s = tk.niah(tok, 2000, 0.5, "completion")
    assert s.form == "completion" and s.prompt.count(tk.NEEDLE) == 1
    assert s.prompt.endswith("\n\n" + tk.COMPLETION_CUE) and tk.QUESTION not in s.prompt
    text = tk.render(tok, s)
    assert text == tok.bos_text + s.prompt and "<user>" not in text
    assert 1980 <= n_tok(tok, s) <= 2000
    assert abs(s.meta["needle_char"] / s.meta["context_chars"] - 0.5) < 0.03
    chat = tk.niah(tok, 2000, 0.5)
    assert chat.form == "chat" and chat.prompt.endswith(tk.RETRIEVAL_CUE) and tk.COMPLETION_CUE not in chat.prompt
    with pytest.raises(ValueError, match="unknown prompt form 'plain'"):
        tk.niah(tok, 2000, 0.5, "plain")


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "qa_squad"])
def test_ruler_completion_form_is_rulers_base_template(task):
    """RULER's `base` template: the task text, then a space and the answer prefix, no chat turn."""
    tok = BosWordTokenizer()
    s = tk.ruler_sample(tok, task, 2000, 0, form="completion")
    assert s.form == "completion" and s.prefix
    assert tk.render(tok, s) == "<s>" + s.prompt + " " + s.prefix
    assert 1980 <= n_tok(tok, s) <= 2000
    assert tk.ruler_sample(WordTokenizer(), task, 2000, 0).form == "chat"
    if task.startswith("niah"):
        assert s.prefix.startswith("The special magic") and all(s.prompt.count(a) == 1 for a in s.answers)


def test_completion_form_real_tokenizer_length(real_tok):
    for L in (1000, 4000):
        s = tk.niah(real_tok, L, 0.5, "completion")
        assert L - 0.01 * L <= len(real_tok.encode_prompt(s.prompt)) == n_tok(real_tok, s) <= L


def test_prompt_subcommand_prints_either_form(real_tok, capsys):
    """`tools/eval.py prompt`: the chat form's user turn (generate.py --chat wraps it) or the completion
    form's text (generate.py adds BOS), each about --length tokens as generate.py encodes it."""
    ev.main(["prompt", "--length", "800"])
    chat = capsys.readouterr().out[:-1]
    ev.main(["prompt", "--length", "800", "--prompt-form", "completion", "--depth", "0.25"])
    completion = capsys.readouterr().out  # (no newline at the end: it would be a prompt token)
    assert chat.endswith(tk.RETRIEVAL_CUE) and completion.endswith(tk.COMPLETION_CUE)
    assert 790 <= len(real_tok.encode_prompt(chat, chat=True)) <= 800
    assert 790 <= len(real_tok.encode_prompt(completion)) <= 800


def test_hf_and_checkpoint_together_is_one_error_line():
    for cmd in (["prompt"], ["niah", "--out", "x"], ["ruler", "--out", "x"]):
        with pytest.raises(SystemExit, match=r"^error: --hf DIR and --checkpoint DIR both name the model: give one$"):
            ev.parse_args([*cmd, "--hf", "a", "--checkpoint", "b"])
    assert ev.parse_args(["niah", "--out", "x"]).checkpoint == ev.DEFAULT_CHECKPOINT
    assert ev.parse_args(["niah", "--out", "x", "--hf", "d"]).checkpoint == Path("d")


# ---- RULER ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("task", [t for t in tk.RULER_TASKS if t != "qa_hotpot"])
def test_ruler_task_length_determinism_and_answers(task):
    tok = WordTokenizer()
    s = tk.ruler_sample(tok, task, 2000, 0, seed=0)
    assert abs(n_tok(tok, s) - 2000) <= 20, n_tok(tok, s)
    again = tk.ruler_sample(tok, task, 2000, 0, seed=0)
    assert (s.prompt, s.answers) == (again.prompt, again.answers)
    other = tk.ruler_sample(tok, task, 2000, 1, seed=0)
    assert other.prompt != s.prompt
    assert s.answers and all(a for a in s.answers)
    kind = tk.RULER_TASKS[task][0]
    if kind == "niah":  # every expected value is in the context exactly once
        for a in s.answers:
            assert s.prompt.count(a) == 1, a
    elif kind == "vt":  # the chain: 5 names, each assigned once after the one-shot example
        body = s.prompt.split("\n\n", 2)[-1]
        for a in s.answers:
            assert len(re.findall(rf"VAR {a} = ", body)) == 1
    elif kind == "qa":
        assert any(a in s.prompt for a in s.answers)
    elif kind == "cwe":  # the 10 answers are the most frequent words of the list
        body = s.prompt.split("\n\n")[-1]
        counts = {w: len(re.findall(rf"\d+\. {w}\b", body)) for w in set(re.findall(r"\d+\. (\w+)", body))}
        top = sorted(counts, key=counts.get, reverse=True)[:10]
        assert set(top) == set(s.answers)
    elif kind == "fwe":
        words = s.prompt.split("frequently appeared coded words. ")[1].split("\n")[0].split()
        ranked = sorted(set(words) - {"..."}, key=words.count, reverse=True)
        assert ranked[:3] == s.answers


def test_ruler_niah_depths_spread():
    """multi-needle essays: the 4 keys' needles land at different places, all in the context."""
    tok = WordTokenizer()
    s = tk.ruler_sample(tok, "niah_multikey_1", 2000, 0)
    assert s.prompt.count("One of the special magic numbers for") == 4


def test_ruler_real_tokenizer_length(real_tok):
    for task in ("niah_single_2", "niah_multikey_1", "vt", "qa_squad", "fwe"):
        s = tk.ruler_sample(real_tok, task, 4000, 0)
        assert abs(n_tok(real_tok, s) - 4000) <= 40, (task, n_tok(real_tok, s))


# ---- scoring ---------------------------------------------------------------------------------------------
def test_every_needle_is_placed_once_and_scored_by_its_own_phrases():
    """NEEDLES: each sentence once at its depth, the chat question or the completion cue its own, the
    answers its key phrases (needle 0 is Kamradt's, as before)."""
    assert tk.NEEDLES[0].sentence == tk.NEEDLE and tk.NEEDLES[0].phrases == tk.KEY_PHRASES
    tok = WordTokenizer()
    for i, n in enumerate(tk.NEEDLES):
        for form, ask in (("chat", f"{n.question} {tk.RETRIEVAL_CUE}"), ("completion", n.cue)):
            s = tk.niah(tok, 1500, 0.3, form, needle=i)
            assert s.prompt.count(n.sentence) == 1 and s.prompt.endswith("\n\n" + ask) and s.answers == list(n.phrases)
            assert s.meta["needle"] == i and tk.niah_score(n.sentence, s.answers) == 1.0
        assert all(tk.niah_score(m.sentence, n.phrases) == 0.0 for m in tk.NEEDLES if m is not n)
    with pytest.raises(ValueError, match="needle 5: there are 5"):
        tk.niah(tok, 1500, 0.3, needle=5)


def test_niah_score():
    assert tk.niah_score("The best thing is to eat a sandwich and sit in Dolores Park on a sunny day.") == 1.0
    assert tk.niah_score("eat a SANDWICH in dolores-park!") == pytest.approx(2 / 3)
    assert tk.niah_score("Go to the Golden Gate Bridge.") == 0.0
    assert tk.niah_score("") == 0.0


def test_ruler_scores():
    refs = ["1234567", "7654321"]
    assert tk.recall_all("They are 1234567 and 7654321.", refs) == 1.0
    assert tk.recall_all("It is 1234567", refs) == 0.5
    assert tk.recall_all("nothing", refs) == 0.0
    assert tk.recall_all("The Keys: BRAVE-OTTER, calm otter", ["brave-otter", "calm-otter"]) == 1.0
    assert tk.ruler_score("qa_squad", "Answer: france.", ["France", "the French"]) == 1.0
    assert tk.ruler_score("qa_squad", "Germany", ["France", "the French"]) == 0.0
    assert tk.ruler_score("vt", "VAR ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)


# ---- results file ---------------------------------------------------------------------------------------
def test_results_resume(tmp_path):
    r = ev.Results(tmp_path)
    done = dict(cmd="niah", method="full", length=1000, depth=0.5)
    r.add(ev.Results.key(done), dict(done, score=1.0))
    with open(r.path, "a") as f:
        f.write('{"cut off by an interrup')  # a partial line from a killed run
    r2 = ev.Results(tmp_path)
    assert len(r2.records) == 1
    todo = dict(done, depth=1.0)
    ran = []
    ev.run_cells([(done, "a"), (todo, "b")], r2, lambda f, p: ran.append(p) or {"score": 0.0}, "test")
    assert ran == ["b"]
    assert ev.Results.key(todo) in ev.Results(tmp_path).done
    # the key is order-independent
    assert ev.Results.key(dict(b=1, a=2)) == ev.Results.key(dict(a=2, b=1))


def test_ruler_first_sample_runs_that_range_only(tmp_path, monkeypatch):
    """ruler --first-sample F --samples N runs samples F..N-1 of each task and method, keyed as a run of all N
    would key them (so a later full run skips them); F outside [0, N) is an error."""
    from types import SimpleNamespace
    asked = []
    monkeypatch.setattr(ev, "ruler_sample", lambda tok, t, L, i, seed, form: SimpleNamespace(answers=[f"a{i}"], form=form))
    monkeypatch.setattr(ev, "answer", lambda runner, m, ss, n: [asked.append((m.name, s.answers[0])) or
                                                                dict(output=s.answers[0]) for s in ss])
    a = ev.parse_args(["ruler", "--out", str(tmp_path), "--methods", "full,kivi-1bit", "--tasks", "qa_squad",
                       "--lengths", "100", "--first-sample", "2", "--samples", "4"])
    results = ev.Results(tmp_path)
    ev.cmd_ruler(a, SimpleNamespace(tok=None), a.method_list, results)
    assert sorted(asked) == [("full", "a2"), ("full", "a3"), ("kivi-1bit", "a2"), ("kivi-1bit", "a3")]
    assert sorted(r["sample"] for r in ev.Results(tmp_path).records) == [2, 2, 3, 3]
    asked.clear()
    a.first_sample = 0
    ev.cmd_ruler(a, SimpleNamespace(tok=None), a.method_list, results)
    assert sorted(asked) == [("full", "a0"), ("full", "a1"), ("kivi-1bit", "a0"), ("kivi-1bit", "a1")]
    for first in ("4", "-1"):
        with pytest.raises(SystemExit, match=r"--first-sample must be in \[0, --samples\)"):
            ev.parse_args(["ruler", "--out", "x", "--first-sample", first, "--samples", "4"])


def test_reports_and_heatmap(tmp_path):
    r = ev.Results(tmp_path)
    for lb in ("full", "kivi-1bit"):
        for L in (1000, 2000):
            for d in (0.0, 1.0):
                f = dict(cmd="niah", method=lb, length=L, depth=d)
                r.add(ev.Results.key(f), dict(f, label=lb, score=1.0 if lb == "full" else 1 / 3))
    ev.write_niah_report(r)
    md = (tmp_path / "results.md").read_text()
    assert "| full | - | 100.0 | 100.0 | 100.0 |" in md and "kivi-1bit | - | 33.3" in md
    # per length, Wilson's 95% interval over the prompts: 2 of 2 found is 1.0 [0.34, 1.0]
    assert "| full | 100.0 [34, 100] (2) | 100.0 [34, 100] (2) |" in md
    assert "| kivi-1bit | 33.3 [5, 84] (2) | 33.3 [5, 84] (2) |" in md
    assert (tmp_path / "niah.png").stat().st_size > 1000
    for task, score in (("niah_single_1", 1.0), ("vt", 0.5)):
        f = dict(cmd="ruler", method="full", task=task, length=1000, sample=0)
        r.add(ev.Results.key(f), dict(f, label="full", score=score))
    ev.write_ruler_report(r)
    assert "| full | 1000 | 1 | 100.0 | 50.0 | 75.0 |" in (tmp_path / "results.md").read_text()
    f = dict(cmd="hitrate", method="specache-1bit", prompt="essay", length=1000, sample=0)
    series = dict(hit=[None] + [1.0] * 9 + [0.5] * 10, hit_mass=[None] + [0.75] * 19, hit_own=[None] + [0.5] * 19,
                  mass=[None] + [0.25] * 19, mass_topk=[None] + [0.5] * 19, mass_best=[None] + [0.6] * 19,
                  err=[None] + [0.2] * 19, err_topk=[None] + [0.1] * 19,
                  err_own=[None] + [0.05] * 19, err_none=[None] + [0.4] * 19, exact=[True, False] * 10,
                  layer_err=[0.1, 0.3], layer_hit=[0.5, 1.0])
    r.add(ev.Results.key(f), dict(f, label="specache-1bit", **series))
    ev.write_hitrate_report(r)
    md = (tmp_path / "results.md").read_text()
    # totals: steps, then hit vs exact top-k (None skipped: (9 + 5) / 19), vs most-mass, vs own, masses, ..., exact
    assert (f"| specache-1bit | essay | 20 | {100 * 14 / 19:.1f} | 75.0 | 50.0 | 25.0 | 50.0 | 60.0 | 20.0 | 10.0 | 5.0 "
            "| 40.0 | 50.0 |") in md
    # by decode-step interval, one row per measure; intervals past the last step are left out
    assert "| method | measure | [1, 10] | [11, 50] |" in md and "[51, 100]" not in md
    assert "| specache-1bit | top-k hit % (vs exact top-k) | 100.0 | 50.0 |" in md
    assert "| specache-1bit | exact token hit % | 50.0 | 50.0 |" in md
    assert (tmp_path / "layers.png").stat().st_size > 1000
    f = dict(f, sample=1)
    r.add(ev.Results.key(f), dict(f, label="specache-1bit", **{k: [1.0] * 250 for k in series if not k.startswith("layer")},
                                  layer_err=[0.0, 0.0], layer_hit=[1.0, 1.0]))
    ev.write_hitrate_report(r)
    assert "| [101, 200] | [201, ] |" in (tmp_path / "results.md").read_text()
    assert eval_report.step_mean(r.of("hitrate"), "hit", 201) == 1.0 and eval_report.step_mean(r.of("hitrate")[:1], "exact", 11, 20) == 0.5


def test_ppl_report_and_summary_prompt(tmp_path):
    r = ev.Results(tmp_path)
    for lb, nll in (("full", 1.0), ("kivi-1bit", 2.0)):
        f = dict(cmd="ppl", method=lb, length=2048, window=0, n_eval=128)
        r.add(ev.Results.key(f), dict(f, label=lb, nll=nll, n=128, bits=16.0 if lb == "full" else 1.5))
    ev.write_ppl_report(r)
    md = (tmp_path / "results.md").read_text()
    assert "last 128 tokens" in md and "| full | 16.00 | 2.718 | 1.0000 | 1 |" in md and "| kivi-1bit | 1.50 | 7.389 |" in md
    tok = WordTokenizer()
    p = tk.summary_prompt(tok, 1000, 0)
    assert p.startswith("<user> ") and p.endswith(f"{tk.SUMMARY_ASK} <assistant>")
    assert len(tok.encode(p)) <= 1000 and p != tk.summary_prompt(tok, 1000, 1)


# ---- the runner's hit trace, on a tiny random Llama -------------------------------------------------------
class IdTokenizer:
    eos_ids, bos_id, add_bos = set(), None, False

    def decode(self, ids):
        return " ".join(map(str, ids))


def tiny_runner():
    import torch
    import generate
    from tests.helpers import tiny_model

    r = ev.Runner.__new__(ev.Runner)  # Runner without a checkpoint
    r.torch, r.gen, r.device, r.model, r.tok = torch, generate, torch.device("cpu"), tiny_model(), IdTokenizer()
    r.chunk, r.fixed_len, r.steps = 2048, None, generate.Steps()
    return r


class HashTokenizer(WordTokenizer):
    """Words as ids below the tiny model's vocabulary; decodes ids as numbers."""
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_a_cache_the_prompt_cannot_hold_is_one_error_line():
    """An InfLLM budget below its smallest layout on this sequence: one error line naming the cache and the
    length, not a traceback that loses which cell it was."""
    from config import CacheConfig
    r = tiny_runner()
    with pytest.raises(SystemExit, match=r"^error: cache infllm.*@specache-1bit: specache-1bit's \d+ bytes do not "
                                         r"hold InfLLM's smallest layout .* \(a sequence of 300 positions\)$"):
        r.setup(CacheConfig.from_name("infllm@specache-1bit"), 300)


def test_niah_rows_record_the_prompt_form(tmp_path):
    """tools/eval.py niah on a tiny model: every row records its prompt form, the report names it,
    and chat and completion cells of one results file are told apart."""
    import zlib
    from types import SimpleNamespace

    r = tiny_runner()
    r.tok = HashTokenizer()
    r.encode_prompt = lambda text: [zlib.crc32(w.encode()) % 256 for w in text.split()]
    results = ev.Results(tmp_path)
    a = SimpleNamespace(checkpoint=tmp_path / "tiny", lengths=[300], depths=[0.5], max_new_tokens=3,
                        prompt_form="completion", needles=[0])
    ev.cmd_niah(a, r, ev.expand_methods("full"), results)
    (row,) = results.of("niah")
    assert row["prompt_form"] == "completion" and row["prompt_tokens"] <= 300 and '"prompt_form"' in row["key"]
    md = (tmp_path / "results.md").read_text()
    assert "Prompt form: completion (text that a base model continues to the answer)." in md
    assert "| full |" in md
    a.prompt_form = "chat"
    ev.cmd_niah(a, r, ev.expand_methods("full"), results)
    rows = results.of("niah")
    assert [x["prompt_form"] for x in rows] == ["completion", "chat"] and '"prompt_form"' not in rows[1]["key"]
    md = (tmp_path / "results.md").read_text()
    assert "| full (chat) |" in md and "| full (completion) |" in md and "Prompt form: chat (" in md


def test_hit_trace_per_step_agrees_with_the_probe():
    import random
    from config import CacheConfig

    r = tiny_runner()
    ids = [random.Random(1).randrange(256) for _ in range(100)]
    m = CacheConfig.from_name("specache-1bit-k8-g16-r16")
    text, stats = r.generate(m, ids, 41)
    trace = r.hit_trace(m, ids, 40)
    assert all(len(v) == 40 for k, v in trace.items() if not k.startswith("layer_"))
    assert r.generate(m, ids, 41)[0] == text  # the probe does not change the tokens
    assert ev.mean(trace["exact"]) == pytest.approx(stats["spec_exact_hit_rate"])
    probe = r.last_probe
    for key in ("hit", "hit_own", "mass", "mass_topk", "err", "err_topk", "err_own", "err_none"):
        assert all(v is None or 0 <= v <= 1 + 1e-6 or key.startswith("err") for v in trace[key])
        assert [v for v in trace[key] if v is not None] == pytest.approx(probe.per_step(key))
        assert trace[f"layer_{key}"] == pytest.approx(probe.per_layer(key)) and len(trace[f"layer_{key}"]) == 2


def test_prefill_replay_equals_prefilling_each_cache():
    """tools/eval.py prefills a prompt once (one chunk, exact) and replays its K/V into each cache: the
    tokens equal those of each cache's own one-chunk prefill."""
    import random
    from config import CacheConfig

    r = tiny_runner()
    ids = [random.Random(2).randrange(256) for _ in range(100)]
    for name in ("full", "kivi-2bit-g16-r32", "specache-1bit-k8-g16-r16", "specache-1bit-k8-g16-r16-lag",
                 "infllm-p8-k32-r16-sink4-repr2"):
        m = CacheConfig.from_name(name)
        r.replay = None
        own, _ = r.generate(m, ids, 20)
        r.replay = PrefillReplay(2048, [m])  # (the queries recorded where the method reads them: InfLLM)
        assert r.generate(m, ids, 20)[0] == own, name
        assert r.generate(m, ids, 20)[0] == own, name  # the second prompt use replays the recording
    both = [CacheConfig.from_name(n) for n in ("infllm-p8-k32-r16-sink4-repr2", "infllm-p8-k16-r24-sink2-repr4")]
    r.replay = None
    own = [r.generate(m, ids, 20)[0] for m in both]
    r.replay = PrefillReplay(2048, both)  # one recording: InfLLM's softmax normalisers shared by both
    assert [r.generate(m, ids, 20)[0] for m in both] == own
    assert [PrefillReplay(2048, [CacheConfig.from_name(n)]).keep_queries for n in ("kivi-1bit", "specache-1bit",
            "infllm-p8-k32-r16-sink4-repr2", "kivi-2bit-zipcache-s40-hi4")] == [False, False, True, True]


def test_a_batch_of_prompts_decodes_each_prompts_answer():
    """Runner.generate_rows decodes prompts of 100, 68 and 36 tokens together (left-padded by 0, 32 and 64, multiples
    of the caches' residual windows): each row's answer is its prompt's alone, prefilled per cache and replayed
    from one recording of the padded batch."""
    import random
    from config import CacheConfig

    r = tiny_runner()
    rows = [[random.Random(seed).randrange(256) for _ in range(n)] for seed, n in ((3, 100), (4, 68), (5, 36))]
    for name in ("full", "kivi-2bit-g16-r32", "specache-1bit-k8-g16-r16", "specache-1bit-k8-g16-r16-resync-sink4"):
        m = CacheConfig.from_name(name)
        r.replay = None
        alone = [r.generate(m, ids, 12)[0] for ids in rows]
        assert r.generate_rows(m, rows, 12)[0] == alone, name
        r.replay = PrefillReplay(2048, [m])
        assert r.generate_rows(m, rows, 12)[0] == alone, name
        assert r.generate_rows(m, rows, 12)[0] == alone, name  # (the recording replayed)


def test_niah_batch_groups_prompts_by_method(tmp_path):
    """cmd_niah --batch 2 on a tiny model: the cells of two prompts at a time and one method make a batch; the
    fp cache's answers are the batch-1 run's."""
    import zlib
    from types import SimpleNamespace

    r = tiny_runner()
    r.tok = HashTokenizer()
    r.encode_prompt = lambda text: [zlib.crc32(w.encode()) % 256 for w in text.split()]
    a = SimpleNamespace(checkpoint=Path("tiny"), lengths=[200, 300], depths=[0.5], max_new_tokens=3,
                        prompt_form="chat", needles=[0], batch=1)
    rows = {}
    for batch in (1, 2):
        a.batch = batch
        results = ev.Results(tmp_path / f"batch{batch}")
        ev.cmd_niah(a, r, ev.expand_methods("full,kivi-1bit-g16-r16"), results)
        rows[batch] = {(x["method"], x["length"]): x for x in results.of("niah")}
    assert rows[1].keys() == rows[2].keys() and len(rows[1]) == 4
    assert all(rows[2][k].get("batch") == 2 for k in rows[2])
    assert [rows[1][k]["output"] for k in rows[1] if k[0] == "full"] == [rows[2][k]["output"] for k in rows[1] if k[0] == "full"]
    cells = [(dict(method=m, length=L), None) for L in (1, 2, 3) for m in "ab"]
    assert [len(g) for g in eval_report.batches(cells, 2)] == [2, 2, 1, 1]


# ---- method names ---------------------------------------------------------------------------------------
def test_method_parsing():
    from config import CacheConfig as C
    assert ev.expand_methods("full") == [C("full")]
    assert ev.expand_methods("kivi-2bit") == [C("kivi", bits=2)]
    assert ev.expand_methods("kivi-1bit-orig") == [C("kivi", bits=1, one_bit="kivi")]
    assert ev.expand_methods("specache-1bit-orig") == [C("specache", bits=1, one_bit="kivi")]
    assert ev.expand_methods("specache-sequential") == [C("specache", bits=1, fetch="sequential")]
    assert ev.expand_methods("specache-2bit-oracle") == [C("specache", bits=2, fetch="oracle")]
    assert ev.expand_methods("kivi-2bit-lsq") == [C("kivi", bits=2, fit="lsq")]
    assert C.from_name("specache-lsq-1bit-resync").name == "specache-1bit-lsq-resync"
    assert C.from_name("specache-1bit-rr2-resync") == C("specache", bits=1, fetch="resync", rerank=2)
    assert C.from_name("specache-1bit-best").name == "specache-1bit-lsq-resync-rr2-g32-sink4"
    # name parts after the preset override it: the preset before 2026-11-23 (k 96, residual 32, no
    # re-ranking), and that one with re-ranking (docs/policies.md's tables)
    assert C.from_name("specache-2bit-best-rr1-k96-r32").name == "specache-2bit-lsq-resync-k96-g32-r32-sink4"
    assert C.from_name("specache-1bit-best-k96-r32").name == "specache-1bit-lsq-resync-rr2-k96-g32-r32-sink4"
    for bad, msg in (("kivi-3bit", "not available"), ("h2o", "unknown cache"),
                     ("kivi-2bit-orig", "only for 1 bit"), ("kivi-sequential", "SpeCache fetch policy"),
                     ("kivi-1bit-rr2", "SpeCache options"), ("specache-rr0", "must be >= 1"),
                     ("specache-oracle-rr2", "oracle already selects"),
                     ("quantspec-lsq", "not for QuantSpec"), ("kivi-2bit-zipcache-s40-lsq", "mixed precision")):
        with pytest.raises(ValueError, match=msg) as e:
            ev.expand_methods(bad)
        assert bad.split("-")[0] in str(e.value)
    with pytest.raises(SystemExit, match="unknown cache 'h2o'"):
        ev.parse_args(["niah", "--out", "x", "--methods", "full,h2o"])
    for args in (["--samples", "0"], ["--lengths", "0"], ["--k", "0"], ["--methods", ","]):
        with pytest.raises(SystemExit):
            ev.parse_args(["ruler", "--out", "x", *args])


def test_method_sweeps():
    ms = ev.expand_methods("full,kivi-1bit,specache-1bit", ks=[16, 64], groups=[None])
    assert [(m.name, m.k, m.residual_len) for m in ms] == [("full", 64, 64), ("kivi-1bit", 64, 128),
                                                           ("specache-1bit-k16", 16, 64), ("specache-1bit", 64, 64)]
    assert ev.expand_methods("specache-1bit", groups=[128])[0].residual_len == 128  # residual a multiple of group
    a = ev.parse_args(["ppl", "--out", "x", "--quick", "--k", "16,32"])
    assert a.lengths == [1024, 2048] and a.n_eval == 64 and {m.k for m in a.method_list} == {64, 16, 32}


def test_presets():
    """A preset sets SpeCache defaults; the name's own parts and explicit fields win; the canonical
    name spells the preset out; presets are SpeCache-only and one at a time."""
    from config import PRESETS, CacheConfig as C
    assert C.from_name("specache-1bit-paper") == C.from_name("specache-1bit") == C("specache", bits=1)
    best = C.from_name("specache-2bit-best")
    assert all(getattr(best, f) == v for f, v in PRESETS["best"].items() if v is not None) and best.bits == 2
    assert best == C.from_name("specache-2bit", preset="best") and C.from_name(best.name) == best
    assert C.from_name("specache-1bit-best-k128").k == 128 and C.from_name("specache-1bit-best", k=96).k == 96
    assert C.from_name("specache-1bit-resync", preset="paper").fetch == "resync"  # the name wins
    assert ev.expand_methods("specache-1bit-best", ks=[16])[0] == C.from_name("specache-1bit-best-k16")
    for name, kw, msg in (("kivi-1bit-best", {}, "SpeCache configurations"), ("specache-best-paper", {}, "one preset"),
                          ("specache", {"preset": "good"}, "unknown preset")):
        with pytest.raises(ValueError, match=msg):
            C.from_name(name, **kw)


def test_quantspec_subcommand_reports_acceptance_and_equality(tmp_path, monkeypatch):
    """tools/eval.py quantspec on a tiny model: every gamma's greedy output equals gamma 0's (the report
    says n/n) and the acceptance rate is the accepted share of the drafted tokens."""
    import random
    from types import SimpleNamespace

    r = tiny_runner()
    r.replay = PrefillReplay()
    r.encode_prompt = lambda text: [int(t) for t in text.split()]
    monkeypatch.setattr(ev, "summary_prompt", lambda tok, L, i: " ".join(
        str(random.Random(L + i).randrange(256)) for _ in range(L)))
    a = SimpleNamespace(checkpoint=tmp_path / "tiny", draft_group=32, lengths=[150], samples=2, gammas=[0, 1, 3],
                        max_new_tokens=40, compile=False)
    results = ev.Results(tmp_path)
    ev.cmd_quantspec(a, r, ev.expand_methods("quantspec-g16"), results)
    recs = results.of("quantspec")
    assert len(recs) == 6 and all(x["drafted"] == x["gamma"] * x["rounds"] for x in recs)
    md = (tmp_path / "results.md").read_text()
    for g in (1, 3):
        rs = [x for x in recs if x["gamma"] == g]
        acc = 100 * sum(x["accepted"] for x in rs) / sum(x["drafted"] for x in rs)
        assert f"| quantspec-g16 | 150 | {g} | 2 | {acc:.1f} |" in md
    assert md.count(" 2/2 |") == 3  # gamma 0, 1 and 3 all give gamma 0's tokens
    with pytest.raises(SystemExit, match="quantspec cache"):
        ev.cmd_quantspec(a, r, ev.expand_methods("kivi-2bit"), results)


def test_saliency_subcommand(tmp_path, monkeypatch):
    """tools/eval.py saliency on a tiny model: with every token a probe, the probe sets are the exact ones
    (100% overlap); with the default 10% probes they are a subset-based estimate in [0, 100]."""
    import random
    from types import SimpleNamespace
    from siblings import zipcache

    r = tiny_runner()
    monkeypatch.setattr(ev, "essay_window", lambda tok, start, L: [random.Random(start).randrange(256) for _ in range(L)])
    a = SimpleNamespace(checkpoint=tmp_path / "tiny", lengths=[128], samples=1, salient_ratio=0.5, group_list=[16])
    results = ev.Results(tmp_path / "default")
    ev.cmd_saliency(a, r, [], results)
    rec = results.of("saliency")[0]
    assert rec["probes"] == 12 and len(rec["layer_group"]) == 2 and 0 <= rec["group"] <= 1
    monkeypatch.setattr(zipcache, "PROBE_RECENT", 1.0)
    results = ev.Results(tmp_path / "all")
    ev.cmd_saliency(a, r, [], results)
    rec = results.of("saliency")[0]
    assert rec["probes"] == 128 and rec["group"] == rec["global"] == 1.0
    assert "| ratio 0.5, group 16 | 128 | 1 | 128 | 100.0 | 100.0 |" in (tmp_path / "all" / "results.md").read_text()
