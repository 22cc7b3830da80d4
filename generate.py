"""Generation with a full, KIVI or SpeCache KV cache.

    python generate.py --prompt "What is the capital of France?" --chat          # SpeCache, 1-bit, k=64
    python generate.py --cache full --prompt-file essay.txt --max-new-tokens 64 --compile
    python generate.py --cache specache-2bit-oracle ...                           # any config.CacheConfig name

Read it next to the paper's appendix A:
  prefill()     Algorithm 1: layer by layer, exact attention, quantize + offload each layer's KV.
  pre_decode()  Algorithm 2: one step with the first output token T1; its attention picks the rows
                the first decoding step needs and starts their fetch; it outputs speculative T'2.
  decode_step() Algorithm 3: feeds [T_t, T'_{t+1}] (shape [B, 2]) through one static-shape graph;
                outputs the real T_{t+1} and the next speculative T'_{t+2}.
KIVI, the full cache and SpeCache's sequential/oracle fetch decode one token per step.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import quant
import quantspec
import tp
from cache import MemoryMeter, build_caches
from config import CacheConfig

ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"


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


# ---- cache construction ------------------------------------------------------------------------------
def setup_caches(model, config: CacheConfig | str = "specache", batch=1, max_seq_len=None, gamma=4):
    """Attach one cache per layer. `config`: a CacheConfig or its name. Returns (caches, prefetcher
    or None, meter). Raises ValueError on a configuration the model or the kernels cannot run."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    meter = MemoryMeter()
    caches, prefetcher = build_caches(model, config, batch, max_seq_len or model.args.max_seq_len, meter, gamma)
    meter.alloc(kv_device_bytes(caches))
    return caches, prefetcher, meter


def kv_device_bytes(caches) -> int:
    return sum(c.device_bytes() for c in caches)


def kv_host_bytes(caches) -> int:
    return sum(c.host_bytes() for c in caches)


def kv_read_bytes(caches, step_tokens: int) -> int:
    """KV bytes one decode step of `step_tokens` tokens reads (each cache's own byte floor)."""
    return sum(c.read_bytes(step_tokens) for c in caches)


def kv_fp16_bytes(model, batch, seq_len) -> int:
    a = model.args
    return 2 * a.n_layers * batch * a.n_kv_heads * seq_len * a.head_dim * 2


# ---- Algorithms 1-3 --------------------------------------------------------------------------------------
@torch.no_grad()
def prefill(model, prompt: torch.Tensor, chunk: int = 2048, progress=None) -> torch.Tensor:
    """Algorithm 1. prompt [B, P] -> logits of the last position [B, V]. Chunks attend exactly to
    everything before them (SpeCache reads the earlier chunks back from the host store)."""
    P = prompt.shape[1]
    for start in range(0, P, chunk):
        end = min(P, start + chunk)
        pos = torch.arange(start, end, device=prompt.device)
        logits = model(prompt[:, start:end], pos, mode="prefill")
        if progress:
            progress(end, P)
    return logits[:, -1]


def pre_decode(model, t1: torch.Tensor, pos) -> torch.Tensor:
    """Algorithm 2. t1 [B] at position pos (an int or a [1] tensor): records the top-k per layer and
    starts the fetch; returns the logits [B, V] of the next (speculative) token. Nothing is kept in
    the cache: T1 is fed again, as the real token, in the next decode step."""
    pos = pos if isinstance(pos, torch.Tensor) else torch.tensor([pos], device=t1.device)
    return model(t1[:, None], pos, mode="predecode")[:, 0]


def decode_step(model, tokens: torch.Tensor, input_pos: torch.Tensor, temperature: float = 0.0,
                top_k: int | None = None):
    """Algorithm 3 (tokens [B, 2] = [T_t, T'_{t+1}]) or a plain decode step (tokens [B, 1]).
    Returns (next tokens [B, T], logits [B, T, V]): column 0 is the output, column 1 the next
    speculative token."""
    logits = model(tokens, input_pos, mode="decode")
    return sample(logits, temperature, top_k), logits


