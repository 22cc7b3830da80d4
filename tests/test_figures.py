"""tools/figures.py on small synthetic results written to tmp_path: every figure is written as a non-empty
PNG, and a missing input is one clear error naming what is missing."""
import json
import subprocess
import sys

import pytest

from tools import figures

PNG = b"\x89PNG\r\n\x1a\n"
PRESET = figures.PRESET


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def jsonl(path, recs):
    write(path / "results.jsonl", "".join(json.dumps(r) + "\n" for r in recs))


def step_json(path, date, rows):
    grid = [dict(label=lb, context=32768, batch=1, step_ms_median=ms, floor_ms_h100=4.7,
                 profile=dict(kernels_us_per_step={"_attn_words_kernel": 3000.0})) for lb, ms in rows]
    write(path, json.dumps(dict(environment=dict(date=f"{date}T00:00:00+00:00", gpu="Fake GPU"), grid=grid)))


KERNEL_MD = """# bench.py: cuda (Fake GPU), bfloat16, 16 threads, compile=False, 2026-01-01T00:00:00+00:00

| kernel | context | bytes | us (min) | us eager | achieved GB/s | floor here us | floor H100 us |
|---|---|---|---|---|---|---|---|
| full-cache SDPA (1 token) | 32768 | 134,217,728 | 48.6 (47.7) | 108.3 | 2760.3 | 48.68 | 40.06 |
| 1-bit attention (2 tokens, 64 fetched) | 32768 | 12,988,416 | 102.7 (102.0) | 364.4 | 126.5 | 4.71 | 3.88 |
"""


def synthetic_results(root):
    step_json(root / "gpu-h100-2026-01-01" / "s-full.json", "2026-01-01", [("full", 8.0), ("specache-1bit", 15.0)])
    step_json(root / "gpu-h100-2026-01-02" / "call1" / "s-x.json", "2026-01-02", [(f"specache-1bit-{PRESET}", 15.3)])
    step_json(root / "gpu-h100-2026-01-02b" / "call1" / "s-x.json", "2026-01-02", [(f"specache-1bit-{PRESET}", 15.1)])
    write(root / "gpu-h100-2026-01-01" / "kernels-graph.md", KERNEL_MD)
    write(root / "gpu-h100-2026-01-02" / "call1" / "kernels.json", json.dumps(dict(
        environment=dict(gpu="Fake GPU", date="2026-01-02"),
        kernels=[dict(kernel="1-bit attention (2 tokens, 64 fetched)", context=32768, us=88.0, floor_us_h100=3.9)])))
    cells = lambda methods, lengths: [dict(method=m, length=n, depth=d, score=(n + 100 * d) % 3 / 2)  # noqa: E731
                                      for m in methods for n in lengths for d in (0.0, 0.5, 1.0)]
    paper = [m for b in (1, 2) for m in ("full", f"kivi-{b}bit", f"specache-{b}bit")]
    jsonl(root / "policies/niah", cells(paper, (1000, 2000)))
    for b in (1, 2):
        jsonl(root / f"policies/niah-busbytes-bits{b}", cells([f"specache-{b}bit-{PRESET}"], (1000, 2000)))
    jsonl(root / "policies/niah-busbytes-8k", [])
    every = [m for b in (1, 2) for m in ("full", f"kivi-{b}bit", f"specache-{b}bit", f"specache-{b}bit-{PRESET}")]
    jsonl(root / "long-context/niah", cells(every, (8000, 16000, 32700)))
    hit = lambda m, p="essay": dict(method=m, prompt=p, layer_hit=[0.5, 0.6, 0.7], layer_hit_mass=[0.6, 0.7, 0.8])  # noqa
    for b in (1, 2):
        jsonl(root / f"policies/hitmass-paper-bits{b}", [hit(f"specache-{b}bit"), hit(f"specache-{b}bit", "needle")])
        jsonl(root / f"policies/hitmass-bits{b}", [hit(f"specache-{b}bit-lsq-resync-k96-g32-r32-sink4")])
        jsonl(root / f"policies/busbytes-bits{b}", [hit(f"specache-{b}bit-{PRESET}")])
    write(root / figures.BASELINES_DIR / "summary.json", json.dumps(
        [dict(panel="niah 16k", method=m, mib=mib, score=sc, lo=sc - 0.1, hi=min(1, sc + 0.1))
         for m, mib, sc in (("full", 54.5, 1.0), ("specache-1bit-best", 13.8, 0.9), ("snapkv@specache-1bit-best", 13.8, 0.3),
                            ("snapkv@1/8", 14.2, 0.5))]))
    qa = [dict(cmd="ruler", method=m, task=t, sample=i, score=float((i + j) % 2))
          for j, m in enumerate(figures.QA_NAMES) for t in ("qa_squad", "qa_hotpot") for i in range(3)]
    jsonl(root / figures.QA_DIR, [r for r in qa if not r["method"].startswith("snapkv")])
    jsonl(root / figures.QA_PRESSES_DIR, [r for r in qa if r["method"].startswith("snapkv")]
          + [dict(cmd="niah", method="snapkv+qa@specache-1bit-best", depth=0.5, score=1.0)])  # another benchmark: left out
    write(root / figures.VLLM_DIR / "bench.jsonl", "".join(json.dumps(dict(
        cache=c, kv_bytes=10**8, max_concurrency=mc, most_running=run, requests=8, tokens_per_s=tps, prompt_tokens=1500,
        new_tokens=32, max_model_len=2048)) + "\n" for c, mc, run, tps in (("full", 1.0, 1, 265.0), ("kivi-1bit", 9.0, 8, 255.7))))


