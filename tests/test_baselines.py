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
def gemma_270m_shape():
    """Gemma 3 270M as cache.setup_caches sees it (its shape, no weights): 18 layers, one kv head of 256,
    a window of 512 in every layer but 5, 11 and 17, fp32 as on this CPU."""
    from types import SimpleNamespace

    import torch

    from model import ModelArgs
    args = ModelArgs(name="gemma-3-270m", dim=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256, max_seq_len=32768,
                     layer_windows=((512,) * 5 + (None,)) * 3)
    model = SimpleNamespace(args=args, tok_embeddings=SimpleNamespace(weight=torch.empty(0)))
    model.setup_caches = lambda make, row_start=None: [make(i) for i in range(args.n_layers)]
    return model


def test_deployed_bytes_worked_example():
    """docs/baselines.md's worked example: Gemma 3 270M, a NIAH prompt of 15,999 tokens (15 of them the
    completion cue) + 24 new, caches for 16,025 positions (tools/eval.py's sizing). The 1-bit preset in
    16 bits, by hand, per global layer: codes 2 x 16,128 slots x 32 B; key scales and zeros 2 x 504
    groups x 256 x 2 B; value scales and zeros 2 x 16,128 x 8 x 2 B; the residual 2 x 66 x 256 x 2 B;
    the ring of sinks and fetched rows 2 x 68 x 256 x 2 B and its 68 positions (int64) and flags; two
    int64 counters. Each local layer: a ring of 513 slots, 2 x 513 x 256 x 2 B. A press at those bytes
    keeps 2,122 context entries in each global layer (1,024 B an entry), the local layers 511 entries."""
    from generate import setup_caches
    from tools import baselines_bytes as BB
    global_layer = 2 * 16_128 * 32 + 2 * 504 * 256 * 2 + 2 * 16_128 * 8 * 2 + 2 * 66 * 256 * 2 + 2 * 68 * 256 * 2 + 68 * 9 + 16
    local_layer = 2 * 513 * 256 * 2
    assert (global_layer, local_layer) == (2_202_228, 525_312)
    caches = setup_caches(gemma_270m_shape(), "specache-1bit-best", 1, 15_999 + 24 + 2)
    assert caches.deployed_bytes() == 3 * global_layer + 15 * local_layer == 14_486_364
    # as run (fp32): the residual, the ring and the local rings at 4 B an element, the codes and scales as stored
    assert caches.device_bytes() == 14_486_364 + 3 * (2 * 66 + 2 * 68) * 256 * 2 + 15 * local_layer == 22_777_692
    windows = ((512,) * 5 + (None,)) * 3
    entry = BB.entry_bytes(1, 256)
    n = BB.kept_for_bytes(14_486_364, windows, 15_999, 15_999 - 15, 24, entry)
    assert entry == 1024 and n == (14_486_364 // 1024 - 15 * 511) // 3 - 15 - 23 == 2122
    got = BB.device_bytes([n] * 18, windows, 15_999, 15_999 - 15, 24, entry)
    assert 0 <= 14_486_364 - got < 3 * entry
    # the same budget counted as run (fp32 on both sides) kept about half: 1,114 entries
    assert BB.kept_for_bytes(22_777_692, windows, 15_999, 15_999 - 15, 24, BB.entry_bytes(1, 256, 4)) == 1114


def test_deployed_bytes_count_floats_at_two_bytes():
    """quant.deployed_nbytes: fp32 and bf16 elements at 2 bytes, integer codes and positions as stored."""
    import torch

    from quant import deployed_nbytes
    assert deployed_nbytes(torch.zeros(3, 5), torch.zeros(7, dtype=torch.bfloat16)) == 2 * 15 + 2 * 7
    assert deployed_nbytes(torch.zeros(4, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)) == 4 + 16


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
    """A stand-in with the interface of make_press's PyramidKV: each layer's budget falls with its index
    among `num_hidden_layers` (the pressed layers, as pyramid_layer_budget passes them)."""
    compression_ratio = 0.0

    def pyramid_budget(self, module, q_len):
        assert module.config.num_hidden_layers == 10 and 0 <= module.layer_idx < 10
        return max(1, round(q_len * (1 - self.compression_ratio) * (1.5 - module.layer_idx / 9)))


def test_pyramid_budgets_sum_to_the_target():
    """The pyramid runs over the pressed layers (here 10 of 30: index 0-9 among them), and the ratio's
    budgets sum to the largest total at most the target."""
    press, layers = RampPress(), list(range(2, 30, 3))
    for target in (500, 4321, 20000):
        ratio = B.pyramid_ratio_for(press, target, layers, 4000)
        press.compression_ratio = ratio
        total = sum(B.pyramid_layer_budget(press, i, layers, 4000) for i in layers)
        assert target - len(layers) <= total <= target
    assert B.pyramid_applies(press, layers, 4000)  # budgets differ by layer
    flat = RampPress()
    flat.pyramid_budget = lambda module, q_len: max(1, round(q_len * (1 - flat.compression_ratio)))
    assert not B.pyramid_applies(flat, layers, 4000)  # kvpress's fallback: SnapKV's one budget


def test_a_budget_that_keeps_no_context_entry_is_refused():
    with pytest.raises(B.CellError, match=r"^--match-bytes 100000 keeps no context entry"):
        B.kept_for_bytes(100_000, [None] * 30, 4000, 3970, 32, B.entry_bytes(3, 64, 4))


def test_grid_budgets_and_cells(capsys):
    """The grid's cells: each press at each matched and fixed budget (Table 2's 1/4 keeps a quarter:
    kvpress ratio 0.75), NAME+qa question-aware, unpressed methods once, finished cells skipped."""
    from types import SimpleNamespace

    from tools import baselines_grid as G
    assert G.parse_fixed("1/4,1/8") == {"1/4": 0.75, "1/8": 0.875}
    for bad in ("1/0", "5/4", "x"):
        with pytest.raises(SystemExit) as e:
            G.parse_fixed(bad)
        assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: --fixed '{bad}'")
    a = SimpleNamespace(presses="no_press,snapkv+qa,quantized-2bit", fixed="1/8")
    done = {"snapkv+qa@specache-1bit"}
    cells = G.cells_for(a, {"specache-1bit": 100, "specache-1bit-best": 200}, done, lambda m: m)
    assert cells == [("no_press", dict(press="no_press", question_aware=False, tag="no_press")),
                     ("snapkv+qa@specache-1bit-best", dict(press="snapkv", question_aware=True, tag="snapkv+qa@specache-1bit-best",
                                                           match_bytes=200, matched="specache-1bit-best")),
                     ("snapkv+qa@1/8", dict(press="snapkv", question_aware=True, tag="snapkv+qa@1/8", ratio=0.875, fixed="1/8")),
                     ("quantized-2bit", dict(press="quantized-2bit", question_aware=False, tag="quantized-2bit"))]
    with pytest.raises(SystemExit) as e:
        G.cells_for(SimpleNamespace(presses="snapkvv", fixed=""), {}, set(), lambda m: m)
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: unknown press 'snapkvv'")


def test_grid_report_and_figure(tmp_path):
    """The report's tables, one per benchmark and length: mean score x100 per method and column, the mean
    with Wilson's 95% interval over all prompts and over the columns the fp cache answers (a column it
    fails separates nothing, and is named; so does one some method has not run), mean device MiB; a PyramidKV
    cell that equals SnapKV is named, not scored; a panel only where the presses ran; the figure is written."""
    from tools import baselines_grid as G
    rows = [dict(cmd="ruler", model="m", method=m, length=L, task=t, score=sc, kv_device_bytes=b)
            for m, L, t, sc, b in [("no_press", 8000, "a", 1.0, 2 ** 22), ("no_press", 8000, "b", 0.0, 2 ** 23),
                                   ("snapkv@specache-1bit", 8000, "a", 0.5, 2 ** 20),
                                   ("snapkv@specache-1bit", 8000, "b", 0.0, 2 ** 20),
                                   ("snapkv@specache-1bit", 3800, "a", 1.0, 2 ** 21),
                                   ("no_press", 8000, "c", 1.0, 2 ** 22)]]  # c: the fp cache alone
    rows += [dict(cmd="ruler", model="m", method="pyramidkv@specache-1bit", length=8000, task=t, score=None,
                  equals="snapkv") for t in "ab"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    project = tmp_path / "project"  # the project's rows at a length the presses did not run: no panel
    project.mkdir()
    (project / "results.jsonl").write_text(json.dumps(dict(cmd="ruler", model="m", method="full", length=16000,
                                                           task="a", score=1.0, prompt_tokens=16000, max_new=8)) + "\n")
    G.main(["report", "--out", str(tmp_path), "--project", str(project), "--figure"])
    table = (tmp_path / "results.md").read_text()
    assert "## ruler 8k (m)" in table and "## ruler 3.8k (m)" in table  # a length of 3,800 is not "3k"
    assert "16k" not in table
    assert "The fp cache (no_press) scores 0 on b: those separate nothing" in table
    assert "Not every method ran on c: left out of 'sep.' (the fp cache (no_press) there: c 100.0)." in table
    with pytest.raises(SystemExit) as e:  # a folder without rows: one error line, not a traceback
        G.main(["report", "--out", str(tmp_path / "none")])
    assert e.value.code == 2
    lo, hi = G.wilson(0.5, 2)
    assert abs(lo - 0.0945) < 1e-3 and abs(hi - 0.9055) < 1e-3  # Wilson: 0.5 +- 0.41 at n = 2
    mean = 2 / 3  # no_press: a and c answered, b not; 'sep.' over a alone
    assert f"| no_press | 3 | 100.0 | 0.0 | 100.0 | {G.fmt((mean, *G.wilson(mean, 3)))} | " \
           f"{G.fmt((1.0, *G.wilson(1.0, 1)))} | 5.33 |" in table
    assert f"| snapkv@specache-1bit | 2 | 50.0 | 0.0 |  | {G.fmt((0.25, *G.wilson(0.25, 2)))} | " \
           f"{G.fmt((0.5, *G.wilson(0.5, 1)))} | 1.00 |" in table
    assert "| pyramidkv@specache-1bit | 2 | = snapkv | = snapkv | = snapkv | kvpress runs snapkv at this budget | | |" in table
    points = json.loads((tmp_path / "summary.json").read_text())
    assert {p["method"] for p in points} == {"no_press", "snapkv@specache-1bit"}
    assert (tmp_path / "score-vs-bytes.png").stat().st_size > 10_000


def test_hf_checkpoint_missing_gguf(tmp_path, capsys):
    """hf-checkpoint --gguf names the file it cannot find in one error line and writes no directory."""
    from tools import baselines_grid as G
    with pytest.raises(SystemExit) as e:
        G.main(["hf-checkpoint", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "hf")])
    assert e.value.code == 2 and f"error: --gguf {tmp_path / 'none.gguf'}: no such file" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def run(*args, py=KVPY, env=None):
    """(exit code, the JSON row or None, stderr) of `py tools/baselines.py ARGS`."""
    p = subprocess.run([str(py), str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env or ENV,
                       cwd=ROOT, timeout=600)
    lines = p.stdout.strip().splitlines()
    return p.returncode, json.loads(lines[-1]) if p.returncode == 0 and lines else None, p.stderr


def assert_error(rc, stderr, out_file, *phrases):
    lines = stderr.strip().splitlines()
    assert rc == 2 and lines and lines[-1].startswith("error: "), stderr[-2000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in stderr
    assert all(p in lines[-1] for p in phrases), lines[-1]
    assert not out_file.exists()


@pytest.fixture
def small_model_dir(tmp_path):
    """A model directory as far as the runner's first checks read it (config.json only): a Gemma 3 text
    model of 6 layers, 2 and 5 global, window 16, one kv head of 32, 1,024 positions."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(
        model_type="gemma3_text", num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        hidden_size=64, sliding_window=16, max_position_embeddings=1024,
        layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2)))
    return d


def ids_file(tmp_path, n, question_at):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(dict(ids=list(range(3, 3 + n)), question_at=question_at)))
    return path


def test_missing_kvpress_venv_names_the_make_target(tmp_path, small_model_dir):
    env = dict(ENV, KVPRESS_PYTHON=str(tmp_path / "none" / "python"))
    out = tmp_path / "rows.jsonl"
    rc, _, err = run("run", "--hf", small_model_dir, "--prompt-file", SCRIPT, "--press", "snapkv", "--ratio", "0.5",
                     "--out", out, py=sys.executable, env=env)
    assert_error(rc, err, out, "make venv-kvpress")


def test_bad_input_is_one_error_line_before_any_model_loads(tmp_path, small_model_dir):
    """From the project's Python (no kvpress, no weights): an unknown press, a model directory that is not
    one, a prompt longer than the model's positions, and budgets that keep no context entry are each one
    `error:` line, exit code 2, nothing appended to --out."""
    out = tmp_path / "rows.jsonl"
    ids = ids_file(tmp_path, 200, 190)
    long_ids = tmp_path / "long.json"
    long_ids.write_text(json.dumps(dict(ids=list(range(1020)), question_at=1000)))
    # 128 B an entry; the 4 local layers hold 15 entries each, each global layer 10 question + 7 new ones:
    # one context entry a global layer needs 60 + 2 x 18 = 96 entries, 12,288 B; 12,000 B hold 93
    cases = [(["--ids-file", ids, "--press", "snapkvv", "--ratio", "0.5"], ("unknown press 'snapkvv'", "streaming_llm")),
             (["--ids-file", ids, "--press", "snapkv", "--ratio", "0.5", "--hf", tmp_path / "nowhere"],
              ("is not a transformers model directory (no config.json)",)),
             (["--ids-file", long_ids, "--press", "no_press"],
              ("prompt (1020 tokens) + --max-new-tokens (8) exceeds the model's 1024 positions",)),
             (["--ids-file", ids, "--press", "snapkv", "--match-bytes", 12_000],
              ("--match-bytes 12000 keeps no context entry", "at least 12288 bytes")),
             (["--ids-file", ids, "--press", "knorm", "--ratio", "0.999"], ("--ratio 0.999 keeps no entry of the 190",))]
    for args, phrases in cases:
        hf = [] if "--hf" in args else ["--hf", small_model_dir]
        rc, _, err = run("run", *hf, *args, "--max-new-tokens", 8, "--out", out, py=sys.executable)
        assert_error(rc, err, out, *phrases)
    rc, _, err = run("run", "--hf", small_model_dir, "--ids-file", ids, "--press", "snapkv", "--match-bytes", 12_288,
                     "--max-new-tokens", 8, "--out", out, env=dict(ENV, KVPRESS_PYTHON=str(tmp_path / "none")),
                     py=sys.executable)
    assert "keeps no context entry" not in err and "make venv-kvpress" in err  # 12,288 B: one context entry


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
    from integrations import hf
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
    long = tmp_path / "long.txt"  # PyramidKV builds its pyramid from 1,280 entries a layer: a longer prompt
    from tests.helpers import require_default_checkpoint
    from tokenizer import load_tokenizer
    from tools.tasks import niah
    long.write_text(niah(load_tokenizer(require_default_checkpoint()), 3000, 0.5).prompt + "\n")
    for press, prompt, target, extra in (("snapkv", needle, 1_000_000, []), ("pyramidkv", long, 36_000_000, []),
                                         ("knorm", needle, 1_000_000, ["--question-aware"])):
        rc, row, err = run("run", "--hf", HF, "--prompt-file", prompt, "--press", press, "--match-bytes", target,
                           "--max-new-tokens", 8, "--out", out, *extra)
        assert rc == 0, err[-3000:]
        assert 0 <= row["bytes_gap"] < 30 * row["kv_entry_bytes"] and row["kv_device_bytes"] < row["kv_fp_full_bytes"]
        assert row["kv_entry_bytes"] == 2 * 3 * 64 * 2 and row["kv_entry_bytes_as_run"] == 2 * 3 * 64 * 4
        assert row["kv_device_bytes_as_run"] == 2 * row["kv_device_bytes"]  # every entry an fp32 row as run
        assert row["pressed_layers"] == list(range(30))
        assert (row["question_tokens"] == 0) if extra else (row["question_tokens"] > 0)
        if press == "pyramidkv":  # the pyramid: the first layers keep more than the last
            assert row["kept_per_layer"][0] > row["kept_per_layer"][15] > row["kept_per_layer"][29]
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
    from integrations import hf
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


def tiny_gemma(tmp_path) -> dict:
    """TINY_GEMMA saved under tmp_path/gemma: its prompt ids and transformers' greedy tokens."""
    if not KVPY.exists():
        pytest.fail(f"no kvpress venv at {KVPY}: run `make venv-kvpress` (make test-full does)")
    p = subprocess.run([str(KVPY), "-c", TINY_GEMMA, str(tmp_path / "gemma")], capture_output=True, text=True,
                       env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.full
def test_gemma3_presses_only_its_global_layers(tmp_path):
    """A tiny random Gemma 3 text model (window 16; layers 2 and 5 global): no_press equals transformers'
    generate(); a press keeps its budget in the global layers only, the sliding layers their window
    (window - 1 entries, counted in kv_device_bytes), within one entry per pressed layer of the target;
    expected_attention is refused with its reason."""
    made = tiny_gemma(tmp_path)
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
    # PyramidKV on 50 entries a layer is kvpress's SnapKV: `run` says so; `cells` gives a row naming it
    rc, _, err = run("run", "--hf", tmp_path / "gemma", "--ids-file", ids, "--press", "pyramidkv", "--ratio", 0.5,
                     "--out", out)
    assert_error(rc, err, out, "press pyramidkv at ratio 0.5000", "kvpress runs SnapKV's single budget")
    spec = tmp_path / "pyramid.json"
    spec.write_text(json.dumps([dict(press="pyramidkv", ratio=0.5, tag="p")]))
    p = subprocess.run([str(KVPY), str(SCRIPT), "cells", "--hf", str(tmp_path / "gemma"), "--ids-file", str(ids), "--cells",
                        str(spec), "--max-new-tokens", "4"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads(p.stdout.strip().splitlines()[-1])
    assert row["tag"] == "p" and row["equals"] == "snapkv" and "text" not in row


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
    loop; its bytes are the codes, scales and zeros and the fp residual: in 16 bits a third of the fp
    cache's on this 400-token prompt (it quantizes the whole prompt), more as run (fp32 scales, residual)."""
    rc, row, err = run("run", "--hf", HF, "--prompt-file", needle, "--press", "quantized-4bit", "--quant-backend",
                       "hqq", "--max-new-tokens", 8)
    assert rc == 0, err[-3000:]
    assert 0 < row["kv_device_bytes"] < row["kv_device_bytes_as_run"] and row["kv_device_bytes"] < row["kv_fp_full_bytes"] / 2
    assert row["kept_per_layer"] == [row["compressed_tokens"]] * 30


COLSUM_CHECK = """
import json, sys, torch, transformers, kvpress
sys.path.insert(0, sys.argv[2])
from tools.baselines_prefill import COLSUM, record_colsums, register_colsum_attention
transformers.utils.logging.set_verbosity_error(); transformers.utils.logging.disable_progress_bar()
register_colsum_attention()
ids = torch.tensor([json.loads(open(sys.argv[3]).read())["ids"]])
seen = {}
for impl in ("eager", COLSUM):
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation=impl).eval()
    record_colsums(model, [2, 5], True)
    def hook(module, args, kwargs, output, impl=impl):
        keys = kwargs["past_key_values"].layers[module.layer_idx].keys
        score = kvpress.ObservedAttentionPress().score(module, None, keys, None, output[1], None)
        seen[impl, module.layer_idx] = (output[1].shape[2], score)
    for i in (2, 5):
        model.model.layers[i].self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(ids, past_key_values=transformers.DynamicCache(config=model.config))
out = {}
for i in (2, 5):
    (rows_e, e), (rows_c, c) = seen["eager", i], seen[COLSUM, i]
    out[i] = dict(rows=[rows_e, rows_c], err=float((e - c).abs().max()), scale=float(e.abs().max()),
                  same_top=bool(torch.equal(e.topk(40).indices.sort().values, c.topk(40).indices.sort().values)))
print(json.dumps(out))
"""

PYRAMID_CHECK = """
import json, sys, kvpress
sys.path.insert(0, sys.argv[1])
from tools.baselines import make_press
from tools.baselines_bytes import pyramid_applies, pyramid_ratio_for
out = {}
for mean in (2000, 1000):
    press = make_press(kvpress, "pyramidkv", [5, 11, 17])
    press.compression_ratio = pyramid_ratio_for(press, 3 * mean, [5, 11, 17], 16000)
    budgets = [press.get_layer_budget(type("M", (), dict(layer_idx=i))(), 16000) for i in (5, 11, 17)]
    out[mean] = dict(budgets=budgets, applies=pyramid_applies(press, [5, 11, 17], 16000))
print(json.dumps(out))
"""


@pytest.mark.full
def test_h2o_column_sums_equal_the_eager_weights(tmp_path):
    """H2O's score (kvpress's ObservedAttentionPress) from the column sums that the runner's attention
    returns equals the score from eager attention's full weights, on a tiny random Gemma 3 (layers 2 and 5
    global): the same numbers up to rounding and the same kept entries, from a [B, heads, 1, keys] record
    instead of [B, heads, queries, keys]."""
    made = tiny_gemma(tmp_path)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(dict(ids=made["ids"])))
    p = subprocess.run([str(KVPY), "-c", COLSUM_CHECK, str(tmp_path / "gemma"), str(ROOT), str(ids)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for layer in json.loads(p.stdout.strip().splitlines()[-1]).values():
        assert layer["rows"] == [121, 1] and layer["err"] < 1e-5 * layer["scale"] and layer["same_top"], layer


@pytest.mark.full
def test_pyramidkv_spreads_its_pyramid_over_the_pressed_layers():
    """kvpress's own PyramidKV budgets over Gemma 3's three global layers (5, 11, 17 as the pyramid's
    0, 1, 2): falling with depth and summing to the target where its pyramid applies (a mean of 2,000
    entries at 16k), one SnapKV budget where it does not (1,000: under 20 x its window of 64)."""
    p = subprocess.run([str(KVPY), "-c", PYRAMID_CHECK, str(ROOT)], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    steep, flat = out["2000"], out["1000"]
    assert steep["applies"] and steep["budgets"][0] > steep["budgets"][1] > steep["budgets"][2]
    assert 6000 - 3 <= sum(steep["budgets"]) <= 6000
    assert not flat["applies"] and len(set(flat["budgets"])) == 1
