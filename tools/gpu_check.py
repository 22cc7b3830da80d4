"""The whole GPU verification in one command (`make gpu-check`), for anyone with a CUDA GPU.

    python tools/gpu_check.py [--out DIR] [--budget-s 600]

1. correctness: `pytest -m cuda` (tests/test_cuda.py): kernels against the torch references (the
   kernel-test cases and Llama-3.1-8B shapes at 32k in bf16), exactness with every row fetched for
   every fetch policy and transfer, CUDA fp32 tokens == CPU tokens, compiled (CUDA graph) == eager
   with one graph for full/KIVI/SpeCache, and the default model through generate.py --compile
   (skipped, and said so, when checkpoints/smollm2-135m-instruct is absent);
2. speed: each kernel alone against its byte floor (tools/bench.py --kernels: CUDA-graph replays after an L2
   flush), then whole compiled decode steps of Llama-3.1-8B shapes with random bf16 weights (tools/bench.py
   --model Llama-3.1-8B --random-weights --compile; full, KIVI, SpeCache paper and best presets,
   the best preset before re-ranking joined it, ZipCache mixed; one process each) at 32k, QuantSpec
   rounds (gamma 0 and 4) at 8k, then the steps at 8k, while the time budget lasts. Each run's
   output is kept beside its JSON (.log).
Prints one summary table (then the speed tables) and exits non-zero on any failure. It needs only
the machine's Python with torch and Triton: no network, no package installs, no virtual environment.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        status, note = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "FAIL", "error": "FAIL", "skipped": "skip"}[tag]
                note = (el.get("message") or "").strip().splitlines()[0][:120] if el.get("message") else ""
        rows.append(dict(check=case.get("name"), status=status, seconds=float(case.get("time", 0)), note=note))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".cache" / "gpu-check", help="where the JSON/markdown results go")
    p.add_argument("--budget-s", type=float, default=600,
                   help="stop starting speed runs past this many seconds (on an H100: the CUDA tests ~115 s, plus "
                        "50-250 s for each of the default model's four compiled-CLI checks when it is converted; "
                        "the kernels ~35 s, each compiled Llama-3.1-8B step at 32k ~100-240 s, most of it compiling)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true", help="run the same plumbing on CPU at toy sizes (tests the "
                   "script on a machine without a GPU; its numbers mean nothing)")
    a = p.parse_args(argv)
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
    t0 = time.perf_counter()
    left = lambda: a.budget_s - (time.perf_counter() - t0)  # noqa: E731
    a.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="0", TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".cache" / "inductor"))
    if a.dry_run_cpu:
        env.update(TRITON_INTERPRET="1", SPECACHE_CHECK_DEVICE="cpu", OMP_NUM_THREADS="1")
        device = f"CPU dry run (torch {torch.__version__})"
    else:
        device = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    print(f"# gpu-check on {device}", flush=True)

    rows = []
    xml = a.out / "pytest-cuda.xml"
    # -v: the log names each test as it ends, so a cut run still says which passed
    code, out, secs = run([sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", "tests/test_cuda.py"], timeout=max(240, left()),
                          log=a.out / "pytest-cuda.log", env=env)
    if xml.exists():
        rows += pytest_rows(xml)
    if code not in (0, 5) or not xml.exists():
        rows.append(dict(check="pytest -m cuda", status="FAIL", seconds=secs,
                         note=("timed out" if code is None else out.strip().splitlines()[-1][:120] if out.strip() else "")))

    speed_md = []
    if not a.skip_speed:
        model, big, small, steps = ("Llama-3.1-8B", "32768", "8192", ["--warmup", "5", "--steps", "20"])
        bench = [sys.executable, "tools/bench.py", "--model", model, "--random-weights", "--dtype", "bfloat16"]
        if a.dry_run_cpu:
            bench = [sys.executable, "tools/bench.py", "--model", "SmolLM2-135M", "--random-weights", "--dtype", "float32",
                     "--device", "cpu", "--kernel-reps", "2", "--bandwidth-mb", "8"]
            big, small, steps = "512", "256", ["--warmup", "1", "--steps", "2"]
        # one process per cache (each compiles its own graph): a slow compile costs one row, not the rest
        # (beside the preset, the one before it: k 96, no re-ranking, the same bus bytes)
        caches = ["full", "kivi", "specache", "specache-1bit-best", "specache-1bit-best-rr1-k96-r32",
                  "kivi-2bit-zipcache-s40-hi4"]
        plans = [(f"kernels alone, {big}", bench + ["--kernels", "--contexts", big], "kernels.json")]
        plans += [(f"compiled step {c}, {big}", bench + ["--compile", "--contexts", big, "--caches", c, *steps],
                   f"steps-{big}-{c}.json") for c in caches]
        plans += [(f"QuantSpec rounds, {small}", bench + ["--compile", "--contexts", small, "--quantspec", "--gammas",
                                                          "0,4", *steps], "quantspec.json")]
        plans += [(f"compiled step {c}, {small}", bench + ["--compile", "--contexts", small, "--caches", c, *steps],
                   f"steps-{small}-{c}.json") for c in caches]
        for name, cmd, fname in plans:
            if left() < (30 if "kernels" in name else 120):  # a compiled step needs ~100 s on an H100
                rows.append(dict(check=name, status="not run", seconds=0.0, note="time budget spent (--budget-s)"))
                continue
            # progress lines and tracebacks go to the .log beside the JSON
            code, out, secs = run(cmd + ["--json", str(a.out / fname)], timeout=left(),
                                  log=(a.out / fname).with_suffix(".log"), env=env)
            ok = code == 0 and (a.out / fname).exists()
            # a speed run the budget cut short is not a failure of the code: "cut", not FAIL
            status = "pass" if ok else ("cut" if code is None else "FAIL")
            rows.append(dict(check=name, status=status, seconds=secs,
                             note="" if ok else ("budget ran out (--budget-s)" if code is None
                                                 else (out.strip().splitlines() or [""])[-1][:120])))
            if ok:
                speed_md.append((a.out / fname).with_suffix(".md").read_text())

    failed = [r for r in rows if r["status"] == "FAIL"]
    width = max(len(r["check"]) for r in rows)
    print(f"\n| {'check'.ljust(width)} | result | seconds | note |\n|{'-' * (width + 2)}|---|---|---|")
    for r in rows:
        print(f"| {r['check'].ljust(width)} | {r['status']} | {r['seconds']:.1f} | {r['note']} |")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "skip", "not run", "cut")}
    print(f"\n# {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, "
          f"{counts['not run'] + counts['cut']} not run or cut by the budget "
          f"in {time.perf_counter() - t0:.0f} s on {device}")
    for md in speed_md:
        print("\n" + md)
    (a.out / "summary.json").write_text(json.dumps(dict(device=device, rows=rows), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
