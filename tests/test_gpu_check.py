"""tools/gpu_check.py (make gpu-check) without a GPU: the plan's order and its seconds, the summary's statuses with
the sub-runs faked, the dry run within the budget, the Table 3 row, the per-test alarm, a cut run's output."""
import json
import os
import re
import subprocess
import sys
import threading

from tests.helpers import ROOT
from tools import bench, bench_report, gpu_check

FIRST = ["tests/test_cuda.py::test_selection_race_across_launches_and_graph_replays[64-8-32768-64]",
         "tests/test_cuda.py::test_generate_compile_preset_fresh_process"]
KERNELS = ["tests/test_cuda.py::test_attention_kernel_matches_the_reference[G1-T1-1bit-None]",
           "tests/test_cuda.py::test_gluon_plane_kernel_matches_the_reference[1bit-bf16-fetch]",
           "tests/test_cuda.py::test_fused_selection_matches_the_reference[1-None-dtype2-gluon]",
           "tests/test_cuda.py::test_transfer_from_pinned_host_memory_is_exact[True]",
           "tests/test_cuda.py::test_rerank_from_pinned_host_memory_keeps_the_best_candidates[1]"]
REST = ["tests/test_cuda.py::test_every_row_fetched_equals_the_full_cache_fp32[uva-speculative]",
        "tests/test_cuda.py::test_compiled_step_equals_eager_with_one_graph[full]",
        "tests/test_cuda.py::test_default_model_generate_compile[best]"]
A_TO_C = ["tests-first", "tests-kernels", "tests-rest", "step-full", "step-kivi", "step-specache", "table3"]