# ---- the generation loop ----------------------------------------------------------------------------
@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, speculative: bool, step_fn=decode_step,
             temperature=0.0, top_k=None, eos_ids=(), chunk=2048, on_token=None, on_step=None, progress=None,
             sync=lambda: None, prefill_model=None, prefill_fn=None, resync=False, predecode_fn=pre_decode):
    """prompt [B, P] -> (generated ids [B, N], stats). `speculative` selects the two-token loop;
    `prefill_model` is e.g. a torch.compile'd view of `model` used for prefill only, and `prefill_fn`
    (model, prompt) -> last logits replaces prefill() altogether (eval.py replays a recorded one).
    `resync` (fetch policy "resync"): whenever the speculative token turns out wrong, pre-decoding
    (Algorithm 2) runs again with the real token, so the next speculative token and the next fetch
    come from it, not from the wrong guess (one extra one-token forward per miss; one host sync per
    step to know).

    on_step(step, logits, token, fed) is called after prefill (step 0, logits of the last prompt
    position, fed None) and after each decode step (logits [B, V] of the real token's row, fed
    [B, T] the tokens the step was fed); `token` [B] is the real token about to be fed next.
    Returning a tensor replaces it (teacher forcing: eval.py's perplexity); the speculative token
    stays the model's own."""
    B, P = prompt.shape
    device = prompt.device
    stats = {"spec_steps": 0}
    spec_hits = torch.zeros((), dtype=torch.int64, device=device)  # on the device: no sync per step
    t0 = time.perf_counter()
    last_logits = prefill_fn(model, prompt) if prefill_fn else prefill(prefill_model or model, prompt, chunk, progress)
    token = sample(last_logits, temperature, top_k)  # T1
    if on_step and (forced := on_step(0, last_logits, token, None)) is not None:
        token = forced
    sync()
    stats["prefill_s"] = time.perf_counter() - t0
    out = [token]
    if on_token:
        on_token(token)
    t1 = time.perf_counter()
    pos = torch.tensor([P, P + 1] if speculative else [P], device=device)
    if speculative or primes_fetch(model):
        spec = sample(predecode_fn(model, token, pos[:1]), temperature, top_k)  # T'2 (lag: only the fetch)
    stats["resyncs"] = 0
    for step in range(1, max_new_tokens):
        if eos_ids and all(int(t) in eos_ids for t in token):  # stop once every row ended
            break
        fed = torch.stack([token, spec], 1) if speculative else token[:, None]
        nxt, logits = step_fn(model, fed, pos, temperature, top_k)
        token = nxt[:, 0].clone(memory_format=torch.contiguous_format)  # (same strides every step: one graph)
        if speculative:
            spec_hits += (spec == token).sum()  # was T'_{t+1} == T_{t+1}?
            stats["spec_steps"] += B
            spec = nxt[:, 1].clone(memory_format=torch.contiguous_format)
        if on_step and (forced := on_step(step, logits[:, 0], token, fed)) is not None:
            token = forced
        pos = pos + 1
        if speculative and resync and bool((fed[:, 1] != token).any()):  # a wrong guess: restart from the real token
            spec = sample(predecode_fn(model, token, pos[:1]), temperature, top_k)
            stats["resyncs"] += 1
        out.append(token)
        if on_token:
            on_token(token)
    sync()
    n_steps = len(out) - 1
    stats["decode_s"] = time.perf_counter() - t1
    stats["decode_tok_s"] = B * n_steps / stats["decode_s"] if n_steps else 0.0
    stats["spec_hits"] = int(spec_hits)
    stats["spec_exact_hit_rate"] = stats["spec_hits"] / stats["spec_steps"] if stats["spec_steps"] else None
    return torch.stack(out, 1), stats


def primes_fetch(model) -> bool:
    """Does the cache want Algorithm 2's pre-decoding before the first step even without a speculative
    token? (SpeCache's lag policy: T1's own rows for the first step, then one step late.)"""
    cache = model.layers[0].attention.kv_cache
    return getattr(cache, "fetch", None) == "lag"


