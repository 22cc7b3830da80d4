"""Compile every Triton kernel for NVIDIA GPUs on a machine that has none: the compile gate, and
the numbers a kernel author needs without a GPU (registers, spills, load widths in the hot loops).

    python tools/triton_aot.py                 # compile all variants for sm_80 and sm_90, print the report
    python tools/triton_aot.py --kernel _attn_words_kernel   # one kernel's variants only (minutes, not ~15)
    python tools/triton_aot.py --arch 90 --sass _attn_words_kernel   # also print that kernel's SASS loops

The report's static cost columns, per variant and target (docs/kernels.md): registers, local memory
and stack bytes (spills), shared memory; the hot loop (the longest innermost loop of `cuobjdump
-sass`) - its instructions per warp and iteration, and per KV token (x num_warps / the tokens one
iteration processes: TOKENS_PER_ITERATION names the constexpr), its STS/LDS counts (both in the loop:
data goes through shared memory for a layout conversion), its LDL/STL; global load widths in loops.

How. The interpreter (TRITON_INTERPRET=1, what the CPU tests use) checks semantics but not what
the compiler rejects (types of loop-carried values, implicit casts) and says nothing about the
machine code. Here a stand-in CUDA driver, which only names a target, lets the real launchers in
kernels.py, topk.py and transfer.py run on CPU tensors; Triton's `jit_cache_hook` records each
specialization they ask for (signature, constexprs, divisibility attributes, num_warps/stages),
exactly as a GPU launch would, and skips the launch. `triton.compile` then builds each one for
each target with the real front and back end (the wheel ships ptxas, cuobjdump and nvdisasm).
The cases below are the cache configurations the project supports, so the launchers' own choices
(block sizes, bits, flags, dtypes) are what gets compiled.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the method's modules are at the root
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("error: tools/triton_aot.py compiles real kernels: run it without TRITON_INTERPRET=1")
os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / ".cache" / "triton"))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 = its current default

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402 (Gluon kernels: attn_gluon.py)
from triton.experimental.gluon._runtime import GluonJITFunction  # noqa: E402
from triton.runtime import driver  # noqa: E402

from tools import kernel_cost  # noqa: E402

ARCHS = (80, 90)
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


class TargetOnlyDriver:
    """Enough of a CUDA driver for the JIT to specialize and key a kernel: a target, device 0."""

    def __init__(self, arch):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def record(cases) -> list[dict]:
    """Run each case (a callable that calls the launchers on CPU tensors) with launches skipped;
    returns the distinct specializations the launchers asked for."""
    specs, seen = [], {}

    def hook(*, fn, compile, **_):
        c = compile
        key = (fn.name, json.dumps(c["signature"]), repr(sorted(c["constants"].items())), repr(c["configs"]),
               c["num_warps"], c["num_stages"])
        if key not in seen:
            seen[key] = len(specs)
            specs.append(dict(kernel=fn.name, jit=fn.jit_function, signature=c["signature"],
                              constants=c["constants"], attrs=c["configs"][0], num_warps=c["num_warps"],
                              num_stages=c["num_stages"], case=current[0]))
        elif current[0] not in specs[seen[key]]["case"].split("; "):  # (QuantSpec's INT4 view is KIVI 4-bit's)
            specs[seen[key]]["case"] += "; " + current[0]
        return True  # skip compile and launch: the launcher gets None back and carries on

    current = [""]
    old_hook = knobs.runtime.jit_cache_hook
    driver.set_active(TargetOnlyDriver(90))
    knobs.runtime.jit_cache_hook = hook
    try:
        for name, fn in cases:
            current[0] = name
            fn()
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        driver.reset_active() if driver._default is not None else driver.set_active(None)
    return specs


def constexpr_names(spec) -> dict:
    names = list(spec["signature"])
    return {names[path[0]]: v for path, v in spec["constants"].items()}


def variant(spec) -> str:
    """A short name: the kernel's constexprs and its pointer dtypes."""
    ptr = sorted({t[1:] for t in spec["signature"].values() if t.startswith("*") and t[1:] not in ("i64", "u8", "i32")})
    cx = ",".join(f"{k}={v}" for k, v in constexpr_names(spec).items())
    return f"{'/'.join(ptr)} {cx} w{spec['num_warps']}s{spec['num_stages']}"


