"""Table 3 (`tools/bench.py --kv-budget-gb`): decode throughput of each cache at the largest batch whose device KV
fits a budget, as the paper runs it (specache.txt §4.4): every cache at its own batch, tokens/s against the fp16
cache's at its batch.

Three things bound the batch a row runs, and the row says which: the device budget; the host memory SpeCache's
fp16 store takes (`--host-budget-gb`, default HOST_SHARE of the memory available; pinned on CUDA, where torch's
allocator rounds each of the store's two tensors up to a power of two); and what the device can run beside the
weights (`run_batch_cap`). On CUDA each row carries its run's kernel profile (`--profile-steps`), so a table shows
which kernel's time grows with the batch."""
import gc
import os

import torch

from generate import setup_caches

HOST_SHARE = 0.6  # of the memory available: pinned pages cannot be swapped out, and the machine needs the rest
RUN_SHARE = 0.8  # of the free device memory, for the caches (prefill's activations and the step's take the rest)
MEMINFO = "/proc/meminfo"
BOUNDS = ("device budget", "host memory", "run cap")  # (a tie goes to the first: the budget's batch ran)


# ---- the host's side ----------------------------------------------------------------------------------------
def host_memory_bytes(meminfo=None) -> int:
    """The memory available now: MemAvailable of /proc/meminfo (what can be had without swapping, the page
    cache included), else the free physical pages."""
    try:
        with open(meminfo or MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def default_host_budget_gb() -> float:
    return HOST_SHARE * host_memory_bytes() / 1e9


def host_footprint(host_row: int, batch: int, pinned: bool) -> int:
    """Host bytes a store of `batch` rows takes. Pinned (CUDA), torch's CachingHostAllocator rounds each
    allocation up to a power of two, and the store is two tensors of equal size (K and V, every layer in each:
    prefetch.Prefetcher's host_k and host_v); elsewhere it is what it holds."""
    n = host_row * batch
    if not pinned or n == 0:
        return n
    return 2 * (1 << (n // 2 - 1).bit_length())


def host_batch(host_row: int, budget_bytes: float, pinned: bool) -> int | None:
    """The largest batch whose host store fits budget_bytes (None: the cache keeps nothing on the host)."""
    if not host_row:
        return None
    lo, hi = 0, int(budget_bytes // host_row)  # (the footprint is never below the bytes held)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if host_footprint(host_row, mid, pinned) <= budget_bytes else (lo, mid - 1)
    return lo


# ---- the device's side ----------------------------------------------------------------------------------------
def kv_bytes_linear(model, cfg, length: int) -> tuple[int, int, int]:
    """(fixed, device per row, host per row) of a cache configuration: its buffers are linear in the batch, so
    builds at batch 1 and 2 give the lines."""
    d, h = [], []
    for b in (1, 2):
        caches = setup_caches(model, cfg, b, length)
        d.append(caches.device_bytes())
        h.append(caches.host_bytes())
        del caches
        release(model)
    return d[0] - (d[1] - d[0]), d[1] - d[0], h[1] - h[0]


def prefill_row_bytes(model, a) -> int:
    """Device bytes prefill takes per batch row beyond the caches: a chunk's logits, in the model's dtype and in
    fp32 (model.forward returns fp32; 1.6 GB a row at Llama-3.1-8B's vocabulary and 2,048-token chunks); none
    where one row is prefilled for all (--prefill-one-row)."""
    if getattr(a, "prefill_one_row", False):
        return 0
    return a.prefill_chunk * model.args.vocab_size * (model.tok_embeddings.weight.element_size() + 4)


def run_batch_cap(model, fixed: int, per_row: int, a) -> int | None:
    """The largest batch actually run: --max-run-batch, else on CUDA what RUN_SHARE of the free device memory
    holds beside the weights (the caches and prefill's logits), else no cap."""
    if a.max_run_batch:
        return a.max_run_batch
    device = model.tok_embeddings.weight.device
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(1, int((RUN_SHARE * free - fixed) // (per_row + prefill_row_bytes(model, a))))


def release(model):
    """Drop the caches the model holds and hand their memory back, the pinned host store too (torch keeps
    freed pinned blocks for reuse, and the next store, of another size, would be pinned beside them)."""
    for layer in model.layers:
        layer.attention.kv_cache = None
    torch._dynamo.reset()  # (its CUDA graphs hold the last run's buffers)
    gc.collect()
    if model.tok_embeddings.weight.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # (not in every torch)
        if empty_host is not None:
            empty_host()


# ---- the table ---------------------------------------------------------------------------------------------------
def bound_note(bound: str, run_b: int, budget_b: int) -> str | None:
    if bound == "host memory":
        return f"host-bound: batch {run_b} of the budget's {budget_b}"
    if bound == "run cap":
        return f"capped: batch {run_b} of the budget's {budget_b} (the run cap)"
    return None


def budget_section(runner, names, contexts, a, on_row=None) -> dict:
    """Each cache at min(the budget's batch, the host's, the run cap), measured by `runner` (bench.Runner);
    the PCIe bytes a SpeCache step moves are reported with it. Then, unless --no-fixed-batch, every cache at
    one batch (the reviewers' Q6). on_row(section) after every row: a run cut later keeps the rows before."""
    model = runner.model
    pinned = model.tok_embeddings.weight.device.type == "cuda"
    out = {"budget_gb": a.kv_budget_gb, "host_budget_gb": a.host_budget_gb, "host_pinned": pinned,
           "max_run_batch": a.max_run_batch, "rows": []}
    for ctx in contexts:
        mine = []
        for name in names:
            release(model)  # (the last run's store first: two would be pinned at once)
            fixed, per_row, host_row = kv_bytes_linear(model, runner.config(name), runner.cache_len(ctx))
            budget_b = max(0, int((a.kv_budget_gb * 1e9 - fixed) // per_row))
            host_b = host_batch(host_row, a.host_budget_gb * 1e9, pinned)
            cap = run_batch_cap(model, fixed, per_row, a)
            limits = dict(zip(BOUNDS, (budget_b, host_b, cap)))
            run_b = min(v for v in limits.values() if v is not None)
            bound = next(k for k, v in limits.items() if v == run_b)
            row = {"context": ctx, "cache": name, "label": runner.label(name), "max_batch": budget_b, "host_batch": host_b,
                   "run_cap": cap, "run_batch": run_b, "bound": bound, "capped": bound == "run cap",
                   "kv_bytes_per_row": per_row, "host_bytes_per_row": host_row,
                   "host_bytes": host_footprint(host_row, run_b, pinned)}
            if bound_note(bound, run_b, budget_b):
                row["note"] = bound_note(bound, run_b, budget_b)
            if run_b:
                try:
                    r = runner(name, ctx, run_b)
                except torch.cuda.OutOfMemoryError as e:  # (the next cache still runs)
                    row["error"] = f"out of memory at batch {run_b}: {str(e).splitlines()[0][:160]}"
                else:
                    row.update(step_ms=r["step_ms_median"], tok_s=r["tok_s"], prefill_s=r["prefill_s"],
                               fetch_bytes_per_step=r["fetch_bytes_per_step"], kv_device_bytes=r["kv_device_bytes"])
                    if "profile" in r:
                        row["profile"] = r["profile"]
                    if getattr(a, "different_prompts", False):  # beside the replicated prompt: a batch of real ones
                        d = runner(name, ctx, run_b, ragged=True)
                        row["different_prompts"] = dict(step_ms=d["step_ms_median"], tok_s=d["tok_s"],
                                                        prefill_s=d["prefill_s"])
            out["rows"].append(row)
            mine.append(row)
            if on_row:
                on_row(out)
        full = next((r for r in mine if r["label"] == "full" and r.get("tok_s")), None)
        for r in mine:
            if r.get("tok_s") and full:
                r["speedup_vs_full"] = r["tok_s"] / full["tok_s"]
        if not getattr(a, "no_fixed_batch", False):
            fixed_batch_rows(runner, mine, ctx, min(max(1, r["run_batch"]) for r in mine), out)
    release(model)
    return out


def fixed_batch_rows(runner, mine, ctx, batch, out):
    """The reviewers' Q6: every cache at one batch (the largest every cache runs), against full and KIVI."""
    measured = {}
    for r in mine:
        release(runner.model)
        measured[r["cache"]] = runner(r["cache"], ctx, batch)
    ref = {lb: next((x for x in measured.values() if x["label"].startswith(lb)), None) for lb in ("full", "kivi")}
    for name, r in measured.items():
        out.setdefault("fixed", []).append(
            {"context": ctx, "batch": batch, "cache": name, "label": r["label"], "step_ms": r["step_ms_median"],
             "tok_s": r["tok_s"], "kv_device_bytes": r["kv_device_bytes"],
             "vs_full": r["tok_s"] / ref["full"]["tok_s"] if ref["full"] else None,
             "vs_kivi": r["tok_s"] / ref["kivi"]["tok_s"] if ref["kivi"] else None})
