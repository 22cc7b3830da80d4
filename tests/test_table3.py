"""Table 3 (tools/table3.py, tools/bench.py --kv-budget-gb) on a tiny random Llama: the lines the batch is found by,
what bounds it (the device budget, the host memory, the run cap), the host store's pinned size, one row's prefill
stored into every row, the summary's line. No timing assertions."""
import json
from argparse import Namespace
from dataclasses import asdict

import pytest
import torch

from generate import setup_caches
from tests.helpers import tiny_model
from tools import bench, bench_report, table3
from tools.replay import PrefillReplay

GiB = 2**30
BW = {"copy_gbs": 10.0, "read_gbs": 20.0}


def opts(**kw):
    a = dict(bits=1, group=16, residual=32, k=8, one_bit=None, fit=None, quant=None, warmup=1, steps=2, profile_steps=0,
             prefill_chunk=64, compile=False, max_run_batch=None, host_budget_gb=64.0, attn_path=None, kv_budget_gb=None,
             no_fixed_batch=False, prefill_one_row=False, different_prompts=False)
    a.update(kw)
    return Namespace(**a)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def ids(n=200, seed=1):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cache", ["full", "kivi", "specache"])
def test_budget_lines_are_linear_in_the_batch(model, cache):
    a = opts()
    n = bench.cache_len(100, a)
    cfg = bench.bench_config(cache, a)[0]
    fixed, per_row, host_row = table3.kv_bytes_linear(model, cfg, n)
    caches = setup_caches(model, cfg, 3, n)
    assert caches.device_bytes() == fixed + 3 * per_row
    assert caches.host_bytes() == 3 * host_row
    assert (host_row > 0) == (cache == "specache")


def test_each_row_says_what_bound_its_batch_and_fixed_batch_is_optional(model):
    """Each cache runs at min(the budget's batch, the host's, the run cap), and its row says which bound it;
    --no-fixed-batch leaves out the one-batch comparison."""
    a = opts(max_run_batch=2)
    caches = ["full", "kivi", "specache"]
    n = bench.cache_len(64, a)
    lines = {c: table3.kv_bytes_linear(model, bench.bench_config(c, a)[0], n) for c in caches}
    fixed, per_row, _ = lines["full"]
    a.kv_budget_gb = (fixed + 3.5 * per_row) / 1e9  # full fits 3; the low-bit caches fit more
    runner = bench.Runner(model, ids(), a, BW)
    out = table3.budget_section(runner, caches, [64], a)
    rows = {r["cache"]: r for r in out["rows"]}
    for c in caches:
        r, (f, p, _) = rows[c], lines[c]
        assert f + p * r["max_batch"] <= a.kv_budget_gb * 1e9 < f + p * (r["max_batch"] + 1)
        assert r["run_batch"] == min(r["max_batch"], 2) and r["run_cap"] == 2
        assert runner.rows[(c, 64, r["run_batch"])]["kv_device_bytes"] == f + p * r["run_batch"]
        assert r["bound"] == "run cap" and r["capped"] and r["note"] == f"capped: batch 2 of the budget's {r['max_batch']} (the run cap)"
    assert rows["full"]["max_batch"] == 3 and rows["kivi"]["max_batch"] > 3 and rows["specache"]["max_batch"] > 3
    assert rows["full"]["host_batch"] is None and rows["specache"]["host_batch"] > 3
    assert rows["full"]["speedup_vs_full"] == 1.0
    fx = {r["cache"]: r for r in out["fixed"]}  # Q6: one batch for all (the smallest budget's, capped)
    assert {r["batch"] for r in fx.values()} == {2} and fx["full"]["vs_full"] == 1.0 and fx["kivi"]["vs_kivi"] == 1.0
    # the host memory bounds SpeCache's batch below the budget's: it runs the host's, and says so
    a.max_run_batch, a.no_fixed_batch = 8, True
    a.host_budget_gb = 2.5 * lines["specache"][2] / 1e9
    kept = []
    limited = {r["cache"]: r for r in table3.budget_section(runner, caches, [64], a, on_row=lambda s: kept.append(len(s["rows"])))["rows"]}
    spec = limited["specache"]
    assert spec["host_batch"] == 2 and spec["run_batch"] == 2 and spec["bound"] == "host memory"
    assert spec["note"] == f"host-bound: batch 2 of the budget's {spec['max_batch']}" and spec["max_batch"] > 2
    assert limited["full"]["bound"] == "device budget" and limited["full"]["run_batch"] == 3 and "note" not in limited["full"]
    assert kept == [1, 2, 3]  # (a cut run keeps what it measured)
    assert model.layers[0].attention.kv_cache is None  # (released: nothing pinned between runs)


