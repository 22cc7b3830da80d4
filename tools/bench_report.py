"""tools/bench.py's markdown report: decode steps, step-time ratios, the CUDA profile, kernels alone,
Table 3 on a KV budget (and in one line: tools/gpu_check.py's summary row), QuantSpec and the transformers
side by side."""


def md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in row) + " |" for row in rows])


def mb(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def report(res: dict) -> str:
    env, bw, md = res["environment"], res["bandwidth"], []
    md += [f"# bench.py: {env['device']} ({env['gpu'] or env['cpu']}), {env['dtype']}, {env['threads']} threads, "
           f"compile={res['config']['compile']}, torch {env['torch']}, triton {env['triton']}, {env['date']}",
           f"Model {res['model']} ({res['weight_bytes'] / 2**20:.0f} MiB of weights read per step), prompt: "
           f"{res['prompt_source']}. Measured bandwidth: copy {bw['copy_gbs']:.1f} GB/s ((read+write)/time), "
           f"streaming read {bw['read_gbs']:.1f} GB/s.", ""]
    if res.get("grid"):
        md += ["## Decode steps (median of timed steps; MiB = 2^20 bytes; tok/s = output tokens)", "",
               "A step's time runs from one step's end to the next's: the decode step, the loop's own work, and for "
               "the resync policy the extra pre-decoding forward after each wrong speculative token (counted in "
               "`resyncs`; the mean shows their cost, the median hides it while fewer than half the steps miss).", ""]
        md.append(md_table(
            ["cache", "context", "batch", "prefill s", "step ms (min, spread)", "mean ms", "resyncs", "tok/s",
             "KV device MiB", "host MiB", "fetched MiB/step", "read MiB/step", "achieved GB/s", "of copy BW",
             "H100 floor ms", "CPU share"],
            [[r["label"], r["context"], r["batch"], f"{r['prefill_s']:.2f}",
              f"{r['step_ms_median']:.2f} ({r['step_ms_min']:.2f}, {r['spread_pct']:.0f}%)",
              f"{r['step_ms_mean']:.2f}" if "step_ms_mean" in r else "-", r.get("resyncs", "-"), f"{r['tok_s']:.1f}",
              mb(r["kv_device_bytes"]), mb(r["kv_host_bytes"]), f"{r['fetch_bytes_per_step'] / 2**20:.2f}",
              mb(r["read_bytes_per_step"]), f"{r['achieved_gbs']:.1f}", f"{100 * r['of_copy_bw']:.0f}%",
              f"{r['floor_ms_h100']:.2f}", "-" if r["cpu_share"] is None else f"{r['cpu_share']:.2f}"]
             for r in res["grid"]]))
        md.append("\nCPU share: CPU time this process got / (wall time x threads) over the timed steps; well below ~0.8 means "
                  "other processes competed for the cores (timings suspect).\n")
        ratios = ratio_rows(res["grid"])
        if ratios:
            md += ["## Step time ratios (same context, batch and depth)", "",
                   md_table(["context", "batch", "step", "attention", "layers", "ms/layer", "full ms/layer", "/ full",
                             "/ kivi 1-token"],
                            [[r["context"], r["batch"], r["label"], r["attn_path"] or "-", r["layers"], r["ms_per_layer"],
                              r["full_ms_per_layer"], r["vs_full"], r["vs_kivi"]] for r in ratios]),
                   "", "ms/layer: the median step over the model's decoder layers (embedding and output head "
                   "included, so at a few layers it overstates a layer's share); attention: the low-bit kernels' "
                   "path (Triton words/planes/gluon on CUDA, the torch reference on CPU).", ""]
    prof = [r for r in res.get("grid", []) if "profile" in r and "kernels" in r["profile"]]
    if prof:  # (kernels attributed by name: measure.kernel_class)
        from tools import measure
        classes = [c for c, _ in measure.KERNEL_CLASSES] + ["other"]
        md += ["## CUDA profile of the timed steps (torch.profiler; kernels by name, us per step)", ""]
        md.append(md_table(["cache", "context", "batch", "busy ms/step", "launches/step", *classes, "transfer overlapped"],
                           [[r["label"], r["context"], r["batch"], f"{r['profile']['busy_ms_per_step']:.3f}",
                             f"{r['profile']['launches_per_step']:.0f}",
                             *(f"{r['profile']['class_us_per_step'].get(c, 0):.1f}" for c in classes),
                             "-" if r["profile"]["transfer_overlapped_frac"] is None
                             else f"{100 * r['profile']['transfer_overlapped_frac']:.0f}%"] for r in prof]))
        md.append("")
        for r in prof:
            md += [f"### Top kernels: {r['label']}, {r['context']}, batch {r['batch']} ({len(r['profile']['kernels'])} by time)", ""]
            md.append(md_table(["kernel", "class", "us/step", "calls/step"],
                               [[k["name"], k["cls"], f"{k['us_per_step']:.1f}", f"{k['calls_per_step']:g}"]
                                for k in r["profile"]["kernels"]]))
            md.append("")
    if res.get("kernels"):
        md += ["## Kernels alone (batch 1; floor = bytes / bandwidth; on CUDA: a CUDA graph's replays after an L2 "
               "flush, and eager calls with their launch overhead)", ""]
        md.append(md_table(["kernel", "context", "bytes", "us (min)", "us eager", "achieved GB/s", "floor here us",
                            "floor H100 us"],
                           [[r["kernel"], r["context"], f"{r['bytes']:,}", f"{r['us']:.1f} ({r['us_min']:.1f})",
                             f"{r.get('us_eager', r['us']):.1f}",
                             f"{r['achieved_gbs']:.1f}", f"{r['floor_us_here']:.2f}", f"{r['floor_us_h100']:.2f}"]
                            for r in res["kernels"]]))
        md.append("")
    b = res.get("budget")
    if b:
        cap = f"runs capped at batch {b['max_run_batch']}" if b["max_run_batch"] else "the run cap: what the device holds"
        md += [f"## Table 3: each cache at the largest batch whose device KV fits {b['budget_gb']} GB and host store "
               f"{b['host_budget_gb']:.1f} GB{' (pinned)' if b.get('host_pinned') else ''}; {cap}", ""]
        md.append(md_table(["context", "cache", "KV MiB/row", "host MiB/row", "budget batch", "host batch", "run cap",
                            "run batch", "bound", "step ms", "tok/s", "vs full", "PCIe MiB/step"],
                           [[r["context"], r["label"], mb(r["kv_bytes_per_row"]), mb(r["host_bytes_per_row"]), r["max_batch"],
                             "-" if r.get("host_batch") is None else r["host_batch"],
                             "-" if r.get("run_cap") is None else r["run_cap"], r.get("run_batch", "-"),
                             r.get("error") or r.get("note") or r.get("bound", "-"),
                             f"{r['step_ms']:.2f}" if "step_ms" in r else "-", f"{r['tok_s']:.1f}" if "tok_s" in r else "-",
                             f"{r['speedup_vs_full']:.2f}x" if "speedup_vs_full" in r else "-",
                             mb(r.get("fetch_bytes_per_step"))] for r in b["rows"]]))
        md += ["", "vs full: tokens/s over the fp16 cache's at its own batch (the paper's Table 3 at 32k: 4.6x for "
               "1-bit SpeCache, 3.4x for 2-bit). Each run's kernels by name: the CUDA profile above.", "",
               table3_headline(b), ""]
        other = [r for r in b["rows"] if "different_prompts" in r]
        if other:  # (--different-prompts)
            md += ["Each cache's batch as different prompts (lengths from the context down to half of it, left-padded):",
                   "", md_table(["context", "cache", "run batch", "step ms", "tok/s", "vs the replicated prompt"],
                                [[r["context"], r["label"], r["run_batch"], f"{r['different_prompts']['step_ms']:.2f}",
                                  f"{r['different_prompts']['tok_s']:.1f}",
                                  f"{r['different_prompts']['tok_s'] / r['tok_s']:.2f}x"] for r in other]), ""]
        if b.get("fixed"):
            md += ["### Same batch for every cache (reviewers' Q6)", ""]
            md.append(md_table(["context", "batch", "cache", "step ms", "tok/s", "vs full", "vs kivi", "KV device MiB"],
                               [[r["context"], r["batch"], r["label"], f"{r['step_ms']:.2f}", f"{r['tok_s']:.1f}",
                                 f"{r['vs_full']:.2f}x" if r["vs_full"] else "-", f"{r['vs_kivi']:.2f}x" if r["vs_kivi"] else "-",
                                 mb(r["kv_device_bytes"])] for r in b["fixed"]]))
            md.append("")
    if res.get("quantspec"):
        md += ["## QuantSpec vs autoregressive decoding (batch 1, greedy)", ""]
        md.append(md_table(["method", "context", "acceptance", "tokens/round", "tok/s", "read MiB/token",
                            "H100 floor ms/token"],
                           [[r["method"], r["context"], "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%",
                             f"{r['tokens_per_round']:.2f}", f"{r['tok_s']:.1f}", mb(r["read_bytes_per_token"]),
                             f"{r['floor_ms_per_token_h100']:.3f}"] for r in res["quantspec"]]))
        md += ["", "read MiB/token: (gamma x one draft step's reads + one verify step's reads) / tokens per round; "
               "a draft step reads INT4 weights and the upper INT4 planes, the verify step the model's weights and "
               "both planes. Acceptance with random weights says nothing about a trained model.", ""]
    if res.get("hf"):
        md += [f"## Side by side with transformers (context {res['hf_context']}, batch 1)", ""]
        md.append(md_table(["run", "prefill s", "step ms (min)", "tok/s"],
                           [[r["name"], "skipped: " + r["skipped"], "", ""] if "skipped" in r else
                            [r["name"], f"{r['prefill_s']:.2f}", f"{r['step_ms_median']:.2f} ({r['step_ms_min']:.2f})",
                             f"{r['tok_s']:.1f}"] for r in res["hf"]]))
        md.append("")
    return "\n".join(md)


def ratio_rows(grid) -> list[dict]:
    """Each cache's step time over the full cache's and 1-token KIVI's at the same context and batch (and
    depth: rows of one run share it), and the ms per decoder layer of both sides."""
    by = {(r["context"], r["batch"], r["label"]): r for r in grid}
    out = []
    for r in grid:
        full = next((x for (c, b, lb), x in by.items() if (c, b) == (r["context"], r["batch"]) and lb == "full"), None)
        kivi = next((x for (c, b, lb), x in by.items() if (c, b) == (r["context"], r["batch"]) and lb.startswith("kivi")
                     and x["step_tokens"] == 1), None)
        if r["label"] != "full" and (full or kivi):
            f = lambda x: f"{r['step_ms_median'] / x['step_ms_median']:.2f}x" if x else "-"  # noqa: E731
            per_layer = lambda x: f"{x['step_ms_median'] / x['n_layers']:.3f}" if x and x.get("n_layers") else "-"  # noqa: E731
            out.append({"context": r["context"], "batch": r["batch"], "label": r["label"], "vs_full": f(full),
                        "vs_kivi": f(kivi), "attn_path": r.get("attn_path"), "layers": r.get("n_layers", "-"),
                        "ms_per_layer": per_layer(r), "full_ms_per_layer": per_layer(full)})
    return out


# ---- Table 3 in one line (tools/gpu_check.py's summary row) -------------------------------------------------------
PAPER_SPEEDUP = {"specache-1bit": 4.6, "specache-2bit": 3.4}  # specache.txt Table 3 at 32k: tokens/s over fp16's


def profile_growth(prof: dict, base: dict | None, n: int = 3) -> str:
    """Where a Table 3 run's step time went: the kernel classes that grew most from a batch-1 step of the same
    cache (`base`'s profile; kernel names change with the batch, their classes do not), and its top kernels."""
    now, parts = prof.get("class_us_per_step", {}), []
    if base and base.get("class_us_per_step"):
        was = base["class_us_per_step"]
        grown = sorted(now, key=lambda c: was.get(c, 0.0) - now[c])[:n]
        parts.append("from batch 1: " + ", ".join(f"{c} {was.get(c, 0):,.0f} -> {now[c]:,.0f}" for c in grown))
    parts.append("top: " + ", ".join(f"{k['name'][:32]} {k['us_per_step']:,.0f}" for k in prof.get("kernels", [])[:n]))
    return " us/step; ".join(parts) + " us/step"


def table3_headline(budget: dict, batch1: dict | None = None) -> str:
    """Each cache's batch and what bound it, its tokens/s and their ratio to fp16's at its own batch (beside the
    paper's), and where its step time went (batch1: cache name -> the profile of its batch-1 step)."""
    rows, parts = budget["rows"], []
    several = len({r["context"] for r in rows}) > 1
    for r in rows:
        full = next((x for x in rows if x["label"] == "full" and x.get("tok_s") and x["context"] == r["context"]), None)
        at = f" at {r['context']}" if several else ""
        head = f"{r['label']}{at} batch {r.get('run_batch', 0)} ({r.get('note') or r.get('bound', '?')})"
        if "tok_s" not in r:
            parts.append(f"{head}: {r.get('error') or 'not run'}")
            continue
        s = f"{head} {r['tok_s']:,.0f} tok/s"
        if full and r is not full:
            target = next((t for name, t in PAPER_SPEEDUP.items() if r["label"].startswith(name)), None)
            s += f", {r['tok_s'] / full['tok_s']:.2f}x fp16's" + (f" (target >= {target}x)" if target else "")
        if r.get("profile") and "kernels" in r["profile"]:
            s += f" [{profile_growth(r['profile'], (batch1 or {}).get(r['cache']))}]"
        parts.append(s)
    return "; ".join(parts)