# ---- compiling (in worker processes: ptxas is single-threaded) --------------------------------------
_SPECS: list = []


def _compile_one(job):
    i, arch = job
    spec = _SPECS[i]
    t0 = time.perf_counter()
    try:
        src = (GluonASTSource if isinstance(spec["jit"], GluonJITFunction) else ASTSource)(
            spec["jit"], spec["signature"], spec["constants"], spec["attrs"])
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=spec["num_warps"], num_stages=spec["num_stages"]))
        out = dict(ok=True, ptx=k.asm["ptx"], cubin=k.asm["cubin"], shared=k.metadata.shared)
    except Exception as e:  # noqa: BLE001 - the gate reports every failure
        out = dict(ok=False, error=f"{type(e).__name__}: {str(e).strip()[-1500:]}")
    out.update(index=i, arch=arch, seconds=time.perf_counter() - t0)
    return out


def compile_all(specs, archs=ARCHS, jobs=None) -> list[dict]:
    global _SPECS
    _SPECS = specs
    work = [(i, a) for a in archs for i in range(len(specs))]
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    if jobs <= 1:
        return [_compile_one(w) for w in work]
    with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
        return list(pool.map(_compile_one, work))


# ---- machine-code facts ----------------------------------------------------------------------------
def resource_usage(cubin: bytes) -> dict:
    """Registers, local memory (spills) and shared memory per thread/block, from `cuobjdump -res-usage`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    grab = lambda key: int(m.group(1)) if (m := re.search(key + r":(\d+)", text)) else None  # noqa: E731
    return dict(registers=grab("REG"), local_bytes=grab("LOCAL"), stack=grab("STACK"))


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout


_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")
_BACK_BRA = re.compile(r"\bBRA(?:\.[A-Z0-9]+)*\s+(?:!?U?P[T0-9]+\s*,\s*)?0x([0-9a-f]+)")


def instructions(sass_text: str) -> list[tuple[int, str, str]]:
    """(address, opcode, the whole line) of each instruction in `cuobjdump -sass` text."""
    out = []
    for ln in sass_text.splitlines():
        m = _ADDR.search(ln)
        if m:
            out.append((int(m.group(1), 16), m.group(2), ln))
    return out


def loops(sass_text: str) -> list[tuple[int, int]]:
    """Loops as (first, last) instruction addresses: a label and the last backward branch to it.
    (Branches to one label from several places close one loop, the farthest one included.)"""
    last = {}
    for a, op, ln in instructions(sass_text):
        m = _BACK_BRA.search(ln) if op == "BRA" else None
        if m and int(m.group(1), 16) < a:
            t = int(m.group(1), 16)
            last[t] = max(last.get(t, 0), a)
    return sorted(last.items())


def innermost(spans):
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def loop_loads(sass_text: str) -> dict:
    """Global loads inside loops (between a label and a later backward branch to it), by width:
    {"128": n, "64": n, "32": n, "16": n, "8": n}; "cp64" etc. are asynchronous global->shared copies
    (LDGSTS: Triton's software pipelining of tiles that feed a dot). Wide loads in the hot loop =
    vectorized."""
    spans = loops(sass_text)
    counts = {}
    for a, op, ln in instructions(sass_text):
        if any(lo <= a <= hi for lo, hi in spans):
            m = re.search(r"\bLDG(STS)?\.E((?:\.[A-Z0-9]+)*)", ln)
            if m:  # the width is one of the modifiers (LDGSTS.E.BYPASS.LTC128B.128: 128 bits)
                widths = {"128": "128", "64": "64", "U8": "8", "S8": "8", "U16": "16", "S16": "16"}
                w = next((widths[x] for x in m.group(2).split(".") if x in widths), "32")
                w = ("cp" + w) if m.group(1) else w
                counts[w] = counts.get(w, 0) + 1
    return counts


# What one iteration of a kernel's hot loop processes, in KV tokens: the constexpr that sets it.
TOKENS_PER_ITERATION = {"_attn_words_kernel": "GROUP_K", "_attn_planes_kernel": "GROUP_K", "_select_kernel": "SLICE",
                        "attn_planes_gluon": ("GROUP_K", "NW"), "_attn_views_kernel": "GROUP_K"}
# Which innermost loop is the hot one (default: the longest). The attention kernel's loop over the
# quantized slots is its first (the then-branch of `split < n_splits`; the fetched and residual fp-row
# loops follow it), and need not be its longest.
HOT_LOOP = {"_attn_words_kernel": "first", "_attn_planes_kernel": "first"}


def hot_loop(sass_text: str, pick: str = "longest") -> dict:
    """The static cost of the hot loop: the innermost loop `pick`ed, "longest" or "first" in address
    order (every innermost loop's length is in `inner_loop_instr`). Counts, per warp and iteration:
    instructions (NOPs aside), shared-memory stores (STS, STSM) and loads (LDS, LDSM) - both inside
    the loop = data round-trips through shared memory for a layout conversion (a pipelined tile
    arrives by LDGSTS, not STS) -, local-memory traffic (LDL/STL: spills, stack arrays) and barriers.
    {} when the kernel has no loop."""
    bodies = loop_bodies(sass_text)
    if not bodies:
        return {}
    ops = bodies[0] if pick == "first" else max(bodies, key=len)
    c = _op_counts(ops)
    return dict(loop_instr=len(ops), inner_loop_instr=[len(b) for b in bodies], sts=c["sts"], lds=c["lds"],
                local=c["local"], bar=c["bar"], smem_roundtrip=c["sts"] > 0 and c["lds"] > 0)


def loop_bodies(sass_text: str) -> list[list[str]]:
    """Each innermost loop's opcodes (NOPs aside), loops in address order."""
    ins = instructions(sass_text)
    return [[op for a, op, _ in ins if lo <= a <= hi and op != "NOP"] for lo, hi in innermost(loops(sass_text))]


def _op_counts(ops) -> dict:
    n = lambda *names: sum(op in names for op in ops)  # noqa: E731
    return dict(sts=n("STS", "STSM"), lds=n("LDS", "LDSM"), local=n("LDL", "STL"), bar=n("BAR"))


def inner_loops(sass_text: str) -> list[dict]:
    """Every innermost loop in address order: its instructions per warp and iteration (NOPs aside) and
    its shared-memory stores/loads and local-memory traffic (kernel_cost.loops_of names them)."""
    out = []
    for ops in loop_bodies(sass_text):
        c = _op_counts(ops)
        out.append(dict(instr=len(ops), sts=c["sts"], lds=c["lds"], local=c["local"]))
    return out


def per_token(row) -> Optional[float]:
    """Warp-instructions the SM issues per KV token in the hot loop: the loop's instructions (per warp
    and iteration) x num_warps / the tokens of one iteration. None for kernels without a token loop."""
    name = TOKENS_PER_ITERATION.get(row["kernel"])
    names = name if isinstance(name, tuple) else (name,)
    if not row.get("loop_instr") or any(n not in row["constexprs"] for n in names):
        return None
    return row["loop_instr"] * row["num_warps"] / kernel_cost.items_per_iteration(row, name)


def print_loops_and_budgets(rows):
    """Two more tables: every innermost loop per item, and each variant's step count against its budget."""
    print(f"\n## Every innermost loop (per warp and iteration; per item = x num_warps / items per iteration)\n")
    print("| kernel | case | variant | arch | loop | instr | items/iter | instr per item | STS/LDS | LDL+STL |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        case = row["case"].split("; ")[0]
        for lp in row.get("loops", []):
            per = "-" if lp["per_item"] is None else f"{lp['per_item']:.1f} / {lp['item']}"
            print(f"| {row['kernel']} | {case} | {row['variant']} | {row['arch']} | {lp['name']} | {lp['instr']} | "
                  f"{lp.get('per_iteration', '-')} | {per} | {lp['sts']}/{lp['lds']} | {lp['local']} |")
    st = kernel_cost.STEP
    print(f"\n## One decode step at {st['n_quant'] // 1024}k (Llama-3.1-8B layer: {st['Hkv']} kv heads, k {st['k']}, "
          f"{st['res_len']} residual rows, {st['candidates']} candidates; tools/kernel_cost.py has the trip-count rule)\n")
    print("| kernel | case | variant | arch | programs | warp-instr per step | per item | budget | met |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        step, b = row.get("step"), row.get("budget")
        if not step:
            continue
        bud = f"{b['budget']:g} (worst {b['worst']:.2f})" if b else "-"
        met = ("yes" if b["met"] else "**no**") if b else "-"
        print(f"| {row['kernel']} | {row['case'].split('; ')[0]} | {row['variant']} | {row['arch']} | {step['programs']} | "
              f"{step['step_instr']:,} | {step['per_item']:.2f} / {step['item']} | {bud} | {met} |")


# ---- the cases: the cache configurations the project supports ---------------------------------------
def cases(quick=False):
    """(name, callable) pairs. Each builds a cache of a supported configuration on CPU (cache.py) and
    calls the Triton launchers the way the decode step does, so the launchers choose blocks, bits and
    flags themselves."""
    import quant
    from config import CacheConfig
    from generate import store_class
    from gpu import attention, attn_gluon, topk, transfer
    from siblings import attn_views

    def both_paths(q, store, *args, select=0):  # the word path, and the bit-plane paths where they fit the layout
        if isinstance(store, attn_views.ViewKV):  # a sibling's codes: its one kernel
            return attn_views.attention_views_triton(q, store, *args, select=select)
        M = q.shape[1] // store.k_codes.shape[1] * q.shape[2]
        paths = ("words", "planes") + (("gluon",) if attn_gluon.fits(store, q.shape[-1], M, q.dtype) else ())
        for path in paths if attention.planes_fit(store, q.shape[-1], M) and not quick else ("words",):  # (--quick: the default)
            attention.attention_lowbit_triton(q, store, *args, attn_path=path, select=select)

    def selection(c, cfg, q, token=True):  # the one launch after the attention, as Prefetcher._start_async calls it
        B, Hkv, S = c.k_codes.shape[:3]
        G, T, D = q.shape[1] // Hkv, q.shape[2], q.shape[3]
        R = T if cfg.policy.selects == "both" else 1
        logits, lse = torch.zeros(B, Hkv, G * R, S), torch.zeros(B, Hkv * G, T)[:, :, -R:]
        step = torch.zeros(B, Hkv, T, D, dtype=q.dtype)
        staged = (torch.zeros(B, Hkv, 1, D, dtype=q.dtype), torch.zeros(B, Hkv, 1, D, dtype=q.dtype),
                  torch.zeros((), dtype=torch.long))
        new = (step[:, :, :1], step[:, :, :1], torch.tensor(5), *staged) if token else None
        n = cfg.k * cfg.rerank
        ring = (torch.zeros(B, Hkv, cfg.sinks + cfg.k, dtype=torch.long),
                torch.zeros(B, Hkv, cfg.sinks + cfg.k, dtype=torch.bool))
        keep = (torch.zeros(B, dtype=torch.bool), *ring, cfg.sinks)  # the rows whose ring a resync holds
        row_start = torch.zeros(B, dtype=torch.long)
        if cfg.rerank > 1:  # the candidates, and the query rows re-ranking scores them by
            out = (torch.zeros(B, Hkv, n, dtype=torch.long), torch.zeros(B, Hkv, n, dtype=torch.bool))
            s_q = (q[:, :, -R:], torch.zeros(B, Hkv * G, R, D, dtype=q.dtype), torch.zeros(B, Hkv * G, R))
            topk.select_triton(logits, lse, c.n_quant, n, cfg.sinks, out=out, stage_q=s_q, token=new,
                               row_start=row_start, keep=keep)
        else:
            record = (*ring, cfg.sinks, torch.zeros(B, Hkv, n, dtype=torch.long))
            topk.select_triton(logits, lse, c.n_quant, n, cfg.sinks, record=record, token=new,
                               row_start=row_start, keep=keep)

    def step_case(name, dtype, D, G=4, T=2, S=1024):
        def run():  # (S > 8192: the top-k merges its chunks' candidates in two rounds)
            cfg = CacheConfig.from_name(name)
            c = store_class(cfg.scheme)(1, 2, S, D, dtype, torch.device("cpu"), cfg)
            c.n_quant.fill_(S // 2)
            c.res_len.fill_(3)
            q = torch.zeros(1, 2 * G, T, D, dtype=dtype)
            fetched = None
            if cfg.kind == "specache":
                K = cfg.k
                fetched = quant.Fetched(torch.zeros(1, 2, K, D, dtype=dtype), torch.zeros(1, 2, K, D, dtype=dtype),
                                         torch.zeros(1, 2, K, dtype=torch.int64), torch.ones(1, 2, K, dtype=torch.bool))
            select = 0 if cfg.kind != "specache" else T if cfg.policy.selects == "both" else 1
            both_paths(q, c.stored(), c.residual_rows(T), fetched, c.sm_scale, select=select)
            if cfg.kind == "specache":  # the selection with the step's token, and without (fetch_then_attend's)
                selection(c, cfg, q)
                if not quick:
                    selection(c, cfg, q, token=False)
        return run

    def quantspec_case(dtype, D, gamma=4):
        def run():  # the draft's one-token step over the INT4 view, the verify step over the INT8 view
            from siblings.quantspec import QuantSpecCache
            c = QuantSpecCache(1, 2, 1024, D, dtype, torch.device("cpu"), CacheConfig.from_name("quantspec"), gamma)
            c.n_quant.fill_(512)
            c.res_len.fill_(130)
            for view, T in ((4, 1), (8, gamma + 1)):
                q = torch.zeros(1, 8, T, D, dtype=dtype)
                both_paths(q, c.stored(view), c.residual_rows(T), None, c.sm_scale)
        return run

    def rows_case(dtype, D):
        def run():  # the three ways SpeCache calls the transfer
            host = [torch.zeros(1, 2, 256, D, dtype=dtype) for _ in range(2)]
            ring = [torch.zeros(1, 2, 64, D, dtype=dtype) for _ in range(2)]
            idx, new, pos = torch.zeros(1, 2, 64, dtype=torch.long), torch.zeros(1, 2, 1, D, dtype=dtype), torch.tensor(5)
            transfer.transfer_rows_triton(*host, *ring, idx, new, new, pos)
            transfer.transfer_rows_triton(*host, *ring, idx, None, None, None)
            transfer.transfer_rows_triton(*host, *ring, None, new, new, pos)
            for G, R, new_or_none in ((4, 1, new), (3, 2, None)):  # re-ranking: 128 candidates, k 64 after 4 sinks
                fetch = [torch.zeros(1, 2, 68, D, dtype=dtype), torch.zeros(1, 2, 68, D, dtype=dtype),
                         torch.zeros(1, 2, 68, dtype=torch.long), torch.zeros(1, 2, 68, dtype=torch.bool)]
                transfer.rerank_rows_triton(*host, *fetch, idx.repeat(1, 1, 2), torch.ones(1, 2, 128, dtype=torch.bool),
                                            torch.zeros(1, 2 * G, R, D, dtype=dtype), torch.zeros(1, 2 * G, R),
                                            0.125, new_or_none, new_or_none, pos if new_or_none is not None else None,
                                            ring_off=4)
            # the sinks' launch (a decode step's commit: the residual's first rows, read through its strides)
            res = torch.zeros(1, 2, 66, D, dtype=dtype)
            transfer.keep_sinks_triton(fetch[:2] + [fetch[3]], res[:, :, :64], res[:, :, :64], torch.tensor(0), 4,
                                       torch.zeros(1, dtype=torch.long))
            # union's pre-decoding with re-ranking: one selecting token staged into two rows per head
            q1, lse1 = torch.zeros(1, 8, 1, D, dtype=dtype), torch.zeros(1, 8, 1)
            out = (torch.zeros(1, 2, 128, dtype=torch.long), torch.zeros(1, 2, 128, dtype=torch.bool))
            topk.select_triton(torch.zeros(1, 2, 4, 1024), lse1, torch.tensor(512), 128, 4, out=out,
                               stage_q=(q1, torch.zeros(1, 8, 2, D, dtype=dtype), torch.zeros(1, 8, 2)))
        return run

    def large_k_case(dtype, D, K=512):
        def run():  # k 512 (tests/test_cuda.py fetches every row with it) and the largest re-ranking tile
            record = (torch.zeros(1, 2, 4 + K, dtype=torch.long), torch.zeros(1, 2, 4 + K, dtype=torch.bool), 4,
                      torch.zeros(1, 2, K, dtype=torch.long))
            topk.select_triton(torch.zeros(1, 2, 4, 4096), torch.zeros(1, 8, 1), torch.tensor(2048), K, 4, record=record)
            C = transfer.RERANK_MAX_CANDIDATES
            host = [torch.zeros(1, 2, 4096, D, dtype=dtype) for _ in range(2)]
            ring = [torch.zeros(1, 2, C // 2, D, dtype=dtype) for _ in range(2)] + \
                [torch.zeros(1, 2, C // 2, dtype=torch.long), torch.zeros(1, 2, C // 2, dtype=torch.bool)]
            transfer.rerank_rows_triton(*host, *ring, torch.zeros(1, 2, C, dtype=torch.long), torch.ones(1, 2, C, dtype=torch.bool),
                                    torch.zeros(1, 8, 1, D, dtype=dtype), torch.zeros(1, 8, 1), 0.125)
        return run

    out = [("k512 and the largest re-ranking tile bfloat16", large_k_case(torch.bfloat16, 128))]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dn = str(dtype).replace("torch.", "")
        for bits in (1, 2, 4, 8):
            out.append((f"specache-{bits}bit {dn} D128", step_case(f"specache-{bits}bit", dtype, 128)))
            if not quick:
                out.append((f"kivi-{bits}bit {dn} D128 T1", step_case(f"kivi-{bits}bit", dtype, 128, T=1)))
        out.append((f"specache-8bit-quantspec {dn}", step_case("specache-8bit-quantspec", dtype, 128)))
        out.append((f"quantspec draft/verify {dn}", quantspec_case(dtype, 128)))
        out.append((f"specache-2bit-zipcache {dn}", step_case("specache-2bit-zipcache", dtype, 128)))
        out.append((f"specache-2bit-zipcache-s40-hi4 {dn}", step_case("specache-2bit-zipcache-s40-hi4", dtype, 128)))
        if not quick:
            out.append((f"specache-1bit-zipcache-s50-hi2 {dn} D64", step_case("specache-1bit-zipcache-s50-hi2", dtype, 64)))
        out.append((f"specache-1bit {dn} D64 G3", step_case("specache-1bit", dtype, 64, G=3)))
        out.append((f"specache-1bit {dn} D128 32k", step_case("specache-1bit", dtype, 128, S=32768 + 128)))
        out.append((f"specache-1bit-best-rr2 {dn} D128 32k", step_case("specache-1bit-best-rr2", dtype, 128, S=32768 + 128)))
        out.append((f"rows {dn}", rows_case(dtype, 128)))
    return out


def gate(archs=ARCHS, quick=False, jobs=None, kernels=None, case=None):
    """-> (specs, results). results[i] for (spec, arch); raises nothing: failures are in results.
    kernels: compile only these kernels' variants (recording them all is cheap, compiling is not);
    case: only the cases whose name contains one of these strings."""
    all_cases = cases(quick)
    if case:
        all_cases = [c for c in all_cases if any(x in c[0] for x in case)]
        if not all_cases:
            raise ValueError(f"no case matches {', '.join(case)}")
    specs = record(all_cases)
    if kernels:
        names = sorted({s["kernel"] for s in specs})
        if unknown := [k for k in kernels if k not in names]:
            raise ValueError(f"no kernel named {', '.join(unknown)}; the launchers use: {', '.join(names)}")
        specs = [s for s in specs if s["kernel"] in kernels]
    return specs, compile_all(specs, archs, jobs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, action="append", help="80, 90 (default both)")
    p.add_argument("--quick", action="store_true", help="fewer variants: no KIVI-only attention variants, no bit-plane attention (not the GPU default)")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--sass", default=None, help="print the SASS of the loops of this kernel (first variant)")
    p.add_argument("--kernel", action="append", help="compile only this kernel's variants (repeatable)")
    p.add_argument("--case", action="append", help="only the cases whose name contains this (repeatable), e.g. 'bfloat16 D128'")
    p.add_argument("--json", type=Path, default=None, help="write the report rows here")
    p.add_argument("--no-report", action="store_true", help="only compile (the gate): no ptxas/SASS analysis")
    a = p.parse_args(argv)
    archs = tuple(a.arch or ARCHS)
    t0 = time.perf_counter()
    try:
        specs, results = gate(archs, a.quick, a.jobs, a.kernel, a.case)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows, failed = [], 0
    for r in results:
        s = specs[r["index"]]
        row = dict(kernel=s["kernel"], variant=variant(s), arch=r["arch"], case=s["case"], ok=r["ok"],
                   compile_s=round(r["seconds"], 2), constexprs={k: str(v) for k, v in constexpr_names(s).items()},
                   num_warps=s["num_warps"], num_stages=s["num_stages"],
                   first_ptr=next((t[1:] for t in s["signature"].values() if t.startswith("*")), None))
        if not r["ok"]:
            failed += 1
            row["error"] = r["error"]
        else:
            row["tf32"] = "tf32" in r["ptx"]
        if r["ok"] and not a.no_report:
            text = sass(r["cubin"])
            row.update(resource_usage(r["cubin"]), shared=r["shared"], loop_loads=loop_loads(text),
                       **hot_loop(text, HOT_LOOP.get(s["kernel"], "longest")))
            row["instr_per_token"] = per_token(row)
            every = inner_loops(text)
            row["loops"] = [dict(lp, sts=x["sts"], lds=x["lds"], local=x["local"])
                            for lp, x in zip(kernel_cost.loops_of(row, [x["instr"] for x in every]), every)]
            row["step"] = kernel_cost.per_step(row, sum(op != "NOP" for _, op, _ in instructions(text)), row["loops"])
            row["budget"] = kernel_cost.budget_check(row)
            if a.sass and s["kernel"] == a.sass and not any(x["kernel"] == a.sass and x.get("sass_shown") for x in rows):
                row["sass_shown"] = True
                print(text)
        rows.append(row)
    print(f"# {len(specs)} kernel variants x {len(archs)} targets compiled in {time.perf_counter() - t0:.0f} s "
          f"(triton {triton.__version__}); {failed} failed")
    if not a.no_report:
        print("| kernel | case | variant | arch | regs | local/stack B | smem B | hot loop instr | instr/token | "
              "STS/LDS in loop | smem round trip | LDL+STL in loop | loads in loops (bits: n) | tf32 dot |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if not row["ok"]:
            print(f"FAILED {row['kernel']} [{row['variant']}] sm_{row['arch']} ({row['case']}): {row['error']}")
        elif not a.no_report:
            order = lambda w: (w.startswith("cp"), -int(w.lstrip("cp")))  # noqa: E731
            loads = ", ".join(f"{w}b: {n}" for w, n in sorted(row["loop_loads"].items(), key=lambda x: order(x[0]))) or "-"
            per_tok = f"{row['instr_per_token']:.1f}" if row["instr_per_token"] is not None else "-"
            if "loop_instr" in row:
                hot = (f"{row['loop_instr']} | {per_tok} | {row['sts']}/{row['lds']} | "
                       f"{'yes' if row['smem_roundtrip'] else 'no'} | {row['local']}")
            else:
                hot = "- | - | - | - | -"
            cs = row["case"].split("; ")  # (every case is in the JSON)
            case = "; ".join(cs[:2]) + (f" (+{len(cs) - 2} more)" if len(cs) > 2 else "")
            print(f"| {row['kernel']} | {case} | {row['variant']} | {row['arch']} | {row['registers']} | "
                  f"{row['local_bytes']}/{row['stack']} | {row['shared']} | {hot} | "
                  f"{loads} | {'yes' if row['tf32'] else 'no'} |")
    if not a.no_report:
        print_loops_and_budgets([r for r in rows if r["ok"]])
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
