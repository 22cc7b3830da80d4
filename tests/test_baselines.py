"""tools/baselines.py: the byte arithmetic of equal device bytes, the runner's loop against kvpress's own
pipeline and against generate.py's full cache, the shared prefill against one run per cell, Gemma 3's
sliding layers left unpressed, and the error lines. The runs need the kvpress venv (`make venv-kvpress`) and the default model as a
transformers directory; `make test-full` builds both first."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tools import baselines as B

KVPY = ROOT / ".venv-kvpress" / "bin" / "python"
HF = ROOT / "checkpoints" / "smollm2-135m-hf"
SCRIPT = ROOT / "tools" / "baselines.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


# ---- the byte arithmetic (no model) ------------------------------------------------------------------------
def test_gemma_32k_example():
    """docs/baselines.md: Gemma 3 270M at 32,698 prompt tokens (15 of them the completion cue, not
    compressed) + 16 new tokens, fp32, 1-bit SpeCache's 26,015,472 bytes (24.81 MiB): the 15 sliding
    layers hold 511 entries each, the 3 global layers about 1,700, of which 1,649 are context."""
    windows = ([512] * 5 + [None]) * 3
    entry = B.entry_bytes(1, 256, 4)
    n = B.kept_for_bytes(26_015_472, windows, 32_698, 32_698 - 15, 16, entry)
    assert entry == 2048 and n == 1649
    got = B.device_bytes([n] * 18, windows, 32_698, 32_698 - 15, 16, entry)
    assert 0 <= 26_015_472 - got < 3 * entry
    assert abs(B.ratio_for(n, 32_698 - 15) - 0.95) < 0.001


@pytest.mark.parametrize("windows,prompt,question,new", [
    ([None] * 30, 4000, 30, 32), ([None] * 30, 1000, 0, 1), (([512] * 5 + [None]) * 3, 16000, 20, 64),
    ([16, None, 16, None], 100, 10, 8), ([None, 4096], 8000, 5, 16)])
def test_kept_for_bytes_is_within_one_entry_per_pressed_layer(windows, prompt, question, new):
    entry = B.entry_bytes(3, 64, 4)
    full = B.device_bytes([prompt - question] * len(windows), windows, prompt, prompt - question, new, entry)
    least = B.device_bytes([1] * len(windows), windows, prompt, prompt - question, new, entry)
    for target in [least + int((full - least) * f) for f in (0, 0.1, 0.37, 0.999)]:
        n = B.kept_for_bytes(target, windows, prompt, prompt - question, new, entry)
        got = B.device_bytes([n] * len(windows), windows, prompt, prompt - question, new, entry)
        assert 0 <= target - got < entry * sum(w is None for w in windows)
        ctx = prompt - question
        assert int(ctx * (1 - B.ratio_for(n, ctx))) == min(n, ctx)  # what kvpress keeps at that ratio


class RampPress:
    """A stand-in with PyramidKV's interface: each layer's budget falls with its index."""
    compression_ratio = 0.0

    def get_layer_budget(self, module, q_len):
        return max(1, round(q_len * (1 - self.compression_ratio) * (1.5 - module.layer_idx / 30)))


def test_pyramid_budgets_sum_to_the_target():
    press, layers = RampPress(), list(range(2, 30, 3))
    for target in (500, 4321, 20000):
        ratio = B.pyramid_ratio_for(press, target, layers, 4000, None)
        press.compression_ratio = ratio
        total = sum(press.get_layer_budget(type("M", (), dict(layer_idx=i)), 4000) for i in layers)
        assert target - len(layers) <= total <= target


def test_a_budget_that_keeps_no_context_entry_is_refused():
    with pytest.raises(B.CellError, match=r"^--match-bytes 100000 keeps no context entry"):
        B.kept_for_bytes(100_000, [None] * 30, 4000, 3970, 32, B.entry_bytes(3, 64, 4))


def test_grid_budgets_and_cells():
    """The grid's cells: each press at each matched and fixed budget (Table 2's 1/4 keeps a quarter:
    kvpress ratio 0.75), NAME+qa question-aware, unpressed methods once, finished cells skipped."""
    from types import SimpleNamespace
    from tools import baselines_grid as G
    assert G.parse_fixed("1/4,1/8") == {"1/4": 0.75, "1/8": 0.875}
    for bad in ("1/0", "5/4", "x"):
        with pytest.raises(SystemExit, match="error: --fixed"):
            G.parse_fixed(bad)
    a = SimpleNamespace(presses="no_press,snapkv+qa,quantized-2bit", fixed="1/8")
    done = {"snapkv+qa@specache-1bit"}
    cells = G.cells_for(a, {"specache-1bit": 100, "specache-1bit-best": 200}, done, lambda m: m)
    assert cells == [("no_press", dict(press="no_press", question_aware=False, tag="no_press")),
                     ("snapkv+qa@specache-1bit-best", dict(press="snapkv", question_aware=True, tag="snapkv+qa@specache-1bit-best",
                                                           match_bytes=200, matched="specache-1bit-best")),
                     ("snapkv+qa@1/8", dict(press="snapkv", question_aware=True, tag="snapkv+qa@1/8", ratio=0.875, fixed="1/8")),
                     ("quantized-2bit", dict(press="quantized-2bit", question_aware=False, tag="quantized-2bit"))]
    with pytest.raises(SystemExit, match="error: unknown press 'snapkvv'"):
        G.cells_for(SimpleNamespace(presses="snapkvv", fixed=""), {}, set(), lambda m: m)


def test_grid_report_and_figure(tmp_path):
    """The report's tables, one per benchmark and length: mean score x100 per method and needle depth,
    and mean device MiB; the figure is written."""
    from tools import baselines_grid as G
    rows = [dict(cmd="niah", model="m", method=m, length=L, depth=d, score=sc, kv_device_bytes=b)
            for m, L, d, sc, b in [("no_press", 8000, 0.0, 1.0, 2 ** 22), ("no_press", 8000, 0.5, 1.0, 2 ** 23),
                                   ("snapkv@specache-1bit", 8000, 0.0, 0.5, 2 ** 20),
                                   ("snapkv@specache-1bit", 8000, 0.5, 0.0, 2 ** 20),
                                   ("snapkv@specache-1bit", 16000, 0.5, 1.0, 2 ** 21)]]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    G.main(["report", "--out", str(tmp_path), "--figure"])
    table = (tmp_path / "results.md").read_text()
    assert "## niah 8k (m)" in table and "## niah 16k (m)" in table and "| method | n | 0 | 0.5 | mean |" in table
    assert "| no_press | 1 | 100.0 | 100.0 | 100.0 | 6.00 |" in table
    assert "| snapkv@specache-1bit | 1 | 50.0 | 0.0 | 25.0 | 1.00 |" in table
    assert "| snapkv@specache-1bit | 1 | 100.0 | 100.0 | 2.00 |" in table
    assert (tmp_path / "score-vs-bytes.png").stat().st_size > 10_000


def run(*args, py=KVPY, env=None):
    """(exit code, the JSON row or None, stderr) of `py tools/baselines.py ARGS`."""
    p = subprocess.run([str(py), str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env or ENV,
                       cwd=ROOT, timeout=600)
    lines = p.stdout.strip().splitlines()
    return p.returncode, json.loads(lines[-1]) if p.returncode == 0 and lines else None, p.stderr


def assert_error(rc, stderr, out_file, *phrases):
    lines = stderr.strip().splitlines()
    assert rc == 1 and lines and lines[-1].startswith("error: "), stderr[-2000:]
    assert sum(line.startswith("error:") for line in lines) == 1
    assert all(p in lines[-1] for p in phrases), lines[-1]
    assert not out_file.exists()


def test_missing_kvpress_venv_names_the_make_target(tmp_path):
    env = dict(ENV, KVPRESS_PYTHON=str(tmp_path / "none" / "python"))
    out = tmp_path / "rows.jsonl"
    rc, _, err = run("run", "--hf", HF, "--prompt-file", SCRIPT, "--press", "snapkv", "--ratio", "0.5",
                     "--out", out, py=sys.executable, env=env)
    assert_error(rc, err, out, "make venv-kvpress")


def test_unknown_press(tmp_path):
    out = tmp_path / "rows.jsonl"
    rc, _, err = run("run", "--hf", HF, "--prompt-file", SCRIPT, "--press", "snapkvv", "--ratio", "0.5", "--out", out,
                     py=sys.executable)
    assert_error(rc, err, out, "unknown press 'snapkvv'", "streaming_llm")


# ---- runs in the kvpress venv ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def needle(tmp_path_factory):
    """A 400-token needle prompt (the chat form's user turn), as `tools/eval.py prompt` writes it."""
    if not KVPY.exists():
        pytest.fail(f"no kvpress venv at {KVPY}: run `make venv-kvpress` (make test-full does)")
    if not (HF / "config.json").exists():
        pytest.fail(f"no transformers directory at {HF}: run `make {HF.relative_to(ROOT)}/config.json`")
    from tests.helpers import require_default_checkpoint
    from tokenizer import load_tokenizer
    from tools.tasks import niah
    path = tmp_path_factory.mktemp("prompt") / "needle.txt"
    path.write_text(niah(load_tokenizer(require_default_checkpoint()), 400, 0.5).prompt + "\n")
    return path


PIPELINE = """
import json, sys, torch, transformers, kvpress
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
hf, prompt, out, new = sys.argv[1], open(sys.argv[2]).read(), sys.argv[3], int(sys.argv[4])
cut = prompt.rstrip().rfind("\\n") + 1  # the question: the last line
context, question = prompt[:cut], prompt[cut:]
tok = transformers.AutoTokenizer.from_pretrained(hf)
rows = {}
for name, cls, ratio in [("snapkv", "SnapKVPress", 0.6), ("streaming_llm", "StreamingLLMPress", 0.7)]:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tok)
    ids = pipe.preprocess(context, questions=[question], answer_prefix="", max_context_length=10 ** 9)
    c, q = ids["context_ids"][0].tolist(), ids["questions_ids"][0][0].tolist()
    answer = pipe(context, question=question, press=getattr(kvpress, cls)(compression_ratio=ratio),
                  max_new_tokens=new)["answer"]
    rows[name] = dict(ids=c + q, question_at=len(c), ratio=ratio, answer=answer)
json.dump(rows, open(out, "w"))
"""


@pytest.mark.full
def test_the_loop_equals_kvpress_pipeline(needle, tmp_path):
    """Same ids (the pipeline's context and question ids), same press and ratio: the runner's loop
    (question and new tokens one at a time at their positions) gives the pipeline's greedy text."""
    ref = tmp_path / "pipeline.json"
    p = subprocess.run([str(KVPY), "-c", PIPELINE, str(HF), str(needle), str(ref), "24"], capture_output=True,
                       text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for name, want in json.loads(ref.read_text()).items():
        ids = tmp_path / f"{name}.json"
        ids.write_text(json.dumps(dict(ids=want["ids"], question_at=want["question_at"])))
        rc, row, err = run("run", "--hf", HF, "--ids-file", ids, "--press", name, "--ratio", want["ratio"],
                           "--max-new-tokens", 24)
        assert rc == 0, err[-3000:]
        assert row["prompt_sha256"] == B.ids_sha256(want["ids"]) and row["compressed_tokens"] == want["question_at"]
        assert row["kept_per_layer"] == [int(want["question_at"] * (1 - want["ratio"]))] * 30
        assert row["text"].strip() == want["answer"].strip() and row["text"].strip()


@pytest.mark.full
def test_no_press_equals_generate_full(needle):
    """The same prompt file through generate.py --hf --cache full --chat (project venv, transformers
    5.23) and the runner's no_press (kvpress venv, transformers 5.2): the same token ids on both
    sides (the project tokenizer's ids hash to the runner's prompt_sha256) and the same greedy tokens."""
    import hf
    ids = hf.load_tokenizer(HF).encode_prompt(needle.read_text(), chat=True)
    p = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--hf", str(HF), "--cache", "full", "--chat",
                        "--prompt-file", str(needle), "--max-new-tokens", "24", "--json", "--quiet", "--threads", "1"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = json.loads(p.stdout.strip().splitlines()[-1])
    rc, row, err = run("run", "--hf", HF, "--prompt-file", needle, "--press", "no_press", "--max-new-tokens", 24,
                       "--expect-sha256", B.ids_sha256(ids))
    assert rc == 0, err[-3000:]
    assert row["prompt_tokens"] == ref["prompt_tokens"] == len(ids)
    assert row["tokens"] == ref["tokens"] and row["text"] == ref["text"]
    assert row["kept_per_layer"] == [row["compressed_tokens"]] * 30


@pytest.mark.full
def test_match_bytes_on_the_default_model(needle, tmp_path):
    """--match-bytes sets the kept entries so that kv_device_bytes is within one entry per pressed
    layer of the target (PyramidKV: per-layer budgets summed); the row is appended to --out."""
    out = tmp_path / "rows.jsonl"
    for press, extra in (("snapkv", []), ("pyramidkv", []), ("knorm", ["--question-aware"])):
        target = 2_000_000 if press != "pyramidkv" else 5_000_000
        rc, row, err = run("run", "--hf", HF, "--prompt-file", needle, "--press", press, "--match-bytes", target,
                           "--max-new-tokens", 8, "--out", out, *extra)
        assert rc == 0, err[-3000:]
        assert 0 <= row["bytes_gap"] < 30 * row["kv_entry_bytes"] and row["kv_device_bytes"] < row["kv_fp_full_bytes"]
        assert row["pressed_layers"] == list(range(30))
        assert (row["question_tokens"] == 0) if extra else (row["question_tokens"] > 0)
    assert len(out.read_text().splitlines()) == 3


def cells_equal_runs(hf, ids_file, cells, max_new, tmp_path):
    """`cells` (one shared prefill) against `run` (a prefill of its own, kvpress's hook) for each cell:
    the same tokens, kept entries and device bytes. Returns the cells' rows by tag."""
    spec = tmp_path / "cells.json"
    spec.write_text(json.dumps(cells))
    p = subprocess.run([str(KVPY), str(SCRIPT), "cells", "--hf", str(hf), "--ids-file", str(ids_file), "--cells", str(spec),
                        "--max-new-tokens", str(max_new)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["tag"]: r for r in map(json.loads, p.stdout.strip().splitlines())}
    assert sorted(rows) == sorted(c["tag"] for c in cells)
    for c in cells:
        budget = (["--ratio", c["ratio"]] if "ratio" in c else []) + (["--match-bytes", c["match_bytes"]]
                                                                      if "match_bytes" in c else [])
        rc, want, err = run("run", "--hf", hf, "--ids-file", ids_file, "--press", c["press"], "--max-new-tokens", max_new,
                            *budget, *(["--question-aware"] if c.get("question_aware") else []))
        assert rc == 0, err[-3000:]
        got = rows[c["tag"]]
        assert (got["tokens"], got["kept_per_layer"], got["kv_device_bytes"], got["ratio"]) == \
            (want["tokens"], want["kept_per_layer"], want["kv_device_bytes"], want["ratio"]), c
    return rows


@pytest.mark.full
def test_shared_prefill_equals_a_prefill_per_cell(needle, tmp_path):
    """One recorded prefill serves every press and budget: each cell's tokens equal those of a run with
    its own pressed prefill (sdpa and eager presses, question-aware or not, a QuantizedCache, no_press);
    the pressed cells differ from no_press, so the comparison can fail."""
    import hf
    tok = hf.load_tokenizer(HF)
    text = tok.chat(needle.read_text())
    body = needle.read_text().rstrip()
    ids, at = B.split_at(tok.tok, text, body[body.rfind("\n") + 1:])
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(dict(ids=ids, question_at=at)))
    cells = [dict(press="snapkv", ratio=0.8, tag="snapkv"), dict(press="snapkv", ratio=0.8, question_aware=True, tag="qa"),
             dict(press="h2o", ratio=0.8, tag="h2o"), dict(press="h2o", ratio=0.8, question_aware=True, tag="h2o+qa"),
             dict(press="streaming_llm", match_bytes=2_000_000, tag="stream"), dict(press="no_press", tag="none"),
             dict(press="quantized-2bit", tag="q2")]
    rows = cells_equal_runs(HF, ids_file, cells, 12, tmp_path)
    assert rows["stream"]["tokens"] != rows["none"]["tokens"] and rows["q2"]["tokens"] != rows["none"]["tokens"]


@pytest.mark.full
def test_cells_reports_each_failed_cell_and_runs_the_rest(needle, tmp_path):
    """A cell that cannot run prints its tagged error line; the others still give their rows; exit 1."""
    spec = tmp_path / "cells.json"
    spec.write_text(json.dumps([dict(press="snapkvv", ratio=0.5, tag="typo"), dict(press="knorm", ratio=0.5, tag="ok"),
                                dict(press="snapkv", match_bytes=1000, tag="tiny")]))
    p = subprocess.run([str(KVPY), str(SCRIPT), "cells", "--hf", str(HF), "--prompt-file", str(needle), "--cells", str(spec),
                        "--max-new-tokens", "4"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert p.returncode == 1
    assert [json.loads(line)["tag"] for line in p.stdout.strip().splitlines()] == ["ok"]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "typo: unknown press 'snapkvv'" in errors[0] and "tiny: --match-bytes 1000 keeps no" in errors[1]


TINY_GEMMA = """
import json, sys, torch, transformers
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)
cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16, max_position_embeddings=1024,
    layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"])
model = transformers.Gemma3ForCausalLM(cfg).eval()
model.save_pretrained(sys.argv[1])
g = torch.Generator().manual_seed(1)
ids = [2] + torch.randint(3, 500, (120,), generator=g).tolist()
ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
print(json.dumps(dict(ids=ids, ref=ref)))
"""


@pytest.mark.full
def test_gemma3_presses_only_its_global_layers(tmp_path):
    """A tiny random Gemma 3 text model (window 16; layers 2 and 5 global): no_press equals transformers'
    generate(); a press keeps its budget in the global layers only, the sliding layers their window
    (window - 1 entries, counted in kv_device_bytes), within one entry per pressed layer of the target;
    expected_attention is refused with its reason."""
    if not KVPY.exists():
        pytest.fail(f"no kvpress venv at {KVPY}: run `make venv-kvpress` (make test-full does)")
    p = subprocess.run([str(KVPY), "-c", TINY_GEMMA, str(tmp_path / "gemma")], capture_output=True, text=True,
                       env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    made = json.loads(p.stdout.strip().splitlines()[-1])
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(dict(ids=made["ids"], question_at=100)))
    rc, row, err = run("run", "--hf", tmp_path / "gemma", "--ids-file", ids, "--press", "no_press", "--max-new-tokens", 8)
    assert rc == 0, err[-3000:]
    assert row["tokens"] == made["ref"]
    for press in ("snapkv", "streaming_llm", "h2o"):
        rc, row, err = run("run", "--hf", tmp_path / "gemma", "--ids-file", ids, "--press", press,
                           "--match-bytes", 40_000, "--max-new-tokens", 8)
        assert rc == 0, err[-3000:]
        assert row["pressed_layers"] == [2, 5]
        kept = row["kept_per_layer"]
        assert kept[0] == kept[1] == kept[3] == kept[4] == 15 and kept[2] == kept[5] < 100
        assert 0 <= row["bytes_gap"] < 2 * row["kv_entry_bytes"]
    # the shared prefill: the sliding layers' windows filled through their own cache layers
    cells_equal_runs(tmp_path / "gemma", ids, [dict(press="snapkv", match_bytes=40_000, tag="s"),
                                               dict(press="h2o", ratio=0.5, question_aware=True, tag="h"),
                                               dict(press="no_press", tag="n")], 8, tmp_path)
    out = tmp_path / "rows.jsonl"  # a press that cannot run on this model: which and why
    rc, _, err = run("run", "--hf", tmp_path / "gemma", "--ids-file", ids, "--press", "expected_attention", "--ratio", 0.5,
                     "--out", out)
    assert_error(rc, err, out, "press expected_attention cannot run on model type 'gemma3_text'", "rotary embedding")


@pytest.mark.full
def test_error_lines(needle, tmp_path):
    """A press that cannot run (which and why), a press refused here, and a budget that keeps no
    context entry: one `error:` line, exit 1, nothing written to --out."""
    out = tmp_path / "rows.jsonl"
    short = tmp_path / "short.txt"
    short.write_text("My cat is called Tom.\nWhat is my cat called?\n")
    cases = [(["--prompt-file", short, "--press", "snapkv", "--ratio", "0.5"], ("press snapkv cannot run", "window")),
             (["--prompt-file", needle, "--press", "qfilter", "--ratio", "0.5"], ("press qfilter is not run here",)),
             (["--prompt-file", needle, "--press", "snapkv", "--match-bytes", 1000], ("keeps no context entry",)),
             (["--prompt-file", needle, "--press", "snapkv"], ("needs a budget",)),
             (["--prompt-file", needle, "--press", "no_press", "--expect-sha256", "0" * 64], ("token ids differ",))]
    for args, phrases in cases:
        rc, _, err = run("run", "--hf", HF, *args, "--out", out)
        assert_error(rc, err, out, *phrases)


@pytest.mark.full
def test_quantized_cache_counts_its_codes(needle):
    """transformers' QuantizedCache (HQQ backend, 4 bits, group 64, residual 128) runs through the same
    loop; its bytes are the codes, scales and zeros and the fp residual: under a fifth of the fp cache."""
    rc, row, err = run("run", "--hf", HF, "--prompt-file", needle, "--press", "quantized-4bit", "--quant-backend",
                       "hqq", "--max-new-tokens", 8)
    assert rc == 0, err[-3000:]
    assert 0 < row["kv_device_bytes"] < row["kv_fp_full_bytes"] / 4 and row["kept_per_layer"] == [row["compressed_tokens"]] * 30