def compile_step(device, fn=decode_step):
    """The decode step (or `fn`, e.g. pre_decode for resync) as one fullgraph graph; a CUDA graph on CUDA.
    Inductor by default drops a 16-bit round trip inside a fused kernel (x.to(float16).float() stays
    fp32); the quantizer picks its codes against the 16-bit zero and scale it stores (quant._lsq_refit),
    so without emulate_precision_casts the compiled least-squares fit stores other zeros than eager's."""
    options = {"emulate_precision_casts": True}
    if device.type == "cpu":
        # Inductor's CPU backend writes consecutive loops into one C++ function until it takes 500
        # arguments: the preset's 8k step filled one with 15 layers' cache writes (1.2 MB of C++) and
        # gcc 12 crashed compiling it (results/bench/ice-8k). Functions of at most 128 arguments build.
        from torch._inductor.codegen.cpp import CppScheduling
        CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM = min(getattr(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM", 128), 128)
    if device.type == "cuda":
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (mode and options exclude each other)
    return torch.compile(fn, fullgraph=True, options=options)


# ---- the loop --------------------------------------------------------------------------------------------
def draft_step(draft, token, input_pos, temperature: float = 0.0):
    """One draft token: token [B] at input_pos [1] -> (next token [B], its distribution [B, V])."""
    logits = draft(token[:, None], input_pos, mode="draft")[:, 0]
    probs = torch.softmax(logits / max(temperature, 1e-6), -1) if temperature > 0 else logits
    return sample(logits, temperature, None), probs


def verify_step(model, tokens, input_pos):
    """The target over [x, d_1..d_g]: logits [B, g+1, V]."""
    return model(tokens, input_pos, mode="verify")


def commit(caches, n):
    for c in caches:
        c.accept(n)


@torch.no_grad()
def generate_quantspec(model, draft, prompt: torch.Tensor, max_new_tokens: int, gamma: int, *, temperature=0.0,
                       eos_ids=(), chunk=2048, on_token=None, steps=None, sync=lambda: None, prefill_fn=None):
    """prompt [1, P] -> (ids [1, N], stats). gamma = 0 is autoregressive decoding by the target over
    the same cache (INT8 view, same buffer policy): the baseline QuantSpec must equal when greedy.
    `steps`: (draft_step, verify_step, commit) to use, e.g. compiled ones (compile_quantspec_steps)."""
    B, P = prompt.shape
    if B != 1:
        raise ValueError("QuantSpec decodes one sequence at a time (acceptance differs per row)")
    d_step, v_step, c_step = steps or (draft_step, verify_step, commit)
    caches = [layer.attention.kv_cache for layer in model.layers]
    device = prompt.device
    t0 = time.perf_counter()
    logits = prefill_fn(model, prompt) if prefill_fn else prefill(model, prompt, chunk)
    x = sample(logits, temperature, None)
    sync()
    stats = dict(prefill_s=time.perf_counter() - t0, drafted=0, accepted=0, rounds=0, gamma=gamma)
    out = [int(x)]
    if on_token:
        on_token(x)
    t1 = time.perf_counter()
    pos = torch.tensor([P], device=device)
    while len(out) < max_new_tokens and not (eos_ids and out[-1] in eos_ids):
        tokens, probs, t = [x], [], x
        for i in range(gamma):
            t, q = d_step(draft, t, pos + i, temperature)
            tokens.append(t)
            probs.append(q)
        fed = torch.stack(tokens, 1)  # [1, gamma + 1]
        logits = v_step(model, fed, pos + torch.arange(gamma + 1, device=device))
        if gamma:
            q = torch.stack(probs, 1) if temperature > 0 else torch.zeros(1, gamma, 1, device=device)
            a, nxt = quantspec.accept(logits, fed[:, 1:], q, temperature, cap=quantspec.boundary_cap(caches[0]))
        else:
            a, nxt = torch.zeros(1, dtype=torch.long, device=device), sample(logits[:, 0], temperature, None)
        c_step(caches, a[0] + 1)  # x, d_1..d_a stay
        n = int(a[0])  # the one sync of the round: the tokens leave the device
        new = fed[0, 1:1 + n].tolist() + [int(nxt[0])]
        stats["drafted"] += gamma
        stats["accepted"] += n
        stats["rounds"] += 1
        for tok in new:
            if len(out) >= max_new_tokens or (eos_ids and out[-1] in eos_ids):
                break
            out.append(tok)
            if on_token:
                on_token(torch.tensor([tok]))
        pos = pos + n + 1
        x = nxt
    sync()
    n_new = len(out) - 1
    stats["decode_s"] = time.perf_counter() - t1
    stats["decode_tok_s"] = n_new / stats["decode_s"] if n_new else 0.0
    stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
    return torch.tensor([out], device=device), stats


def compile_quantspec_steps(device, gamma: int):
    """The draft step, the verify step (gamma + 1 tokens) and the commit, each one fullgraph graph
    (CUDA graphs on CUDA)."""
    d, v, c = (compile_step(device, f) for f in (draft_step, verify_step, commit))
    if device.type != "cuda":
        return d, v, c
    # A CUDA graph's outputs live in its pool and the next replay of the same graph overwrites them:
    # gamma draft steps replay one graph, and each token feeds the next and the verify step. The
    # outputs (a token, a distribution, the logits) are small: copy them out.
    def draft(*a):
        return tuple(x.clone() for x in d(*a))

    def verify(*a):
        return v(*a).clone()
    return draft, verify, c


# ---- CLI ----------------------------------------------------------------------------------------------
def cache_flags(p):
    """The cache options every entry point shares: a name (config.CacheConfig) and field overrides."""
    p.add_argument("--cache", default="specache",
                   help="full | kivi | specache, or a full name such as specache-2bit-oracle (see config.CacheConfig)")
    p.add_argument("--preset", default=None, choices=["paper", "best"],
                   help="SpeCache settings: paper (Algorithm 3, §4.1; the default) or best (what the README's "
                        "measurements favour: resync fetch, 4 sinks, group 32, least-squares zero/scale, "
                        "64 fetched rows re-ranked from 128 low-bit candidates by their fp keys); the name's "
                        "parts and flags win")
    p.add_argument("--bits", type=int, default=None, help="bits per code (default: the name's, else 1)")
    p.add_argument("--group", type=int, default=None, help="quantization group (default 64)")
    p.add_argument("--residual", type=int, default=None, help="fp residual window (default 128 kivi, 64 specache)")
    p.add_argument("--k", type=int, default=None, help="SpeCache: fp16 KV pairs fetched per layer and kv head (64)")
    p.add_argument("--fetch", default=None, help="SpeCache fetch policy: speculative (Algorithm 3, the default), union, "
                   "resync, lag, sequential, oracle (see cache.SpeCache)")
    p.add_argument("--sinks", type=int, default=None, help="SpeCache: first tokens kept in fp16 on the device (0)")
    p.add_argument("--rerank", type=int, default=None,
                   help="SpeCache: low-bit candidates per fetched row, re-ranked by their fp keys read from the host "
                        "(1: off; N: N*k keys + k values cross the bus per layer instead of k + k)")
    p.add_argument("--one-bit", default=None, choices=["improved", "kivi"], help="1-bit zero/scale: eq. 3 or eq. 2")
    p.add_argument("--fit", default=None, choices=quant.FITS,
                   help="low-bit zero/scale: from min/max (eq. 2/3), or their least-squares refit (same bytes)")
    p.add_argument("--quant", default=None, choices=["kivi", "zipcache", "quantspec"],
                   help="low-bit scheme: KIVI, ZipCache channel-separable values, QuantSpec INT4/INT8 planes (--bits 4|8)")
    p.add_argument("--fetch-impl", default=None, choices=["uva", "staged"], help="CUDA host-to-device transfer")
    p.add_argument("--salient-ratio", type=float, default=None,
                   help="ZipCache mixed precision (--quant zipcache): share of tokens kept at --bits-salient (e.g. 0.4)")
    p.add_argument("--bits-salient", type=int, default=None, help="ZipCache: bits of the salient tokens (default --bits + 2)")


def config_from_flags(a) -> CacheConfig:
    return CacheConfig.from_name(a.cache, preset=a.preset, bits=a.bits, group=a.group, residual=a.residual, k=a.k, fetch=a.fetch,
                                 one_bit=a.one_bit, fit=a.fit, scheme=a.quant, fetch_impl=a.fetch_impl, sinks=a.sinks,
                                 rerank=a.rerank, salient=a.salient_ratio, bits_salient=a.bits_salient)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--hf", type=Path, default=None, help="a transformers model directory instead (hf.py: Llama, Mistral, Qwen2/3, ...)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin), UTF-8")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1, help="the prompt is replicated per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples")
    p.add_argument("--sample-top-k", type=int, default=None, help="sample from the k most likely tokens (not SpeCache's --k)")
    p.add_argument("--seed", type=int, default=0)
    cache_flags(p)
    p.add_argument("--method", default="autoregressive", choices=["autoregressive", "quantspec"],
                   help="quantspec: self-speculative decoding over the hierarchical cache (quantspec.py)")
    p.add_argument("--gamma", type=int, default=4, help="QuantSpec: draft tokens per round")
    p.add_argument("--draft-group", type=int, default=32, help="QuantSpec: INT4 weight group of the draft (32-256)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks: run under torchrun --nproc-per-node N "
                   "(the default is torchrun's world size; the flag checks it). docs/tp.md")
    p.add_argument("--compile", action="store_true", help="compile the decode step (fullgraph; CUDA graph on CUDA)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="also compile prefill (dynamic shapes; the low-bit caches' bookkeeping stays eager)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--quiet", action="store_true", help="no streaming text")
    return p.parse_args(argv)


def fail(msg):
    raise SystemExit(f"error: {msg}")


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError
        torch.empty(0, device=device)
    except RuntimeError:
        fail(f"device {name!r} is not available here")
    return device


def read_prompt(a) -> str:
    if not a.prompt_file:
        return a.prompt
    try:
        return sys.stdin.read() if str(a.prompt_file) == "-" else a.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        fail(f"prompt file {a.prompt_file} is not valid UTF-8 ({e.reason} at byte {e.start})")
    except OSError as e:
        fail(f"cannot read prompt file {a.prompt_file}: {e.strerror}")


def check_args(a):
    for flag, value, low in (("--max-new-tokens", a.max_new_tokens, 1), ("--batch-size", a.batch_size, 1),
                             ("--prefill-chunk", a.prefill_chunk, 1), ("--threads", a.threads, 1),
                             ("--sample-top-k", a.sample_top_k, 1)):
        if value is not None and value < low:
            fail(f"{flag} must be >= {low}, got {value}")
    if a.temperature < 0:
        fail(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if a.method == "quantspec":
        if a.gamma < 0:
            fail(f"--gamma must be >= 0, got {a.gamma}")
        if a.batch_size != 1:
            fail("--method quantspec decodes one sequence (--batch-size 1)")
        if a.draft_group not in (32, 64, 128, 256):
            fail(f"--draft-group must be 32, 64, 128 or 256, got {a.draft_group}")
    if a.sample_top_k is not None and a.temperature == 0:
        fail("--sample-top-k needs --temperature > 0 (greedy decoding ignores it)")


def main(argv=None):
    a = parse_args(argv)
    check_args(a)
    try:
        if a.method == "quantspec" and a.cache in ("specache", "kivi", "full"):
            a.cache = "quantspec"  # the method's own cache unless a quantspec name was given
        config = config_from_flags(a)
        if a.method == "quantspec" and config.kind != "quantspec":
            fail("--method quantspec runs on the quantspec cache (--cache quantspec[-gN])")
    except ValueError as e:
        fail(str(e))
    device = tp.init(a.tp, check_device(a.device))
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.hf and (a.compile or a.compile_prefill):
        fail("--compile is not available with --hf (the transformers forward runs eagerly)")
    if a.hf and tp.world() > 1:
        fail("--hf runs on one process: tensor parallelism under torchrun takes converted checkpoints (--checkpoint)")
    if not a.hf and not (a.checkpoint / "config.json").exists():
        fail(f"no checkpoint at {a.checkpoint} (run `make demo`, or `python convert_hf.py SOURCE --out {a.checkpoint}`)")
    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)

    from tokenizer import load_tokenizer
    try:
        if a.hf:
            import hf
            model, tok = hf.load(a.hf, device, dtype)
        else:
            tok = load_tokenizer(a.checkpoint)
            model = tp.load_model(a.checkpoint, device=device, dtype=dtype)  # this rank's slices under torchrun
    except ValueError as e:
        fail(str(e))
    text = read_prompt(a)
    if not text.strip():
        fail("the prompt is empty")
    ids = tok.encode_prompt(text, chat=a.chat)
    seq_len = len(ids) + a.max_new_tokens + 1 + (a.gamma if a.method == "quantspec" else 0)  # + lookahead slots
    if seq_len > model.args.max_seq_len:
        fail(f"prompt ({len(ids)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds the model's max_seq_len "
             f"{model.args.max_seq_len}")
    try:
        caches, prefetcher, meter = setup_caches(model, config, a.batch_size, seq_len, gamma=max(a.gamma, 1))
    except ValueError as e:
        fail(str(e))
    step_fn = compile_step(device) if a.compile else decode_step
    prefill_model = torch.compile(model, dynamic=True) if a.compile_prefill else model
    prompt = torch.tensor([ids] * a.batch_size, device=device)

    streamed, ended = [], []
    def on_token(t):  # stream row 0 until its first eos
        if a.quiet or ended or int(t[0]) in tok.eos_ids:
            ended.append(True)
            return
        before = tok.decode(streamed)
        streamed.append(int(t[0]))
        sys.stdout.write(tok.decode(streamed)[len(before):])
        sys.stdout.flush()

    def progress(done, total):
        if total > a.prefill_chunk:
            print(f"\rprefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    resync = config.kind == "specache" and config.fetch == "resync"
    if a.method == "quantspec":
        draft = quantspec.make_draft(model, a.draft_group)
        quantspec.share_caches(draft, model)
        out, stats = generate_quantspec(
            model, draft, prompt, a.max_new_tokens, a.gamma, temperature=a.temperature, eos_ids=tok.eos_ids,
            chunk=a.prefill_chunk, on_token=on_token, sync=sync,
            steps=compile_quantspec_steps(device, a.gamma) if a.compile else None)
        stats.update(spec_exact_hit_rate=None, resyncs=0)
    else:
        out, stats = generate(model, prompt, a.max_new_tokens, speculative=config.two_tokens, step_fn=step_fn,
                          temperature=a.temperature, top_k=a.sample_top_k, eos_ids=tok.eos_ids,
                          chunk=a.prefill_chunk, on_token=on_token, progress=progress, sync=sync,
                          prefill_model=prefill_model, resync=resync,
                          predecode_fn=compile_step(device, pre_decode) if a.compile and resync else pre_decode)
        stats.update(acceptance_rate=None)
    rows = [[int(x) for x in row] for row in out]
    for row in rows:  # cut at the first eos
        for i, t in enumerate(row):
            if t in tok.eos_ids:
                del row[i:]
                break
    text_out = tok.decode(rows[0])
    if not a.quiet:
        print()
    result = {
        "text": text_out,
        "tokens": rows[0] if a.batch_size == 1 else rows,
        "prompt_tokens": len(ids),
        "prefill_s": round(stats["prefill_s"], 4),
        "decode_tok_s": round(stats["decode_tok_s"], 3),
        "kv_device_bytes": kv_device_bytes(caches),
        "kv_host_bytes": kv_host_bytes(caches),
        "kv_fp16_bytes": kv_fp16_bytes(model, a.batch_size, seq_len),
        "kv_peak_prefill_device_bytes": meter.peak,
        "cache": config.name, "config": config.as_dict(),
        "spec_exact_hit_rate": stats["spec_exact_hit_rate"], "resyncs": stats["resyncs"],
        "method": a.method, "acceptance_rate": stats["acceptance_rate"],
        "gamma": a.gamma if a.method == "quantspec" else None,
        "bytes_fetched_per_step": prefetcher.bytes_per_step() if prefetcher else 0,
    }
    mib = 2 ** 20
    print(f"[{config.name}] prefill {len(ids)} tok in {stats['prefill_s']:.2f}s | decode {stats['decode_tok_s']:.2f} tok/s | "
          f"KV device {result['kv_device_bytes'] / mib:.2f} MiB, host {result['kv_host_bytes'] / mib:.2f} MiB, "
          f"fp16 equiv {result['kv_fp16_bytes'] / mib:.2f} MiB", file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    tp.main(main)
