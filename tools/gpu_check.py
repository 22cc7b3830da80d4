"""The whole GPU verification in one call of about nine minutes (`make gpu-check`), in priority order.

    python tools/gpu_check.py [--out DIR] [--budget-s 520] [--commit HASH]
    python tools/gpu_check.py --dry-run-cpu --out /tmp/gc     # every step on CPU, GPU work stubbed

0. the device, torch/Triton/CUDA versions, the commit (or a digest of the tree); one line and a stop if
   the method's modules do not import (attn_gluon alone failing fails the Gluon rows only);
1. correctness: tests/test_cuda.py with TRITON_INTERPRET=0 (tests/conftest.py sets 1 otherwise and the
   module skips) in three pytest processes: the Gluon and bit-plane cases, then the word kernels, radix
   top-k and missing-rows transfer, then the rest (policies, compiled steps, the default model when it
   is converted), each test under SPECACHE_TEST_TIMEOUT_S (conftest's alarm) and each process under
   its own timeout. The third runs in the background, beside step 2's compiles;
2. whole decode steps at 32k on Llama-3.1-8B shapes with the first --layers decoder layers (random
   bf16 weights, compiled, CUDA graph, the kernels profiled by name; tools/bench.py --layers): fp16, KIVI
   1-bit and SpeCache 1-bit (paper) on the Gluon attention path (the GPU default where a launch fits it,
   docs/gpu.md), one process each;
3. fp16 and SpeCache 1-bit at twice the layers: with the first steps, a line through both depths estimates the
   full-depth step without compiling 32 layers;
4. Table 3 (batch on a KV budget, 32k, --layers): fp16 and SpeCache 1-bit, runs capped at batch 8; then the
   preset timed without resync (random weights guess wrong nearly every step: its resync rate is measured on
   a real model on CPU, docs/policies.md);
5. if time is left: fp16 and SpeCache 1-bit at full depth, then SpeCache 1-bit and KIVI 1-bit on the word
   path (the same run's comparison for the default path's choice).
Each step runs under its own timeout and is skipped ("not run") when less of the budget is left than
it needs. After every step the summary and the raw outputs are packed into at most MAX_FILES files in
the output folder (default $OUT, else .cache/gpu-check): summary.md, summary.json, logs.txt (every
sub-run's output), results.json (every bench JSON), sweep.json, and while a step runs its live log
(running.log, running-bg.log), so a call cut at any point keeps what it did. A timing taken while the
background tests ran is marked in the summary's "beside" column.

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
BUDGET_S = 520  # one call of about nine minutes: 10 minutes a call, 15 of device time with the machine's start
MAX_FILES = 8  # what comes back from the device machine's $OUT
PER_TEST_TIMEOUT_S = 90
RESERVE_S = 8  # kept back for the last packing
MODEL, CONTEXT, LAYERS = "Llama-3.1-8B", 32768, 4
MODEL_LAYERS = 32  # Llama-3.1-8B's depth (model.py's configs): what the full-depth estimate extends to
STEP_CACHES = [("fp16", "full", None), ("KIVI 1-bit", "kivi", "gluon"), ("SpeCache 1-bit paper", "specache", "gluon")]
DEPTH_CACHES = ("full", "specache")  # also at twice the layers
PRESET = ("preset without resync", "specache-1bit-speculative-best", "gluon")  # after Table 3
WORD_PATH = [("SpeCache 1-bit paper", "specache"), ("KIVI 1-bit", "kivi")]  # last: the default path's comparison
# Seconds each step is expected to take on an H100/H200 (docs/gpu.md: gpu-check on an H200, 2026-11-28: the three
# test processes 103, 72 and 145 s, 4-layer steps 33-50 s, the preset's 56 s, Table 3 of fp16 and SpeCache to
# batch 8 102 s; on an H100, 2026-11-26: the sweep 46 of 54 rows in 44 s; earlier: a full-depth 8B step at 32k
# 210-240 s to its first step, nearly all compile). The dry run spends these.
EXPECTED_S = {"environment": 5, "imports": 10, "collect": 10, "tests-planes": 100, "tests-kernels": 75, "tests-rest": 150,
              "step": 35, "step-preset": 60, "step8": 45, "sweep": 55, "table3": 105,
              "full-depth": 240}


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
    """Which of the three test runs a CUDA test belongs to (the newest code first)."""
    name = nodeid.split("::")[-1]
    if "gluon" in name or "planes" in name:
        return "tests-planes"
    if any(k in name for k in ("attention_kernel", "selection", "transfer", "rerank")):
        return "tests-kernels"
    return "tests-rest"


TEST_STEPS = {"tests-planes": "CUDA tests: Gluon and bit-plane paths",
              "tests-kernels": "CUDA tests: word kernels, the fused selection, the transfers",
              "tests-rest": "CUDA tests: policies, compiled steps, default model"}


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


def bench_cmd(py, *args):
    return [py, "tools/bench.py", "--model", MODEL, "--random-weights", "--dtype", "bfloat16", *args]


def plan(py, work: Path, out: Path, tests: dict) -> list[Step]:
    """The steps in priority order (each bench run one process: a slow compile costs one row)."""
    steps = [Step(k, TEST_STEPS[k], [], need_s=30, timeout_s={"tests-rest": 300}.get(k, 180),
                  background=k == "tests-rest", tests=tests.get(k, [])) for k in TEST_STEPS]
    timed = ["--warmup", "5", "--steps", "20"]

    def layer_step(label, cache, path, layers=LAYERS):
        fname = work / f"step-{cache}-{path or 'fp'}{'' if layers == LAYERS else f'-{layers}l'}.json"
        return Step("step-preset" if cache.endswith("best") else "step" if layers == LAYERS else "step8",
                    f"{label} step, {path or 'fp16'}, {CONTEXT // 1024}k, {layers} layers",
                    bench_cmd(py, "--layers", str(layers), "--compile", "--contexts", str(CONTEXT), "--caches", cache,
                              *(["--attn-path", path] if path else []), *timed, "--json", str(fname)),
                    need_s=30 if layers == LAYERS else 45, timeout_s=150, json=fname)
    steps += [layer_step(label, cache, path) for label, cache, path in STEP_CACHES]
    # the same at twice the layers: a line through the two depths estimates full depth without its compile
    steps += [layer_step(label, cache, path, 2 * LAYERS) for label, cache, path in STEP_CACHES if cache in DEPTH_CACHES]
    steps.append(Step("table3", f"Table 3: batch on a 4 GB KV budget, {CONTEXT // 1024}k, {LAYERS} layers",
                      bench_cmd(py, "--layers", str(LAYERS), "--compile", "--contexts", str(CONTEXT), "--caches",
                                "full,specache", "--attn-path", "gluon", "--kv-budget-gb", "4", "--max-run-batch",
                                "8", "--no-grid", "--warmup", "3", "--steps", "10", "--profile-steps", "0", "--json",
                                str(work / "table3.json")),
                      need_s=110, timeout_s=200, json=work / "table3.json"))
    steps.append(layer_step(*PRESET))
    for label, cache, path in (("fp16", "full", None), ("SpeCache 1-bit paper", "specache", "gluon")):
        fname = work / f"full-depth-{cache}.json"
        steps.append(Step("full-depth", f"{label} step, full depth, {CONTEXT // 1024}k",
                          bench_cmd(py, "--compile", "--contexts", str(CONTEXT), "--caches", cache,
                                    *(["--attn-path", path] if path else []), *timed, "--json", str(fname)),
                          need_s=200, timeout_s=330, json=fname))
    steps += [layer_step(label, cache, "words") for label, cache in WORD_PATH]
    return steps


# ---- what a row says ---------------------------------------------------------------------------------------------
def step_note(res: dict) -> str:
    """The headline of a bench JSON: each grid row's step time, ms per layer and path; the sweep's row count."""
    if "sweep" in res:
        ok = [r for r in res["sweep"] if "us" in r]
        best = {}
        for r in ok:
            if r["context"] == CONTEXT and r["config"] == "launcher's choice":
                best[(r["kernel"], r["bits"], r["group"])] = r["us"]
        head = "; ".join(f"{k} {b}-bit g{g} {us:.1f} us" for (k, b, g), us in sorted(best.items())[:6])
        return f"{len(ok)} rows{' (complete)' if res.get('complete') else ' (cut)'}; at {CONTEXT // 1024}k: {head}"
    if res.get("budget"):
        rows = [r for r in res["budget"]["rows"] if "tok_s" in r]
        return "; ".join(f"{r['label']} batch {r['run_batch']} {r['tok_s']:.0f} tok/s" for r in rows)
    parts = []
    for r in res.get("grid", []):
        per_layer = r.get("step_ms_per_layer", r["step_ms_median"] / max(1, r.get("n_layers") or 1))
        parts.append(f"{r['label']} {r['step_ms_median']:.2f} ms ({per_layer:.3f} ms/layer"
                     f"{', ' + r['attn_path'] if r.get('attn_path') else ''})")
    return "; ".join(parts)


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
    for p in sorted(list(ROOT.glob("*.py")) + list((ROOT / "tools").glob("*.py")) + list((ROOT / "tests").glob("*.py"))):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
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
# with every selected test, a bench JSON with toy numbers, the sweep's rows one by one) and prints the command.
def stub_cmd(step: Step, xml: Optional[Path]) -> list:
    spec = dict(name=step.name, tests=step.tests, xml=str(xml) if xml else None, json=str(step.json) if step.json else None)
    if step.cmd:  # the real command must parse (tools/bench.py's parser, here in this process)
        sys.path.insert(0, str(ROOT)) if str(ROOT) not in sys.path else None
        from tools import bench
        b = bench.parse_args(step.cmd[2:])
        spec.update(cmd=" ".join(step.cmd[1:]), sweep=b.sweep, budget=bool(b.kv_budget_gb), caches=b.caches,
                    layers=b.layers or MODEL_LAYERS, attn_path=b.attn_path)
    return [sys.executable, str(Path(__file__).resolve()), "--stub", json.dumps(spec)]


def stub(spec: dict) -> int:
    print("dry run, stubbed:", spec.get("cmd") or f"pytest, {len(spec['tests'])} tests", flush=True)
    if spec["xml"]:
        cases = "".join(f'<testcase name="{t.split("::")[-1]}" time="0.0"/>' for t in spec["tests"])
        Path(spec["xml"]).write_text(f"<testsuite>{cases}</testsuite>")
    if spec["json"]:
        if spec["sweep"]:  # rows one by one, as the real sweep writes them
            res = dict(sweep=[], complete=False)
            for path in ("words", "planes", "gluon"):
                res["sweep"].append(dict(kernel=path, gluon=path == "gluon", bits=1, group=64, context=CONTEXT,
                                         config="launcher's choice", us=1.0))
                Path(spec["json"]).write_text(json.dumps(res))
            res["complete"] = True
        elif spec["budget"]:
            res = dict(budget=dict(rows=[dict(label=c, run_batch=1, tok_s=1.0) for c in spec["caches"]]))
        else:
            res = dict(grid=[dict(label=c, step_ms_median=float(spec["layers"]), n_layers=spec["layers"], step_ms_per_layer=1.0,
                                  attn_path=None if c == "full" else spec["attn_path"] or "words") for c in spec["caches"]])
        Path(spec["json"]).write_text(json.dumps(res))
        if not spec["sweep"]:
            Path(spec["json"]).with_suffix(".md").write_text(f"(dry run: {spec['name']})\n")
    return 0


# ---- the run -------------------------------------------------------------------------------------------------------
class Clock:
    """Seconds since the start; the dry run adds each step's expected H100 seconds (EXPECTED_S) to show
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
    code, text, secs = run([py, "-c", "import kernels, topk, cache, prefetch, transfer, generate"], 120,
                           work / "imports.log", env)
    clock.spend("imports", secs)
    if code != 0:
        last = (text.strip().splitlines() or ["(no output)"])[-1][:200]
        report.add("imports", "FAIL", secs, last, log=text)
        print(f"gpu-check: the method's modules do not import: {last}")
        return 1
    code, text, secs2 = run([py, "-c", "import attn_gluon"], 60, work / "gluon.log", env)
    gluon_note = "" if code == 0 else f"attn_gluon does not import (the Gluon rows fail): {text.strip().splitlines()[-1][:160]}"
    report.add("imports", "pass" if code == 0 else "FAIL", secs + secs2, gluon_note or "kernels, topk, cache, prefetch, "
               "transfer, generate, attn_gluon", log=text if code else "")

    ids, text, secs = collect(py, env, work)
    clock.spend("collect", secs)
    if ids is None:
        report.add("collect the CUDA tests", "FAIL", secs, (text.strip().splitlines() or [""])[-1][:160], log=text)
        tests = {}
    else:
        tests = {k: [i for i in ids if test_group(i) == k] for k in TEST_STEPS}
        report.add("collect the CUDA tests", "pass", secs, ", ".join(f"{TEST_STEPS[k].split(': ')[1]} {len(v)}"
                                                                     for k, v in tests.items()))

    state = {}  # the background step (thread, step, started, its result once done), the fp16 step's time

    def execute(step: Step, live: Path):
        xml = work / f"{step.key}.xml" if step.tests else None
        if a.dry_run_cpu and not (step.key == "step" and "full" in step.cmd and not state.get("toy_done")):
            cmd = stub_cmd(step, xml)
        elif a.dry_run_cpu:  # one bench run for real at toy size: the plumbing end to end
            state["toy_done"] = True
            cmd = [py, "tools/bench.py", "--model", "SmolLM2-135M", "--random-weights", "--layers", "1", "--contexts", "64",
                   "--caches", "full", "--warmup", "1", "--steps", "1", "--device", "cpu", "--bandwidth-mb", "8",
                   "--json", str(step.json)]
        elif step.tests:
            # (-o addopts=: pytest.ini's -q would cancel -v, which names each test in the log as it ends)
            cmd = [py, "-m", "pytest", "-o", "addopts=", "-m", "cuda", "-v", "-p", "no:cacheprovider", f"--junitxml={xml}",
                   *step.tests]
        else:
            cmd = step.cmd
        timeout = min(step.timeout_s, max(1.0, left() - RESERVE_S))
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
        test_rows = pytest_rows(xml) if xml and xml.exists() else []
        return code, text, secs, result, test_rows

    def record(step: Step, code, text, secs, result, test_rows, beside=""):
        """One summary row (each whole step also against the fp16 step at the same depth)."""
        if step.tests:
            counts = {s: sum(r["status"] == s for r in test_rows) for s in ("pass", "FAIL", "skip", "cut")}
            status = "FAIL" if counts["FAIL"] or code not in (0, 5, None) else "cut" if code is None or counts["cut"] else "pass"
            failed = [r["check"] for r in test_rows if r["status"] in ("FAIL", "cut")]
            note = (f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, {counts['cut']} over "
                    f"{PER_TEST_TIMEOUT_S} s, {len(step.tests) - len(test_rows)} not reached"
                    + (f"; {', '.join(failed[:3])}" if failed else "") + ("; timed out" if code is None else ""))
            report.add(step.name, status, secs, note, beside, text, tests=test_rows)
            return
        ok = code == 0 and result is not None
        status = "pass" if ok else "cut" if code is None else "FAIL"
        note = step_note(result) if result else ""
        grid = (result or {}).get("grid") or []
        if step.key.startswith("step") and grid:
            layers = int(step.cmd[step.cmd.index("--layers") + 1])
            cache = step.cmd[step.cmd.index("--caches") + 1]
            ms = state.setdefault("ms", {})
            ms[cache, layers] = grid[0]["step_ms_median"]
            if cache != "full" and ("full", layers) in ms:
                note += f"; {ms[cache, layers] / ms['full', layers]:.2f}x the fp16 step"
            if layers == 2 * LAYERS and (cache, LAYERS) in ms:  # full depth on the line through both depths
                est = {c: ms[c, LAYERS] + (ms[c, layers] - ms[c, LAYERS]) * (MODEL_LAYERS - LAYERS) / LAYERS
                       for c in (cache, "full") if (c, LAYERS) in ms and (c, layers) in ms}
                note += f"; at {MODEL_LAYERS} layers (a line through {LAYERS} and {layers}): {est[cache]:.2f} ms"
                if cache != "full" and "full" in est:
                    note += f", {est[cache] / est['full']:.2f}x the fp16 step's {est['full']:.2f}"
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
        if step.key in ("sweep", "table3", "full-depth"):  # timings: not beside the background tests
            join_background()
        if left() < step.need_s:
            report.add(step.name, "not run", 0.0, f"needs {step.need_s:.0f} s to start (~{EXPECTED_S[step.key]} s on an "
                       f"H100), {max(0, left()):.0f} s left")
            continue
        if step.background:
            def work_bg(s=step):
                state["result"] = execute(s, out / "running-bg.log")
            state.update(step=step, started=clock.elapsed(), thread=threading.Thread(target=work_bg, daemon=True))
            state["thread"].start()
            continue
        print(f"# {step.name} ({left():.0f} s left)", flush=True)
        code, text, secs, result, test_rows = execute(step, out / "running.log")
        clock.spend(step.key, secs)
        beside = "CUDA tests running" if background_busy() else ""
        record(step, code, text, secs, result, test_rows, beside)
        (out / "running.log").unlink(missing_ok=True)
        if state.get("thread") is not None and not background_busy():  # its rows into the summary now
            join_background()
    join_background()
    shutil.rmtree(work, ignore_errors=True)

    counts = {s: sum(r["status"] == s for r in report.rows) for s in ("pass", "FAIL", "skip", "not run", "cut")}
    print("\n" + report.table())
    print(f"\n# {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, "
          f"{counts['not run'] + counts['cut']} not run or cut by the budget in {clock.elapsed():.0f} s on "
          f"{report.env['device']}; files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