def test_gpu_check_without_cuda_says_so_in_one_line():
    r = subprocess.run([sys.executable, "tools/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.count("\n") == 1 and "no CUDA device" in r.stdout, r.stdout + r.stderr


def test_the_race_test_runs_first_then_the_measurements_in_priority_order(tmp_path):
    """The selection race and the fresh-process run first, alone; the kernel tests next (several processes), the
    rest in the background beside them; then, each alone, the 4-layer steps, Table 3 as the paper runs it, the
    8-layer pair, and what fits after. The expected seconds of steps 1-3 fit the budget."""
    ids = REST[:1] + KERNELS[:2] + FIRST[::-1] + KERNELS[2:] + REST[1:]
    tests = {k: [i for i in ids if gpu_check.test_group(i) == k] for k in gpu_check.TEST_STEPS}
    assert tests == {"tests-first": FIRST[::-1], "tests-kernels": KERNELS, "tests-rest": REST}
    steps = gpu_check.plan(sys.executable, tmp_path, tmp_path, tests)
    assert [s.key for s in steps] == ["tests-first", "tests-rest", "tests-kernels", "step-full", "step-kivi", "step-specache",
                                      "table3", "step8", "preset", "full-depth", "full-depth", "words", "words"]
    first, rest, kernels = steps[:3]
    assert not first.background and first.workers == 1 and rest.background and not kernels.background
    assert kernels.workers > 1 and rest.workers > 1
    t3 = steps[6]
    b = bench.parse_args(t3.cmd[2:])
    assert (b.layers, b.contexts, b.kv_budget_gb, b.caches) == (4, [32768], 4, ["full", "specache", "specache-2bit"])
    assert b.no_fixed_batch and b.prefill_one_row and b.no_grid and b.profile_steps == 3 and b.compile
    assert "--max-run-batch" not in t3.cmd  # (on CUDA the run cap is what the device holds, no cap of 8)
    b8 = bench.parse_args(steps[7].cmd[2:])
    assert b8.layers == 8 and b8.caches == ["full", "specache"] and b8.attn_path == "gluon"
    E = gpu_check.EXPECTED_S
    serial = [k for k in A_TO_C if k not in ("tests-kernels", "tests-rest")]  # (those two run side by side)
    chain = sum(E[k] for k in ["environment", "imports", "collect"] + serial) + max(E["tests-kernels"], E["tests-rest"])
    assert chain <= gpu_check.BUDGET_S - gpu_check.RESERVE_S
    assert chain + E["step8"] > gpu_check.BUDGET_S - gpu_check.RESERVE_S  # (the 8-layer pair: when time is left)


def test_gpu_check_reports_failures_budget_cuts_and_skipped_runs(tmp_path, monkeypatch, capsys):
    """The summary's statuses and exit code, with the sub-runs faked (20 s each in the main thread, the background
    tests 50 s of simulated time): the first test group runs before anything else; a failing test fails the check;
    a step the timeout cuts is "cut" and, once too little budget is left, later ones "not run", neither a failure;
    no timed step runs beside the background tests (only the kernel tests do); after every step the summary is packed into at most
    MAX_FILES files."""
    clock, packed, order = [0.0], [], []
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "EXPECTED_S", {k: 50 if k == "tests-rest" else 0 for k in gpu_check.EXPECTED_S})

    def fake_run(cmd, timeout, log, env=None, fail_test=False):
        if threading.current_thread() is threading.main_thread():  # (the main thread packs and keeps the time)
            assert len(list(tmp_path.iterdir())) <= gpu_check.MAX_FILES, list(tmp_path.iterdir())
            if (tmp_path / "summary.json").exists():
                packed.append(len(json.loads((tmp_path / "summary.json").read_text())["steps"]))
            clock[0] += 20.0
        log.write_text("progress\n")
        if "--collect-only" in cmd:
            return 0, "".join(f"{t}\n" for t in KERNELS[:2] + FIRST + REST[:1]), 20.0
        if "--stub" not in cmd:  # the imports, and the one real toy bench run
            if "--json" in cmd:
                out = cmd[cmd.index("--json") + 1]
                open(out, "w").write(json.dumps({"grid": [{"cache": "full", "label": "full", "step_ms_median": 2.0,
                                                           "n_layers": 1}]}))
            return 0, "", 20.0
        spec = json.loads(cmd[cmd.index("--stub") + 1])
        order.append(spec["tests"][0] if spec["xml"] else spec["name"])
        if spec["xml"]:
            bad = '<failure message="AssertionError: off"/>' if fail_test else ""
            cases = "".join(f'<testcase name="{t.split("::")[1]}" time="1.0">{bad if i == 0 else ""}</testcase>'
                            for i, t in enumerate(spec["tests"]))
            with open(spec["xml"], "w") as f:
                f.write(f"<testsuite>{cases}</testsuite>")
            return (1 if fail_test else 0), "", 20.0
        if "--attn-path words" in spec["cmd"] and "--caches specache " in spec["cmd"]:  # cut by its timeout
            return None, "progress\n", 20.0
        gpu_check.stub(spec)
        return 0, "progress\n", 20.0

    monkeypatch.setattr(gpu_check, "run", fake_run)
    # 60 s to the first tests; the kernel tests at 80 s beside the background ones (80-130 s), which end before the
    # first timed step; each step 20 s
    assert gpu_check.main(["--dry-run-cpu", "--out", str(tmp_path), "--budget-s", "300"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["step"]: r for r in summary["steps"]}
    assert order[0] == FIRST[0] and len(order) == len(set(order))  # (the first group alone, before anything else)
    assert [r["step"] for r in summary["steps"]][3] == gpu_check.TEST_STEPS["tests-first"]
    assert {t["check"]: t["status"] for t in summary["tests"]} == {t.split("::")[1]: "pass" for t in KERNELS[:2] + FIRST + REST[:1]}
    assert rows[gpu_check.TEST_STEPS["tests-first"]]["beside"] == ""
    assert rows[gpu_check.TEST_STEPS["tests-kernels"]]["note"].endswith("not reached in 2 processes")
    assert rows[gpu_check.TEST_STEPS["tests-kernels"]]["beside"] == "CUDA tests running"
    timed = [r for r in summary["steps"] if not r["step"].startswith("CUDA tests") and r["status"] != "not run"]
    assert timed and all(r["beside"] == "" for r in timed)  # each timed step alone, after every test
    names = [r["step"] for r in summary["steps"]]
    assert names.index(gpu_check.TEST_STEPS["tests-rest"]) < names.index("fp16 step, fp16, 32k, 4 layers")
    assert "kivi 2.00x the fp16 step" in rows["KIVI 1-bit step, gluon, 32k, 4 layers"]["note"]  # (4 ms of 4 layers vs 2)
    t3 = rows["Table 3: each cache at its batch on a 4 GB KV budget, 32k, 4 layers"]
    assert t3["status"] == "pass" and "specache-1bit batch 1 (host-bound: batch 1 of the budget's 2)" in t3["note"]
    assert "1.00x fp16's (target >= 4.6x)" in t3["note"] and "(target >= 3.4x)" in t3["note"]
    assert "from batch 1: other 1 -> 1 us/step" in t3["note"]  # (the 4-layer SpeCache step's profile)
    # full depth on the line through 4 and 8 layers: fp16 2 + (8 - 2) * 7 (this fake's 4-layer JSON, the stub's
    # 8-layer one), SpeCache 4 + (8 - 4) * 7
    assert rows["fp16 and SpeCache 1-bit paper step, gluon, 32k, 8 layers"]["note"].endswith(
        "specache at 32 layers (a line through 4 and 8): 32.00 ms, 0.73x the fp16 step's 44.00")
    assert rows["preset without resync step, gluon, 32k, 4 layers"]["status"] == "pass"
    assert rows["fp16 step, full depth, 32k"]["status"] == "not run"  # (100 s to start, 80 left)
    assert rows["SpeCache 1-bit paper step, words, 32k, 4 layers"]["status"] == "cut"
    assert packed == sorted(packed) and len(set(packed)) > 8  # packed again after every step
    assert "0 failed" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.txt", "results.json", "summary.json", "summary.md"]
    assert "===== SpeCache 1-bit paper step, words, 32k, 4 layers (cut, 20 s) =====" in (tmp_path / "logs.txt").read_text()

    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: fake_run(*a, **k, fail_test=True))
    clock[0] = 0.0
    assert gpu_check.main(["--dry-run-cpu", "--out", str(tmp_path), "--budget-s", "150"]) == 1
    rows = {r["step"]: r["status"] for r in json.loads((tmp_path / "summary.json").read_text())["steps"]}
    assert rows[gpu_check.TEST_STEPS["tests-first"]] == "FAIL" and rows[gpu_check.TEST_STEPS["tests-kernels"]] == "FAIL"
    # the background tests end at 130 s: 20 s left, enough for the first timed step alone (it needs 8 here)
    assert rows["fp16 step, fp16, 32k, 4 layers"] == "pass"
    assert rows["KIVI 1-bit step, gluon, 32k, 4 layers"] == "not run"  # the budget is spent


def test_gpu_check_dry_run_walks_every_step_within_the_budget(tmp_path, monkeypatch, capsys):
    """`--dry-run-cpu`: the imports, the CUDA tests' collection and one toy bench run are real, the GPU work
    stubbed and its time simulated: one summary row per step, at most MAX_FILES files, and a real call's budget
    runs steps 1-3 (the tests, then alone the 4-layer steps and Table 3) within it and leaves the rest out."""
    collect = gpu_check.collect

    def with_the_first_group(*args):  # (whatever test_cuda.py holds now: the first group is planned with tests)
        ids, text, secs = collect(*args)
        return (ids + [i for i in FIRST if i not in ids] if ids else ids), text, secs
    monkeypatch.setattr(gpu_check, "collect", with_the_first_group)
    assert gpu_check.main(["--dry-run-cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {r["step"]: r for r in summary["steps"]}
    names = list(steps)
    assert names[:4] == ["environment", "imports", "collect the CUDA tests", gpu_check.TEST_STEPS["tests-first"]]
    plan = gpu_check.plan(sys.executable, tmp_path, tmp_path, {})
    assert len(summary["steps"]) == 3 + len(plan)
    key = {s.name: s.key for s in plan}
    for name, r in steps.items():
        if key.get(name) in A_TO_C:
            assert r["status"] == "pass", (name, r)
        elif name in key:  # what fits after: the 8-layer pair does not, the preset's shorter step may
            assert r["status"] in ("not run", "pass") and (r["status"] == "not run" or key[name] != "step8"), (name, r)
    spent = float(re.search(r"in (\d+) s of (\d+)", out).group(1))
    assert spent <= gpu_check.BUDGET_S - gpu_check.RESERVE_S
    assert len(summary["tests"]) > 60 and {t["status"] for t in summary["tests"]} == {"pass"}
    assert len(list(tmp_path.iterdir())) <= gpu_check.MAX_FILES
    md = (tmp_path / "summary.md").read_text()
    assert "| fp16 step, fp16, 32k, 4 layers | pass |" in md and "host-bound: batch 1 of the budget's 2" in md


def test_the_table3_row_says_the_bound_the_ratio_and_what_grew():
    """The summary's Table 3 row: each cache's batch and its bound, tokens/s and the ratio to fp16's beside the
    paper's, the kernel classes that grew most from the batch-1 step and the top kernels."""
    prof = lambda sel, att: {"class_us_per_step": {"selection": sel, "attention": att, "gemm": 800.0},  # noqa: E731
                             "kernels": [{"name": "_select_kernel", "us_per_step": sel}, {"name": "nvjet_x", "us_per_step": 800.0}]}
    budget = {"rows": [
        dict(context=32768, cache="full", label="full", run_batch=7, bound="device budget", tok_s=3940.0),
        dict(context=32768, cache="specache", label="specache-1bit", run_batch=63, bound="host memory", tok_s=15760.0,
             note="host-bound: batch 63 of the budget's 75", profile=prof(4000.0, 1500.0)),
        dict(context=32768, cache="specache-2bit", label="specache-2bit", run_batch=46, bound="run cap",
             note="capped: batch 46 of the budget's 46 (the run cap)", error="out of memory at batch 46: ...")]}
    line = bench_report.table3_headline(budget, {"specache": prof(560.0, 150.0)})
    assert line.startswith("full batch 7 (device budget) 3,940 tok/s; specache-1bit batch 63 (host-bound: batch 63 of "
                           "the budget's 75) 15,760 tok/s, 4.00x fp16's (target >= 4.6x) [from batch 1: selection 560 -> "
                           "4,000, attention 150 -> 1,500, gemm 800 -> 800 us/step; top: _select_kernel 4,000, nvjet_x 800")
    assert line.endswith("; specache-2bit batch 46 (capped: batch 46 of the budget's 46 (the run cap)): out of memory at "
                         "batch 46: ...")


def test_per_test_alarm_fails_a_slow_test_and_goes_on(tmp_path):
    """SPECACHE_TEST_TIMEOUT_S (tests/conftest.py): the slow test fails with TimeoutError, the next one runs."""
    (tmp_path / "test_probe.py").write_text("import time\n\ndef test_slow():\n    time.sleep(30)\n\n"
                                            "def test_fast():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "tests.conftest", "--rootdir",
                        str(tmp_path), str(tmp_path / "test_probe.py")], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "SPECACHE_TEST_TIMEOUT_S": "1"})
    assert "1 failed, 1 passed" in r.stdout and "TimeoutError: over SPECACHE_TEST_TIMEOUT_S=1 s" in r.stdout, r.stdout


def test_gpu_check_run_keeps_the_output_of_a_cut_run(tmp_path):
    """A sub-run the timeout kills leaves what it printed in its log (on the H100 a buffered pytest run
    cut by an outer limit once left nothing)."""
    log = tmp_path / "x.log"
    code, out, secs = gpu_check.run([sys.executable, "-c", "import sys, time; print('first line', flush=True); "
                                     "print('to stderr', file=sys.stderr, flush=True); time.sleep(60)"], 3, log)
    assert code is None and secs < 30 and "first line" in out and "to stderr" in out
    assert log.read_text() == out
    code, out, _ = gpu_check.run([sys.executable, "-c", "raise SystemExit(3)"], 30, log)
    assert code == 3 and out == ""