def test_host_bound_from_a_fake_meminfo_picks_the_smaller_batch(tmp_path, monkeypatch, model):
    """The host budget is HOST_SHARE of MemAvailable, and a budget's batch the host cannot hold runs at the host's;
    pinned (CUDA), the store is two tensors each rounded up to a power of two, so SpeCache 1-bit at 4 layers and
    32k (512 MiB a row) pins 64 GiB for 75 rows."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         2000000 kB\nMemAvailable:   104857600 kB\n")
    monkeypatch.setattr(table3, "MEMINFO", str(meminfo))
    assert table3.host_memory_bytes(str(meminfo)) == 100 * GiB
    budget = table3.default_host_budget_gb() * 1e9
    assert budget == pytest.approx(0.6 * 100 * GiB)
    row = 2 * 4 * 8 * 32787 * 128 * 2  # K and V, 4 layers, 8 kv heads, 32k + the steps, 128 dims, 2 bytes
    assert table3.host_footprint(row, 75, pinned=True) == 64 * GiB and table3.host_footprint(row, 75, pinned=False) == 75 * row
    assert table3.host_footprint(row, 63, pinned=True) == 32 * GiB
    # 60 GiB: 75 rows would pin 64 GiB (38 GiB unpinned fits): the host holds 63 (2 x 16 GiB), the smaller batch
    assert table3.host_batch(row, budget, pinned=True) == 63 and table3.host_batch(row, budget, pinned=False) == 119
    assert table3.host_batch(0, budget, pinned=True) is None
    # the tiny model's SpeCache: the device budget holds 6 rows, the fake host 2.5
    a = opts(max_run_batch=8, no_fixed_batch=True)
    fixed, per_row, host_row = table3.kv_bytes_linear(model, bench.bench_config("specache", a)[0], bench.cache_len(64, a))
    meminfo.write_text(f"MemAvailable: {int(2.5 * host_row / table3.HOST_SHARE / 1024)} kB\n")
    a.host_budget_gb, a.kv_budget_gb = bench.parse_args([]).host_budget_gb, (fixed + 6.5 * per_row) / 1e9
    row = table3.budget_section(bench.Runner(model, ids(), a, BW), ["specache"], [64], a)["rows"][0]
    assert (row["max_batch"], row["host_batch"], row["run_batch"], row["bound"]) == (6, 2, 2, "host memory")
    assert row["note"] == "host-bound: batch 2 of the budget's 6" and "tok_s" in row
    monkeypatch.setattr(table3, "MEMINFO", str(tmp_path / "missing"))  # no /proc/meminfo: the free physical pages
    import os
    assert table3.host_memory_bytes(str(tmp_path / "missing")) == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def test_run_cap_and_host_budget_defaults(model):
    """Without --max-run-batch a CPU run caps at 4 and CUDA at what its free memory holds; the host budget
    defaults to HOST_SHARE of MemAvailable, not all of RAM; prefill's logits count toward the cap unless one
    row is prefilled for all."""
    a = bench.parse_args([])
    assert a.max_run_batch == 4 and table3.run_batch_cap(model, 0, 1, a) == 4
    assert table3.run_batch_cap(model, 0, 1, opts(max_run_batch=None)) is None  # (CPU, no cap asked)
    assert 0 < a.host_budget_gb <= table3.HOST_SHARE * table3.host_memory_bytes() / 1e9 * 1.1
    assert table3.prefill_row_bytes(model, opts()) == 64 * 256 * (4 + 4)  # (fp32 model: its logits and fp32's)
    assert table3.prefill_row_bytes(model, opts(prefill_one_row=True)) == 0


def test_a_run_out_of_memory_is_its_rows_error_and_the_next_cache_runs(model):
    """At the batch its budget allows a run can still fail for memory: the row says so and the table goes on;
    a run's kernel profile (CUDA) goes into its row."""
    a = opts(kv_budget_gb=1e-3, max_run_batch=2, no_fixed_batch=True)
    calls = []

    class Runner(bench.Runner):
        def __call__(self, cache, context, batch):
            calls.append(cache)
            if cache == "kivi":
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return dict(step_ms_median=1.0, tok_s=batch * 1e3, prefill_s=0.1, fetch_bytes_per_step=0, kv_device_bytes=1,
                        profile={"kernels": [{"name": "_select_kernel", "us_per_step": 5.0}]})
    out = table3.budget_section(Runner(model, ids(), a, {}), ["full", "kivi", "specache"], [64], a)
    rows = {r["cache"]: r for r in out["rows"]}
    assert calls == ["full", "kivi", "specache"] and "fixed" not in out
    assert rows["kivi"]["error"].startswith("out of memory at batch 2: CUDA out of memory") and "tok_s" not in rows["kivi"]
    assert rows["specache"]["profile"]["kernels"][0]["name"] == "_select_kernel"
    line = bench_report.table3_headline(out)
    assert f"{rows['kivi']['label']} batch 2 (capped: batch 2 of the budget's" in line and "out of memory" in line
    assert f"{rows['specache']['label']} batch 2" in line and "1.00x fp16's (target >= 4.6x)" in line
    assert "_select_kernel 5" in line


