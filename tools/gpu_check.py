"""The whole GPU verification in one call of about nine minutes (`make gpu-check`), in priority order.

    python tools/gpu_check.py [--out DIR] [--budget-s 520] [--commit HASH]
    python tools/gpu_check.py --dry-run-cpu --out /tmp/gc     # every step on CPU, GPU work stubbed

0. the device, torch/Triton/CUDA versions, the commit (or a digest of the tree); one line and a stop if
   the method's modules do not import (attn_gluon alone failing fails the Gluon rows only);
1. correctness: tests/test_cuda.py with TRITON_INTERPRET=0 (tests/conftest.py sets 1 otherwise and the module
   skips). First, alone, the selection's race test and the fresh-process compiled run of `--preset best`; then
   the attention kernels (every path), the selection and the transfers, in several pytest processes at once
   (TEST_WORKERS), while the rest (policies, compiled steps, the default model when it is converted) runs in
   the background beside them. Each test under SPECACHE_TEST_TIMEOUT_S (conftest's alarm), each process
   under its step's timeout. Every timed step below starts once all the tests have ended: each runs alone;
2. whole decode steps at 32k on Llama-3.1-8B shapes with the first LAYERS decoder layers (random bf16 weights,
   compiled, CUDA graph, the kernels profiled by name; tools/bench.py --layers): fp16, KIVI 1-bit and SpeCache
   1-bit (paper) on the Gluon attention path (the GPU default where a launch fits it, docs/gpu.md), one process
   each;
3. Table 3 as the paper runs it (tools/table3.py), at LAYERS layers on a KV_BUDGET_GB device budget, one
   process: fp16, SpeCache 1-bit and 2-bit, each at the largest batch its budget holds, bounded by the host
   memory its fp16 store pins and by what the device runs (each row says which bound it), each run profiled by
   kernel name; tokens/s against fp16's at its own batch (the paper's: 4.6x at 1 bit, 3.4x at 2);
4. if time is left, fp16 and SpeCache 1-bit at twice the layers, one process: with step 2's, a line through
   both depths estimates the full-depth step without compiling 32 layers;
5. if time is still left: the preset timed without resync (random weights guess wrong nearly every step: its resync
   rate is measured on a real model on CPU, docs/policies.md), fp16 and SpeCache 1-bit at full depth, then
   SpeCache 1-bit and KIVI 1-bit on the word path (the same run's comparison for the default path's choice).
Each step runs under its own timeout and is skipped ("not run") when less of the budget is left than it needs
(EXPECTED_S: what each takes; the dry run spends it). After every step the summary and the raw outputs are
packed into at most MAX_FILES files in the output folder (default $OUT, else .cache/gpu-check): summary.md,
summary.json, logs.txt (every sub-run's output), results.json (every bench JSON), and while a step runs its
live log (running.log, running-bg.log; of a test step, its first pytest process's), so a call cut at any
point keeps what it did. The summary's "beside" column says of each step whether the background tests ran
while it did (only the kernel tests' step may say so).

Needs only the machine's Python with torch and Triton: no network, no installs, no virtual environment.
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (run as a script: tools/ comes first)
from tools.bench_report import table3_headline  # noqa: E402 - no torch: this script says so in one line without it

BUDGET_S = 520  # one call of about nine minutes: 10 minutes a call, 15 of device time with the machine's start
MAX_FILES = 8  # what comes back from the device machine's $OUT
PER_TEST_TIMEOUT_S = 90
RESERVE_S = 8  # kept back for the last packing
MODEL, CONTEXT, LAYERS = "Llama-3.1-8B", 32768, 4
MODEL_LAYERS = 32  # Llama-3.1-8B's depth (model.py's configs): what the full-depth estimate extends to
KV_BUDGET_GB = 4  # the paper's A6000: 48 GB less 16 of weights, 32 GB of KV at 32 layers, 4 at LAYERS
STEP_CACHES = [("fp16", "full", None), ("KIVI 1-bit", "kivi", "gluon"), ("SpeCache 1-bit paper", "specache", "gluon")]
DEPTH_CACHES = ("full", "specache")  # also at twice the layers
TABLE3_CACHES = ("full", "specache", "specache-2bit")
PRESET = ("preset without resync", "specache-1bit-speculative-best", "gluon")  # when time is left
WORD_PATH = [("SpeCache 1-bit paper", "specache"), ("KIVI 1-bit", "kivi")]  # last: the default path's comparison
TEST_WORKERS = {"tests-kernels": 5, "tests-rest": 2}  # pytest processes at once (the tests are mostly compiles)
# Seconds each step takes on an H100/H200 (the dry run spends these). Measured on an H200 (2026-11-28, docs/gpu.md):
# the imports 9 s, the collection 8; the 4-layer steps 33 (fp16), 38 (KIVI) and 50 s (SpeCache), each beside a
# test process; the preset's 56; the word path's 37 each; the test processes 103 + 72 s (attention, selection,
# transfers: 191 s of tests once the 14 that failed at once pass; five processes take the slowest fifth, 41 s, and
# their start) and 145 s (the rest: two take 73 s and their start). Estimated: the race and fresh-process tests 90 s;
# Table 3's process 125 (start and report 15; fp16 at batch 7 compiled in 11 s there; SpeCache 1-bit at batch 75:
# 64 GiB pinned, one row's prefill stored into 75 rows, its compile 21 s at batch 8 there; 2-bit at batch 46
# alike); the 8-layer process 90 and a full-depth step 120 (2026-11-22's 32-layer steps took 88-99 s to their first
# step, nearly all compile).
EXPECTED_S = {"environment": 1, "imports": 10, "collect": 8, "tests-first": 90, "tests-kernels": 60, "tests-rest": 100,
              "step-full": 33, "step-kivi": 38, "step-specache": 50, "table3": 125, "step8": 90, "preset": 56,
              "full-depth": 120, "words": 37}


# ---- sub-runs --------------------------------------------------------------------------------------------------
def run(cmd, timeout, log: Path, env=None):
    """Run cmd with its stdout and stderr written to `log` as they come, so a run that is cut (by the
    timeout here, or by a limit around this script) leaves what it had done. Returns (exit code or
    None if timed out, output, seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        try:
            code = p.wait(timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            code = None
    return code, log.read_text(errors="replace"), time.perf_counter() - t0


def pytest_rows(xml_path: Path) -> list[dict]:
    """One row per test of a JUnit XML; a test stopped by the per-test alarm is "cut", not FAIL."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        status, note = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "FAIL", "error": "FAIL", "skipped": "skip"}[tag]
                note = (el.get("message") or "").strip().splitlines()[0][:120] if el.get("message") else ""
                if status == "FAIL" and "SPECACHE_TEST_TIMEOUT_S" in note:
                    status = "cut"
        rows.append(dict(check=case.get("name"), status=status, seconds=float(case.get("time", 0)), note=note))
    return rows


def test_group(nodeid: str) -> str:
    """Which test run a CUDA test belongs to: the race and fresh-process tests first and alone, then the kernels
    (attention on every path, the selection, the transfers), then the rest."""
    name = nodeid.split("::")[-1]
    if "selection_race" in name or "fresh_process" in name:
        return "tests-first"
    if any(k in name for k in ("attention_kernel", "gluon", "planes", "selection", "transfer", "rerank")):
        return "tests-kernels"
    return "tests-rest"


TEST_STEPS = {"tests-first": "CUDA tests: the selection race, the fresh-process compiled run",
              "tests-rest": "CUDA tests: policies, compiled steps, default model",
              "tests-kernels": "CUDA tests: attention kernels, the selection, the transfers"}


# ---- the plan ---------------------------------------------------------------------------------------------------
@dataclass
class Step:
    key: str  # EXPECTED_S's key
    name: str
    cmd: list
    need_s: float  # not started with less budget left
    timeout_s: float
    json: Optional[Path] = None  # what a bench run writes
    background: bool = False
    tests: list = field(default_factory=list)
    workers: int = 1  # pytest processes at once


def bench_cmd(py, *args):
    return [py, "tools/bench.py", "--model", MODEL, "--random-weights", "--dtype", "bfloat16", *args]


def plan(py, work: Path, out: Path, tests: dict) -> list[Step]:
    """The steps in priority order (each bench run one process, but Table 3's and the 8-layer pair's: a slow
    compile costs one row). The background tests start beside the kernel tests and end before the first timed step."""
    steps = [Step(k, TEST_STEPS[k], [], need_s=30, timeout_s={"tests-rest": 240, "tests-kernels": 150}.get(k, 180),
                  background=k == "tests-rest", tests=tests.get(k, []), workers=TEST_WORKERS.get(k, 1))
             for k in TEST_STEPS]
    timed, ctx = ["--warmup", "5", "--steps", "20"], ["--contexts", str(CONTEXT)]

    def layer_step(key, label, caches, path, layers=LAYERS, *extra, need_s=None, timeout_s=150):
        fname = work / f"{key}-{caches.replace(',', '-')}-{path or 'fp'}-{layers}l.json"
        return Step(key, f"{label} step, {path or 'fp16'}, {CONTEXT // 1024}k, {layers} layers",
                    bench_cmd(py, "--layers", str(layers), "--compile", *ctx, "--caches", caches,
                              *(["--attn-path", path] if path else []), *timed, *extra, "--json", str(fname)),
                    need_s=need_s or EXPECTED_S[key] + RESERVE_S, timeout_s=timeout_s, json=fname)
    steps += [layer_step(f"step-{cache}", label, cache, path) for label, cache, path in STEP_CACHES]
    steps.append(Step("table3", f"Table 3: each cache at its batch on a {KV_BUDGET_GB} GB KV budget, {CONTEXT // 1024}k, "
                      f"{LAYERS} layers",
                      bench_cmd(py, "--layers", str(LAYERS), "--compile", *ctx, "--caches", ",".join(TABLE3_CACHES),
                                "--attn-path", "gluon", "--kv-budget-gb", str(KV_BUDGET_GB), "--no-grid", "--no-fixed-batch",
                                "--prefill-one-row", "--warmup", "3", "--steps", "10", "--profile-steps", "3",
                                "--json", str(work / "table3.json")),
                      need_s=90, timeout_s=240, json=work / "table3.json"))
    steps.append(layer_step("step8", "fp16 and SpeCache 1-bit paper", ",".join(DEPTH_CACHES), "gluon", 2 * LAYERS,
                            "--profile-steps", "0", need_s=EXPECTED_S["step8"], timeout_s=180))
    steps.append(layer_step("preset", *PRESET))
    for label, cache, path in (("fp16", "full", None), ("SpeCache 1-bit paper", "specache", "gluon")):
        fname = work / f"full-depth-{cache}.json"
        steps.append(Step("full-depth", f"{label} step, full depth, {CONTEXT // 1024}k",
                          bench_cmd(py, "--compile", *ctx, "--caches", cache, *(["--attn-path", path] if path else []),
                                    *timed, "--json", str(fname)),
                          need_s=100, timeout_s=240, json=fname))
    steps += [layer_step("words", label, cache, "words") for label, cache in WORD_PATH]
    return steps


# ---- what a row says ---------------------------------------------------------------------------------------------
def step_note(res: dict, batch1: Optional[dict] = None) -> str:
    """The headline of a bench JSON: each grid row's step time, ms per layer and path; Table 3's rows
    (bench_report.table3_headline: batches, bounds, tokens/s against fp16's, where the time went)."""
    if res.get("budget"):
        return table3_headline(res["budget"], batch1 or {})
    parts = []
    for r in res.get("grid", []):
        per_layer = r.get("step_ms_per_layer", r["step_ms_median"] / max(1, r.get("n_layers") or 1))
        parts.append(f"{r['label']} {r['step_ms_median']:.2f} ms ({per_layer:.3f} ms/layer"
                     f"{', ' + r['attn_path'] if r.get('attn_path') else ''})")
    return "; ".join(parts)


def depth_note(grid: list, layers: int, path: Optional[str], ms: dict) -> str:
    """Each grid row against the fp16 step at its depth and, at twice LAYERS, full depth on the line through
    both depths (`ms`: (cache, layers, path) -> step ms of the steps so far, this one's added)."""
    key = lambda c, n: (c, n, None if c == "full" else path)  # noqa: E731
    for r in grid:
        ms[key(r["cache"], layers)] = r["step_ms_median"]
    note = ""
    for r in grid:
        c = r["cache"]
        if c != "full" and key("full", layers) in ms:
            note += f"; {c} {ms[key(c, layers)] / ms[key('full', layers)]:.2f}x the fp16 step"
    if layers == 2 * LAYERS:
        est = {c: ms[key(c, LAYERS)] + (ms[key(c, layers)] - ms[key(c, LAYERS)]) * (MODEL_LAYERS - LAYERS) / LAYERS
               for c in {r["cache"] for r in grid} if key(c, LAYERS) in ms}
        for c in sorted(est, key=lambda c: c != "full"):
            note += f"; {c} at {MODEL_LAYERS} layers (a line through {LAYERS} and {layers}): {est[c]:.2f} ms"
            if c != "full" and "full" in est:
                note += f", {est[c] / est['full']:.2f}x the fp16 step's {est['full']:.2f}"
    return note


class Report:
    """Rows, raw outputs and results, packed into at most MAX_FILES files after every step."""

    def __init__(self, out: Path, env: dict):
        self.out, self.env, self.rows, self.tests, self.logs, self.results = out, env, [], [], [], {}
        self.lock = threading.Lock()

    def add(self, name, status, seconds, note="", beside="", log="", result=None, tests=()):
        with self.lock:
            self.rows.append(dict(step=name, status=status, seconds=round(seconds, 1), beside=beside, note=note))
            self.tests += list(tests)
            if log:
                self.logs.append(f"===== {name} ({status}, {seconds:.0f} s) =====\n{log.rstrip()}\n")
            if result is not None:
                self.results[name] = result
            self.pack()

    def table(self) -> str:
        lines = ["| step | result | seconds | beside | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['status']} | {r['seconds']:.1f} | {r['beside'] or '-'} | {r['note']} |" for r in self.rows]
        return "\n".join(lines)

    def pack(self):
        """summary.md, summary.json, logs.txt, results.json (sweep.json and the live logs are written by the runs)."""
        bad = [t for t in self.tests if t["status"] in ("FAIL", "cut")]
        md = [f"# gpu-check on {self.env['device']}, {self.env['date']}", "",
              " ".join(f"{k} {v};" for k, v in self.env.items() if k not in ("device", "date")), "", self.table(), ""]
        if bad:
            md += ["## Tests that failed or were cut", ""] + [f"- {t['status']} {t['check']}: {t['note']}" for t in bad] + [""]
        for name, res in self.results.items():
            if isinstance(res, dict) and res.get("md"):
                md += [f"## {name}", "", res["md"], ""]
        (self.out / "summary.md").write_text("\n".join(md) + "\n")
        (self.out / "summary.json").write_text(json.dumps(dict(environment=self.env, steps=self.rows, tests=self.tests),
                                                          indent=1))
        (self.out / "logs.txt").write_text("\n".join(self.logs))
        (self.out / "results.json").write_text(json.dumps({k: {x: y for x, y in v.items() if x != "md"}
                                                           for k, v in self.results.items()}, indent=1, default=str))
        files = sorted(p.name for p in self.out.iterdir())
        if len(files) > MAX_FILES and not getattr(self, "warned", False):
            self.warned = True
            print(f"gpu-check: {len(files)} files in {self.out} (at most {MAX_FILES} come back): {', '.join(files)}")


# ---- the environment -------------------------------------------------------------------------------------------------
def tree_digest() -> str:
    """sha256 (12 hex) of the method's and the tools' sources: names the code where no .git came along."""
    h = hashlib.sha256()
    for p in sorted(p for d in ("", "gpu", "siblings", "baselines", "integrations", "tools", "tests")
                    for p in (ROOT / d).glob("*.py")):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def environment(torch, dry: bool, commit: Optional[str]) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "not importable"
    if dry:
        env["device"] = f"CPU dry run ({platform.processor() or platform.machine()}): GPU work stubbed, times simulated"
    else:
        p = torch.cuda.get_device_properties(0)
        env["device"] = f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    if commit is None:
        try:
            r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
            commit = r.stdout.strip() if r.returncode == 0 else None
            if commit:
                dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                       capture_output=True, text=True, timeout=10).stdout.strip()
                commit += " (modified)" if dirty else ""
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    env["commit"] = commit or "unknown (no .git: see tree)"
    env["tree"] = tree_digest()
    return env


# ---- the dry run's stand-ins -------------------------------------------------------------------------------------------
# A stubbed sub-run is this script's `--stub` mode in a subprocess: it writes what the real run would (JUnit XML
# with every selected test, a bench JSON with toy numbers and the fields a real one has) and prints the command.
def stub_cmd(step: Step, xml: Optional[Path], tests: Optional[list] = None) -> list:
    spec = dict(name=step.name, tests=step.tests if tests is None else tests, xml=str(xml) if xml else None,
                json=str(step.json) if step.json else None)
    if step.cmd:  # the real command must parse (tools/bench.py's parser, here in this process)
        sys.path.insert(0, str(ROOT)) if str(ROOT) not in sys.path else None
        from tools import bench
        b = bench.parse_args(step.cmd[2:])
        spec.update(cmd=" ".join(step.cmd[1:]), budget=bool(b.kv_budget_gb), caches=b.caches,
                    labels=[bench.label(c, b) for c in b.caches], layers=b.layers or MODEL_LAYERS, attn_path=b.attn_path,
                    fixed_batch=not b.no_fixed_batch, one_row=b.prefill_one_row,
                    profile=b.profile_steps if "--profile-steps" in step.cmd else 3)  # (3: the CUDA default)
    return [sys.executable, str(Path(__file__).resolve()), "--stub", json.dumps(spec)]


def stub(spec: dict) -> int:
    print("dry run, stubbed:", spec.get("cmd") or f"pytest, {len(spec['tests'])} tests", flush=True)
    if spec["xml"]:
        cases = "".join(f'<testcase name="{t.split("::")[-1]}" time="0.0"/>' for t in spec["tests"])
        Path(spec["xml"]).write_text(f"<testsuite>{cases}</testsuite>")
    if spec["json"]:
        toy = lambda c, b: dict(kernels=[dict(name=f"{c}_kernel", cls="other", us_per_step=float(b), calls_per_step=1.0)],  # noqa: E731
                                class_us_per_step={"other": float(b)}) if spec["profile"] else None
        if spec["budget"]:  # a host-bound low-bit row, as the real one says it
            rows = []
            for c, lb in zip(spec["caches"], spec["labels"]):
                host = c != "full"
                rows.append(dict(context=CONTEXT, cache=c, label=lb, max_batch=2, host_batch=1 if host else None,
                                 run_cap=None, run_batch=1 if host else 2, bound="host memory" if host else "device budget",
                                 capped=False, tok_s=2.0, step_ms=1.0, **({"note": "host-bound: batch 1 of the budget's 2"}
                                                                           if host else {})))
                if toy(c, 2):
                    rows[-1]["profile"] = toy(c, rows[-1]["run_batch"])
            res = dict(budget=dict(budget_gb=KV_BUDGET_GB, rows=rows), grid=[])
            if spec["fixed_batch"]:
                res["budget"]["fixed"] = [dict(context=CONTEXT, batch=1, cache=c, label=lb) for c, lb in
                                          zip(spec["caches"], spec["labels"])]
        else:
            res = dict(grid=[dict(cache=c, label=lb, step_ms_median=float(spec["layers"]), n_layers=spec["layers"],
                                  step_ms_per_layer=1.0, batch=1, attn_path=None if c == "full" else spec["attn_path"] or "words",
                                  **({"profile": toy(c, 1)} if toy(c, 1) else {}))
                             for c, lb in zip(spec["caches"], spec["labels"])])
        Path(spec["json"]).write_text(json.dumps(res))
        Path(spec["json"]).with_suffix(".md").write_text(f"(dry run: {spec['name']})\n")
    return 0


# ---- the run -------------------------------------------------------------------------------------------------------
class Clock:
    """Seconds since the start; the dry run adds each step's expected H100/H200 seconds (EXPECTED_S) to show
    what a real call would run and skip."""

    def __init__(self, simulate: bool):
        self.t0, self.simulate, self.extra = time.perf_counter(), simulate, 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 + self.extra

    def spend(self, key: str, real_s: float):
        if self.simulate:
            self.extra += max(0.0, EXPECTED_S[key] - real_s)


def collect(py, env, work: Path) -> tuple[Optional[list], str, float]:
    """The CUDA tests' node ids (pytest --collect-only) or None, the output, the seconds."""
    code, out, secs = run([py, "-m", "pytest", "-o", "addopts=", "-m", "cuda", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "tests/test_cuda.py"], 180, work / "collect.log", env)
    ids = [line.strip() for line in out.splitlines() if "::" in line and line.startswith("tests/")]
    return (ids if code == 0 else None), out, secs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="the output folder (default $OUT, else .cache/gpu-check)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the call's seconds: no step starts that the rest "
                   "cannot hold (docs/gpu.md: what each step takes)")
    p.add_argument("--commit", default=None, help="the commit to record (default git's, where .git came along)")
    p.add_argument("--skip-speed", action="store_true", help="the CUDA tests alone (step 1)")
    p.add_argument("--dry-run-cpu", action="store_true", help="walk every step on CPU: imports and test collection "
                   "real, GPU work stubbed, time simulated with EXPECTED_S; its numbers mean nothing")
    p.add_argument("--stub", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.stub:
        return stub(json.loads(a.stub))
    try:
        import torch
    except ImportError:
        print(f"gpu-check: torch is not importable by {sys.executable}: nothing to check (point GPU_PY at a Python "
              "with CUDA torch and Triton)")
        return 0
    if not torch.cuda.is_available() and not a.dry_run_cpu:
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False): "
              "nothing to check")
        return 0
    out = a.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / ".cache" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    for old in ("summary.md", "summary.json", "logs.txt", "results.json", "sweep.json", "running.log", "running-bg.log"):
        (out / old).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    clock = Clock(a.dry_run_cpu)
    left = lambda: a.budget_s - clock.elapsed()  # noqa: E731
    py = sys.executable
    env = dict(os.environ, TRITON_INTERPRET="0", TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".cache" / "inductor"),
               SPECACHE_TEST_TIMEOUT_S=str(PER_TEST_TIMEOUT_S))
    if a.dry_run_cpu:
        env.update(TRITON_INTERPRET="1", SPECACHE_CHECK_DEVICE="cpu", OMP_NUM_THREADS="1")
    t = time.perf_counter()
    report = Report(out, environment(torch, a.dry_run_cpu, a.commit))
    print(f"# gpu-check on {report.env['device']}: torch {report.env['torch']}, Triton {report.env['triton']}, "
          f"commit {report.env['commit']}, tree {report.env['tree']}; budget {a.budget_s:.0f} s", flush=True)
    clock.spend("environment", time.perf_counter() - t)
    report.add("environment", "pass", time.perf_counter() - t, f"Python {report.env['python']}, CUDA {report.env['cuda']}")

    # the method's modules: nothing else is worth running if they do not import
    code, text, secs = run([py, "-c", "import kernels, cache, prefetch, generate, gpu.attention, gpu.topk, gpu.transfer"], 120,
                           work / "imports.log", env)
    clock.spend("imports", secs)
    if code != 0:
        last = (text.strip().splitlines() or ["(no output)"])[-1][:200]
        report.add("imports", "FAIL", secs, last, log=text)
        print(f"gpu-check: the method's modules do not import: {last}")
        return 1
    code, text, secs2 = run([py, "-c", "import gpu.attn_gluon"], 60, work / "gluon.log", env)
    gluon_note = "" if code == 0 else f"gpu.attn_gluon does not import (the Gluon rows fail): {text.strip().splitlines()[-1][:160]}"
    report.add("imports", "pass" if code == 0 else "FAIL", secs + secs2, gluon_note or "kernels, cache, prefetch, "
               "generate, gpu.attention, gpu.topk, gpu.transfer, gpu.attn_gluon", log=text if code else "")

    ids, text, secs = collect(py, env, work)
    clock.spend("collect", secs)
    if ids is None:
        report.add("collect the CUDA tests", "FAIL", secs, (text.strip().splitlines() or [""])[-1][:160], log=text)
        tests = {}
    else:
        tests = {k: [i for i in ids if test_group(i) == k] for k in TEST_STEPS}
        report.add("collect the CUDA tests", "pass", secs, ", ".join(f"{TEST_STEPS[k].split(': ')[1]} {len(v)}"
                                                                     for k, v in tests.items()))

    # the background step (thread, step, started, its result once done), the steps' times and profiles so far
    state = {"ms": {}, "batch1": {}}

    def run_tests(step: Step, live: Path, timeout: float):
        """The step's tests in step.workers pytest processes at once, round-robin shares; the first one's
        output is the live log. Returns (exit code: None if any timed out, output, seconds, test rows)."""
        n = max(1, min(step.workers, len(step.tests)))
        shares, results = [step.tests[i::n] for i in range(n)], [None] * n

        def one(i):
            xml, log = work / f"{step.key}-{i}.xml", live if i == 0 else work / f"{step.key}-{i}.log"
            # (-o addopts=: pytest.ini's -q would cancel -v, which names each test in the log as it ends)
            cmd = stub_cmd(step, xml, shares[i]) if a.dry_run_cpu else [
                py, "-m", "pytest", "-o", "addopts=", "-m", "cuda", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}",
                *shares[i]]
            try:
                code, text, secs = run(cmd, timeout, log, env)
                results[i] = (code, text, secs, pytest_rows(xml) if xml.exists() else [])
            except Exception as e:  # (a worker thread's error is the step's, not an unseen traceback)
                results[i] = (1, f"error: {type(e).__name__}: {e}", 0.0, [])
        others = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(1, n)]
        for th in others:
            th.start()
        one(0)
        for th in others:
            th.join()
        codes = [r[0] for r in results]
        code = None if None in codes else next((c for c in codes if c not in (0, 5)), 0)
        text = "\n".join(r[1] if n == 1 else f"----- pytest process {i + 1} of {n} -----\n{r[1]}" for i, r in enumerate(results))
        return code, text, max(r[2] for r in results), None, [row for r in results for row in r[3]]

    def execute(step: Step, live: Path):
        timeout = min(step.timeout_s, max(1.0, left() - RESERVE_S))
        if step.tests:
            return run_tests(step, live, timeout)
        if a.dry_run_cpu and not (step.key == "step-full" and not state.get("toy_done")):
            cmd = stub_cmd(step, None)
        elif a.dry_run_cpu:  # one bench run for real at toy size: the plumbing end to end
            state["toy_done"] = True
            cmd = [py, "tools/bench.py", "--model", "SmolLM2-135M", "--random-weights", "--layers", "1", "--contexts", "64",
                   "--caches", "full", "--warmup", "1", "--steps", "1", "--device", "cpu", "--bandwidth-mb", "8",
                   "--json", str(step.json)]
        else:
            cmd = step.cmd
        code, text, secs = run(cmd, timeout, live, env)
        result = None
        if step.json and step.json.exists():
            try:
                result = json.loads(step.json.read_text())
            except json.JSONDecodeError:  # (a run cut while writing it)
                result = None
            md = step.json.with_suffix(".md")
            if result is not None and md.exists() and md != step.json:
                result["md"] = md.read_text().strip()
        return code, text, secs, result, []

    def record(step: Step, code, text, secs, result, test_rows, beside=""):
        """One summary row (each whole step also against the fp16 step at the same depth)."""
        if step.tests:
            counts = {s: sum(r["status"] == s for r in test_rows) for s in ("pass", "FAIL", "skip", "cut")}
            status = "FAIL" if counts["FAIL"] or code not in (0, 5, None) else "cut" if code is None or counts["cut"] else "pass"
            failed = [r["check"] for r in test_rows if r["status"] in ("FAIL", "cut")]
            procs = f" in {min(step.workers, len(step.tests))} processes" if step.workers > 1 else ""
            note = (f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, {counts['cut']} over "
                    f"{PER_TEST_TIMEOUT_S} s, {len(step.tests) - len(test_rows)} not reached{procs}"
                    + (f"; {', '.join(failed[:3])}" if failed else "") + ("; timed out" if code is None else ""))
            report.add(step.name, status, secs, note, beside, text, tests=test_rows)
            return
        ok = code == 0 and result is not None
        status = "pass" if ok else "cut" if code is None else "FAIL"
        note = step_note(result, state["batch1"]) if result else ""
        grid = (result or {}).get("grid") or []
        if grid and not result.get("budget"):
            layers = int(step.cmd[step.cmd.index("--layers") + 1]) if "--layers" in step.cmd else MODEL_LAYERS
            path = step.cmd[step.cmd.index("--attn-path") + 1] if "--attn-path" in step.cmd else None
            note += depth_note(grid, layers, path, state["ms"])
            if step.key.startswith("step-"):  # step 2's profiles at batch 1: what Table 3's grow from
                state["batch1"].update({r["cache"]: r["profile"] for r in grid if r.get("profile")})
        if not ok:
            last = (text.strip().splitlines() or [""])[-1][:160]
            note = (note + "; " if note else "") + ("timed out" if code is None else last)
        report.add(step.name, status, secs, note, beside, text, result)

    def background_busy() -> bool:
        """The background tests still run (the dry run: for their simulated time)."""
        bg = state.get("thread")
        return bg is not None and (bg.is_alive() or a.dry_run_cpu and clock.elapsed() < state["started"]
                                   + EXPECTED_S[state["step"].key])

    def join_background():
        if "thread" not in state:
            return
        state["thread"].join()
        step, started = state.pop("step"), state.pop("started")
        state.pop("thread")
        clock.spend(step.key, clock.elapsed() - started)
        record(step, *state.pop("result"))
        (out / "running-bg.log").unlink(missing_ok=True)

    for step in plan(py, work, out, tests):
        if a.skip_speed and not step.key.startswith("tests"):
            continue
        if step.tests == [] and step.key.startswith("tests"):
            report.add(step.name, "skip", 0.0, "no tests selected")
            continue
        if not step.key.startswith("tests"):  # a timed step runs alone: the background tests end first
            join_background()
        if left() < step.need_s:
            report.add(step.name, "not run", 0.0, f"needs {step.need_s:.0f} s to start (~{EXPECTED_S[step.key]} s on an "
                       f"H100/H200), {max(0, left()):.0f} s left")
            continue
        if step.background:
            def work_bg(s=step):
                state["result"] = execute(s, out / "running-bg.log")
            state.update(step=step, started=clock.elapsed(), thread=threading.Thread(target=work_bg, daemon=True))
            state["thread"].start()
            continue
        print(f"# {step.name} ({left():.0f} s left)", flush=True)
        busy = background_busy()
        code, text, secs, result, test_rows = execute(step, out / "running.log")
        clock.spend(step.key, secs)
        beside = "CUDA tests running" if busy or background_busy() else ""
        record(step, code, text, secs, result, test_rows, beside)
        (out / "running.log").unlink(missing_ok=True)
        if state.get("thread") is not None and not background_busy():  # its rows into the summary now
            join_background()
    join_background()
    shutil.rmtree(work, ignore_errors=True)

    counts = {s: sum(r["status"] == s for r in report.rows) for s in ("pass", "FAIL", "skip", "not run", "cut")}
    print("\n" + report.table())
    print(f"\n# {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, "
          f"{counts['not run'] + counts['cut']} not run or cut by the budget in {clock.elapsed():.0f} s of "
          f"{a.budget_s:.0f} on {report.env['device']}; files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
