"""What every decode loop shares (generate.py's and siblings/quantspec.py's): how a token is drawn
(`sample`, `Decoding`), Algorithm 1's chunked prefill, and how a step becomes one compiled graph
(`compiled_step`)."""
import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import torch


# ---- sampling --------------------------------------------------------------------------------------
def sample(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """logits [..., V] -> ids [...]. temperature 0 is greedy. No host sync (exponential race)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


@dataclass(frozen=True)
class Decoding:
    """What to generate: how many tokens, how each is drawn, and when a row ends."""
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: Optional[int] = None  # sampling from the k most likely tokens
    eos_ids: frozenset = frozenset()
    # The loop reads on the host whether every row has ended once per this many steps (a sync, which
    # a CUDA step would otherwise wait on every step); it runs at most this many - 1 steps past the
    # end and drops them. 1 when something reads each token anyway (streaming).
    eos_check_every: int = 8

    def sample(self, logits):
        return sample(logits, self.temperature, self.top_k)


# ---- Algorithm 1 ----------------------------------------------------------------------------------
@torch.no_grad()
def prefill(model, prompt: torch.Tensor, chunk: int = 2048, progress=None) -> torch.Tensor:
    """Algorithm 1. prompt [B, P] -> logits of the last position [B, V] (the model applies its head to that
    row alone). Chunks attend exactly to everything before them (SpeCache reads the earlier chunks back from
    the host store)."""
    P = prompt.shape[1]
    for start in range(0, P, chunk):
        end = min(P, start + chunk)
        pos = torch.arange(start, end, device=prompt.device)
        logits = model(prompt[:, start:end], pos, mode="prefill")
        if progress:
            progress(end, P)
    return logits[:, -1]


# ---- compiled steps --------------------------------------------------------------------------------
def cloned(fn, *args):
    """fn(*args) with its outputs copied: a CUDA graph's outputs are overwritten by its next replay."""
    out = fn(*args)
    return tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone()


class RecompileError(RuntimeError):
    """A compiled step that compiles again call after call: something it reads changes every step."""


def compiled_step(device, fn):
    """`fn` as one fullgraph graph; a CUDA graph on CUDA. Inductor by default drops a 16-bit round trip
    inside a fused kernel (x.to(float16).float() stays fp32); the quantizer picks its codes against the
    16-bit zero and scale it stores (quant.py's least-squares fit), so without emulate_precision_casts
    the compiled least-squares fit stores other zeros than eager's. A recompilation storm is an error
    (`recompile_guard`)."""
    options = {"emulate_precision_casts": True}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (mode and options exclude each other)
    compiled = torch.compile(fn, fullgraph=True, options=options)
    if device.type == "cpu":
        compiled = with_cpp_kernel_args_capped(compiled)
    return recompile_guard(compiled, fn)


def with_cpp_kernel_args_capped(compiled):
    @functools.wraps(compiled)
    def step(*args, **kw):  # (it compiles inside its first call)
        with cpp_kernel_args_capped(128):
            return compiled(*args, **kw)
    return step


def recompile_guard(compiled, fn, storm: int = 3):
    """`compiled` that raises RecompileError when `storm` calls in a row each compile a new graph (the
    first call's compilation aside), or when dynamo's recompile_limit is hit, naming the guard that
    failed. A decode step is one static graph: a graph per step means a Python value it reads changes
    each step (an int position, a counter, a new object) and every step would pay a compilation.
    A new cache configuration recompiles once (tools/eval.py's methods), which is not a storm; 3, not
    2, so that two new configurations in a row that run one step each (--max-new-tokens 2) are not one."""
    import torch._dynamo
    from torch._dynamo import utils as dynamo_utils
    counters = dynamo_utils.counters
    guard_failures = getattr(dynamo_utils, "guard_failures", {})  # {code: [reason, ...]}; a torch without it: no reason
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())  # (fullgraph=True past the limit)
    code = inner_code(fn)
    state = {"calls": 0, "in_a_row": 0}

    def failure(why, seen):
        """The error, with the guard of the newest graph that failed in this call (dynamo records one
        reason per graph it tried, newest first)."""
        reasons = guard_failures.get(code, [])[seen:] or ["(none recorded: rerun with TORCH_LOGS=recompiles)"]
        reason = " ".join(reasons[0].splitlines()[0].split())
        return RecompileError(f"the compiled step {getattr(fn, '__name__', fn)!r} {why}; the guard that failed: {reason}")

    @functools.wraps(fn)
    def step(*args, **kw):
        before, seen = counters["stats"]["unique_graphs"], len(guard_failures.get(code, ()))
        try:
            out = compiled(*args, **kw)
        except limit_hit as e:
            raise failure(f"hit torch._dynamo.config.recompile_limit ({torch._dynamo.config.recompile_limit})", seen) from e
        new = counters["stats"]["unique_graphs"] > before and state["calls"] > 0
        state["calls"] += 1
        state["in_a_row"] = state["in_a_row"] + 1 if new else 0
        if state["in_a_row"] >= storm:
            raise failure(f"compiled a new graph on {storm} calls in a row (a recompilation every step)", seen)
        return out
    return step


def inner_code(fn):
    """The code object dynamo compiles for fn (a function, a functools.partial of one, or a module)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "forward", fn)
    return getattr(fn, "__code__", None)


@contextlib.contextmanager
def cpp_kernel_args_capped(n: int):
    """Inductor's CPU backend writes consecutive loops into one C++ function until it takes 500
    arguments; a long context's step fills one with many layers' cache writes, which gcc can fail to
    compile (docs/results.md: the preset's 8k step). While our steps compile, functions take at most n;
    whatever else the process compiles keeps inductor's default."""
    from torch._inductor.codegen.cpp import CppScheduling
    before = CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = min(before, n)
    try:
        yield
    finally:
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = before