def test_one_rows_prefill_stored_into_every_row_decodes_as_the_batchs_own(model):
    """--prefill-one-row: one row prefilled and stored into every row, a chunk at a time, gives the cache a
    batch prefill of the same prompt gives: the same tokens, every row alike."""
    import generate
    prompt = torch.tensor([ids(160)] * 3)
    for cache in ("full", "kivi", "specache"):
        cfg = bench.bench_config(cache, opts())[0]
        tokens = []
        for steps in (generate.Steps(), generate.Steps(prefill=PrefillReplay(64, [cfg], one_row=True))):
            setup_caches(model, cfg, 3, 200)
            tokens.append(generate.generate(model, prompt, generate.Decoding(6), steps)[0])
        assert torch.equal(tokens[0], tokens[1]) and torch.equal(tokens[1][0], tokens[1][2]), cache
    with pytest.raises(ValueError, match="different prompts"):
        setup_caches(model, cfg, 2, 200)
        PrefillReplay(64, [cfg], one_row=True)(model, torch.tensor([ids(100, 1), ids(100, 2)]))


def test_the_cli_runs_table3_as_the_paper_does(tmp_path, model):
    """`--kv-budget-gb --no-fixed-batch --prefill-one-row`: each cache at its own batch, rows with their bound,
    no one-batch table, the JSON written."""
    from safetensors.torch import save_file
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(asdict(model.args)))
    out = tmp_path / "t3.json"
    bench.main(["--checkpoint", str(ckpt), "--contexts", "128", "--caches", "full,specache", "--group", "16", "--residual",
                "32", "--k", "8", "--warmup", "1", "--steps", "2", "--kv-budget-gb", "0.00015", "--max-run-batch", "3",
                "--no-grid", "--no-fixed-batch", "--prefill-one-row", "--bandwidth-mb", "8", "--threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {r["cache"]: r for r in data["budget"]["rows"]}
    assert "fixed" not in data["budget"] and {r["bound"] for r in rows.values()} <= set(table3.BOUNDS)
    assert rows["specache"]["run_batch"] > rows["full"]["run_batch"] >= 1 and "speedup_vs_full" in rows["specache"]
    md = out.with_suffix(".md").read_text()
    assert "## Table 3" in md and "reviewers' Q6" not in md and "| bound |" in md


def test_each_batch_also_as_different_prompts(model):
    """--different-prompts: each cache's batch runs again as different prompts (rotations of the text cut to lengths
    from the context down to half of it, left-padded and prefilled for real), beside the replicated prompt."""
    rows = bench.different_prompts(ids(200), 64, 5)
    assert len({tuple(r) for r in rows}) == 5 and all(32 <= len(r) <= 64 for r in rows) and len(rows[0]) == 64
    a = opts(max_run_batch=3, no_fixed_batch=True, different_prompts=True)
    a.kv_budget_gb = 1.0
    runner = bench.Runner(model, ids(), a, BW)
    out = table3.budget_section(runner, ["full", "specache"], [64], a)
    for r in out["rows"]:
        assert r["run_batch"] == 3 and r["different_prompts"]["tok_s"] > 0
        assert (r["cache"], 64, 3, "different prompts") in runner.rows
