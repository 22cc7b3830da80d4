"""Measuring instruments for tools/bench.py: the environment, a bandwidth probe, per-step timers, peak
memory, kernel timing, the CUDA side-stream overlap profile, the weights a step reads and the
reference bandwidths of the byte floors. Nothing here knows about caches."""
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
H100_GBS = 3350.0  # H100 SXM HBM3 bandwidth, GB/s (the byte floors' reference device)
PCIE_GBS = 50.0  # host-to-device over PCIe 5.0 x16: a nominal figure for the floors, not a measurement


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads. An untied input embedding is only looked up (a few
    rows), so it is left out; a tied one is read whole by the output projection."""
    n = sum(p.nbytes for p in model.parameters())
    return n - model.tok_embeddings.weight.nbytes if model.output is not None else n


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device, dtype, **extra) -> dict:
    import triton
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "cpu": cpu_name(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "device": str(device), "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "argv": sys.argv[1:],
           "loadavg_at_start": os.getloadavg(), **extra}
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


def time_fn(fn, device, warmup=3, reps=20, graph=False) -> dict:
    """Seconds per call of fn(): CUDA events around each call on CUDA, perf_counter on CPU.
    graph=True (CUDA): capture fn in a CUDA graph and time its replays, each after a write of 256 MiB
    that evicts L2 (50 MB on an H100, more than a 1-bit cache's codes at 32k): the kernels' own time
    from DRAM, without the Python launch overhead that eager calls pay (a compiled step replays a
    graph too)."""
    if graph and device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up (compiles, allocations) off the capture
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        fn = g.replay
    for _ in range(warmup):
        fn()
    synchronize(device)
    ts = []
    for _ in range(reps):
        if graph and device.type == "cuda":
            flush.zero_()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return {"min_s": min(ts), "median_s": statistics.median(ts), "n": reps}


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


class StepMarks:
    """Marks between decode steps (generate()'s on_step): CUDA events recorded on the current stream
    (no host sync between steps) or perf_counter on CPU. durations()[i] = time of step i + 1."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.cpu_seconds = []  # on CPU: this process's CPU time at each mark, for cpu_share()

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
            self.cpu_seconds.append(time.process_time())

    def cpu_share(self, first: int, last: int, threads: int) -> float | None:
        """CPU seconds this process got / (wall seconds x threads) from mark first to mark last (steps
        first + 1 .. last); None on CUDA. Well below ~0.8: other processes took the cores."""
        if self.cuda:
            return None
        wall = self.marks[last] - self.marks[first]
        return (self.cpu_seconds[last] - self.cpu_seconds[first]) / (wall * threads)

    def durations(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


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
    busy = lambda iv: sum(e - b for b, e in iv)  # noqa: E731
    both = 0
    for b, e in s:
        for mb, me in m:
            both += max(0, min(e, me) - max(b, mb))
    side_busy = busy(s)
    return {"main_busy": busy(m), "side_busy": side_busy, "overlapped": both,
            "overlap_frac": both / side_busy if side_busy else None}


# What a kernel is, by its name: under CUDA-graph replay the profiler's stream ids do not follow the streams
# the kernels were captured on, so the transfer is found by name, not by stream.
KERNEL_CLASSES = (("transfer", ("_transfer_rows_kernel", "_rerank_score_kernel", "_rerank_layout_kernel",
                                "_rerank_pick_kernel")),
                  ("selection", ("_select_kernel",)),
                  ("attention", ("_attn_words_kernel", "_attn_planes_kernel", "_attn_fp_rows_kernel", "_attn_combine_kernel",
                                 "attn_planes_gluon", "_attn_views_kernel", "flash", "fmha", "sdpa", "attention")),
                  ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "_mm_", "matmul")),
                  ("quantizer", ("bitwise", "round", "pack")),  # (inductor's fused kernels of quant.py's ops)
                  ("copy", ("memcpy", "memset", "copy", "fill")))


def kernel_class(name: str) -> str:
    """transfer, selection, attention, gemm, quantizer, copy or other (KERNEL_CLASSES, first match)."""
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k.lower() in low for k in keys)), "other")


def profile_of(prof, n_steps: int, top: int = 40) -> dict:
    """A finished torch.profiler trace of n_steps decode steps -> time per kernel class and the top kernels
    by time, each with its calls per step (kernel_class: by name, whatever stream the trace reports), and
    how much of the transfer ran while another kernel ran (the fetch hidden behind the step)."""
    events, by_name = [], {}
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.duration_ns() > 0:
            events.append((ev.start_ns(), ev.end_ns(), ev.name()))
            ns, calls = by_name.get(ev.name(), (0, 0))
            by_name[ev.name()] = (ns + ev.duration_ns(), calls + 1)
    if not events:
        return {"error": "no CUDA kernels in the trace (CUDA-graph replays may hide them)"}
    transfer = [(s, e) for s, e, n in events if kernel_class(n) == "transfer"]
    others = [(s, e) for s, e, n in events if kernel_class(n) != "transfer"]
    st = overlap_stats(others, transfer)
    by_class = {}
    for name, (ns, _) in by_name.items():
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0) + ns / 1e3 / n_steps
    kernels = [dict(name=name[:100], cls=kernel_class(name), us_per_step=ns / 1e3 / n_steps, calls_per_step=calls / n_steps)
               for name, (ns, calls) in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]]
    busy = sum(e - b for b, e in merge([(s, e) for s, e, _ in events]))
    return {"steps": n_steps, "busy_ms_per_step": busy / 1e6 / n_steps, "class_us_per_step": by_class,
            "transfer_ms_per_step": st["side_busy"] / 1e6 / n_steps, "transfer_overlapped_frac": st["overlap_frac"],
            "kernels": kernels, "launches_per_step": sum(c for _, c in by_name.values()) / n_steps}

