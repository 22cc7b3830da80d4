"""Generation with a full, KIVI or SpeCache KV cache.

    python generate.py --prompt "What is the capital of France?" --chat          # SpeCache, 1-bit, k=64
    python generate.py --cache full --prompt-file essay.txt --max-new-tokens 64 --compile

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

from cache import FullCache, LowBitCache, MemoryMeter, SpeCache
from model import load_model
from prefetch import Prefetcher

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
def setup_caches(model, cache="specache", batch=1, max_seq_len=None, bits=1, group=64, residual=None, k=64,
                 fetch="speculative", one_bit="improved", track_hits=False, fetch_impl="uva", scheme="kivi"):
    """Attach one cache per layer. Returns (caches, prefetcher or None, meter)."""
    args = model.args
    device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
    max_seq_len = max_seq_len or args.max_seq_len
    dims = (batch, args.n_kv_heads, max_seq_len, args.head_dim, dtype, device)
    meter, prefetcher = MemoryMeter(), None
    if cache == "full":
        caches = model.setup_caches(lambda i: FullCache(*dims, sliding_window=args.sliding_window))
    elif cache in ("kivi", "specache"):
        if args.sliding_window is not None and args.sliding_window < max_seq_len:
            raise SystemExit("error: low-bit caches do not implement sliding-window attention; use --cache full")
        residual = residual or (128 if cache == "kivi" else 64)  # §4.1: SpeCache trades residual for k rows
        low = dict(bits=bits, group=group, residual=residual, one_bit=one_bit, scheme=scheme, meter=meter)
        if cache == "kivi":
            caches = model.setup_caches(lambda i: LowBitCache(*dims, **low))
        else:
            if k < 1:
                raise SystemExit(f"error: --k must be >= 1, got {k}")
            k = min(k, max_seq_len)  # k >= context fetches every row
            prefetcher = Prefetcher(args.n_layers, batch, args.n_kv_heads, max_seq_len, args.head_dim, k,
                                    dtype, device, impl=fetch_impl)
            caches = model.setup_caches(lambda i: SpeCache(i, prefetcher, *dims, k=k, fetch=fetch,
                                                           track_hits=track_hits, **low))
    else:
        raise SystemExit(f"error: unknown --cache {cache!r} (full, kivi, specache)")
    meter.alloc(kv_device_bytes(caches))
    return caches, prefetcher, meter


def kv_device_bytes(caches) -> int:
    return sum(c.device_bytes() for c in caches)


def kv_host_bytes(caches) -> int:
    return sum(c.host_bytes() for c in caches)


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


@torch.no_grad()
def pre_decode(model, t1: torch.Tensor, pos: int) -> torch.Tensor:
    """Algorithm 2. t1 [B] at position pos: records the top-k per layer and starts the fetch.
    Nothing is kept in the cache: T1 is fed again, as the real token, in the first decode step."""
    return model(t1[:, None], torch.tensor([pos], device=t1.device), mode="predecode")[:, 0]


def decode_step(model, tokens: torch.Tensor, input_pos: torch.Tensor, temperature: float = 0.0,
                top_k: int | None = None) -> torch.Tensor:
    """Algorithm 3 (tokens [B, 2] = [T_t, T'_{t+1}]) or a plain decode step (tokens [B, 1]).
    Returns the next tokens [B, T]: column 0 is the output, column 1 the next speculative token."""
    logits = model(tokens, input_pos, mode="decode")
    return sample(logits, temperature, top_k)


# ---- the generation loop ----------------------------------------------------------------------------
@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, speculative: bool, step_fn=decode_step,
             temperature=0.0, top_k=None, eos_ids=(), chunk=2048, on_token=None, progress=None,
             sync=lambda: None, prefill_model=None):
    """prompt [B, P] -> (generated ids [B, N], stats). `speculative` selects the two-token loop;
    `prefill_model` is e.g. a torch.compile'd view of `model` used for prefill only."""
    B, P = prompt.shape
    device = prompt.device
    stats = {"spec_hits": 0, "spec_steps": 0}
    t0 = time.perf_counter()
    last_logits = prefill(prefill_model or model, prompt, chunk, progress)
    token = sample(last_logits, temperature, top_k)  # T1
    sync()
    stats["prefill_s"] = time.perf_counter() - t0
    out = [token]
    if on_token:
        on_token(token)
    t1 = time.perf_counter()
    if speculative:
        spec = sample(pre_decode(model, token, P), temperature, top_k)  # T'2
    pos = torch.tensor([P, P + 1] if speculative else [P], device=device)
    for _ in range(max_new_tokens - 1):
        if eos_ids and all(int(t) in eos_ids for t in token):  # stop once every row ended
            break
        if speculative:
            nxt = step_fn(model, torch.stack([token, spec], 1), pos, temperature, top_k)
            stats["spec_hits"] += int((spec == nxt[:, 0]).sum())  # was T'_{t+1} == T_{t+1}?
            stats["spec_steps"] += B
            token, spec = nxt[:, 0].clone(), nxt[:, 1].clone()
        else:
            token = step_fn(model, token[:, None], pos, temperature, top_k)[:, 0].clone()
        pos = pos + 1
        out.append(token)
        if on_token:
            on_token(token)
    sync()
    n_steps = len(out) - 1
    stats["decode_s"] = time.perf_counter() - t1
    stats["decode_tok_s"] = B * n_steps / stats["decode_s"] if n_steps else 0.0
    stats["spec_exact_hit_rate"] = stats["spec_hits"] / stats["spec_steps"] if stats["spec_steps"] else None
    return torch.stack(out, 1), stats


def topk_hit_rate(caches, against="exact"):
    """Mean over layers and steps of the speculative fetch's top-k hit rate (SpeCache(track_hits=True)):
    against the real token's exact fp16 top-k, or ("lowbit") its own low-bit top-k."""
    total = "hit_sum" if against == "exact" else "hit_sum_lowbit"
    rates = [float(getattr(c, total) / c.hit_steps) for c in caches if getattr(c, "track_hits", False) and c.hit_steps > 0]
    return sum(rates) / len(rates) if rates else None


def compile_step(device):
    mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graph of the whole step
    return torch.compile(decode_step, fullgraph=True, mode=mode)


# ---- CLI ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1, help="the prompt is replicated per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--sample-top-k", type=int, default=None, help="sampling top-k (not SpeCache's --k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="specache", choices=["full", "kivi", "specache"])
    p.add_argument("--bits", type=int, default=1, choices=[1, 2, 4, 8])
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--residual", type=int, default=None, help="fp residual window (default 128 kivi, 64 specache)")
    p.add_argument("--k", type=int, default=64, help="SpeCache: fp16 KV pairs fetched per layer and kv head")
    p.add_argument("--fetch", default="speculative", choices=["speculative", "sequential", "oracle"])
    p.add_argument("--one-bit", default="improved", choices=["improved", "kivi"], help="1-bit zero/scale: eq. 3 or eq. 2")
    p.add_argument("--quant", default="kivi", choices=["kivi", "zipcache", "quantspec"],
                   help="low-bit scheme: KIVI, ZipCache channel-separable values, QuantSpec INT4/INT8 planes (--bits 4|8)")
    p.add_argument("--hit-rate", action="store_true", help="measure the top-k hit rate (extra exact attention per step)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="compile the decode step (fullgraph; CUDA graph on CUDA)")
    p.add_argument("--compile-prefill", action="store_true",
                   help="also compile prefill (dynamic shapes; the low-bit caches' bookkeeping stays eager)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--quiet", action="store_true", help="no streaming text")
    return p.parse_args(argv)


def fail(msg):
    raise SystemExit(f"error: {msg}")


def main(argv=None):
    a = parse_args(argv)
    try:
        device = torch.device(a.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError
        torch.empty(0, device=device)
    except RuntimeError:
        fail(f"device {a.device!r} is not available here")
    if a.threads:
        torch.set_num_threads(a.threads)
    if not (a.checkpoint / "config.json").exists():
        fail(f"no checkpoint at {a.checkpoint} (run `make demo`, or `python convert_hf.py SOURCE --out {a.checkpoint}`)")
    if a.max_new_tokens < 1 or a.batch_size < 1:
        fail("--max-new-tokens and --batch-size must be >= 1")
    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)

    from tokenizer import load_tokenizer
    tok = load_tokenizer(a.checkpoint)
    if a.prompt_file:
        text = sys.stdin.read() if str(a.prompt_file) == "-" else a.prompt_file.read_text()
    else:
        text = a.prompt
    if a.chat:
        text = tok.chat(text)
    ids = tok.encode(text, bos=tok.bos_id is not None and not a.chat)
    cfg = json.loads((a.checkpoint / "config.json").read_text())
    model_max = cfg.get("max_seq_len", 0)
    seq_len = len(ids) + a.max_new_tokens + 1  # +1: the speculative token's slot
    if seq_len > model_max:
        fail(f"prompt ({len(ids)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds the model's max_seq_len {model_max}")

    model = load_model(a.checkpoint, device=device, dtype=dtype)
    try:
        caches, prefetcher, meter = setup_caches(
            model, a.cache, a.batch_size, seq_len, a.bits, a.group, a.residual, a.k, a.fetch, a.one_bit,
            track_hits=a.hit_rate, scheme=a.quant)
    except ValueError as e:
        fail(str(e))
    speculative = a.cache == "specache" and a.fetch == "speculative"
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
    out, stats = generate(model, prompt, a.max_new_tokens, speculative=speculative, step_fn=step_fn,
                          temperature=a.temperature, top_k=a.sample_top_k, eos_ids=tok.eos_ids,
                          chunk=a.prefill_chunk, on_token=on_token, progress=progress, sync=sync,
                          prefill_model=prefill_model)
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
        "cache": a.cache, "bits": a.bits if a.cache != "full" else 16, "k": a.k if a.cache == "specache" else 0,
        "fetch": a.fetch if a.cache == "specache" else None,
        "spec_exact_hit_rate": stats["spec_exact_hit_rate"],
        "topk_hit_rate": topk_hit_rate(caches),
        "topk_hit_rate_lowbit": topk_hit_rate(caches, "lowbit"),
        "bytes_fetched_per_step": prefetcher.bytes_per_step() if prefetcher else 0,
    }
    mib = 2 ** 20
    print(f"[{a.cache}] prefill {len(ids)} tok in {stats['prefill_s']:.2f}s | decode {stats['decode_tok_s']:.2f} tok/s | "
          f"KV device {result['kv_device_bytes'] / mib:.2f} MiB, host {result['kv_host_bytes'] / mib:.2f} MiB, "
          f"fp16 equiv {result['kv_fp16_bytes'] / mib:.2f} MiB", file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    main()