def test_every_figure_is_a_non_empty_png(tmp_path):
    synthetic_results(tmp_path / "results")
    assert figures.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path / "docs")]) == 0
    for name in figures.FIGURES:
        data = (tmp_path / "docs" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name


def test_the_script_runs_as_make_figures_runs_it(tmp_path):
    """`python tools/figures.py` (tools/ first on sys.path, not the repository root) draws every figure."""
    synthetic_results(tmp_path / "results")
    p = subprocess.run([sys.executable, str(figures.ROOT / "tools" / "figures.py"), "--results", str(tmp_path / "results"),
                        "--out", str(tmp_path / "docs")], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(f.name for f in (tmp_path / "docs").iterdir()) == sorted(figures.FIGURES)


def test_run_names_and_the_markdown_kernel_table(tmp_path):
    synthetic_results(tmp_path)
    assert figures.run_name(tmp_path / "gpu-h100-2026-01-01") == "2026-01-01"
    assert figures.run_name(tmp_path / "gpu-h100-2026-01-02") == "2026-01-02, first run"
    assert figures.run_name(tmp_path / "gpu-h100-2026-01-02b") == "2026-01-02, second run"
    d = figures.parse_kernel_md(tmp_path / "gpu-h100-2026-01-01" / "kernels-graph.md")
    assert d["environment"] == dict(gpu="Fake GPU", date="2026-01-01")
    assert [(k["us"], k["floor_us_h100"], k["context"]) for k in d["kernels"]] == [(48.6, 40.06, 32768),
                                                                                   (102.7, 3.88, 32768)]


@pytest.mark.parametrize("name,message", [("h100-step-time.png", "H100 step results"),
                                          ("h100-kernels.png", "H100 kernel results"),
                                          ("niah.png", "results.jsonl"),
                                          ("hitrate-per-layer.png", "results.jsonl"),
                                          ("baselines-score-vs-bytes.png", "summary.json"),
                                          ("qwen-qa.png", "results.jsonl"), ("vllm-capacity.png", "bench.jsonl")])
def test_a_missing_input_is_one_clear_error(tmp_path, name, message):
    with pytest.raises(figures.MissingInput, match=message):
        figures.FIGURES[name](tmp_path, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_a_missing_method_names_it(tmp_path, capsys):
    synthetic_results(tmp_path / "results")
    jsonl(tmp_path / "results/policies/niah-busbytes-bits2", [])
    with pytest.raises(figures.MissingInput, match=f"specache-2bit-{PRESET}"):
        figures.niah(tmp_path / "results", tmp_path / "niah.png")
    assert figures.main(["--results", str(tmp_path / "results"), "--out", str(tmp_path / "docs")]) == 1
    assert capsys.readouterr().err.startswith("error: figures.py: missing or malformed input")
