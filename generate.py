"""Generation with a full, KIVI or SpeCache KV cache.

    python generate.py --checkpoint checkpoints/smollm2-135m-instruct --bits 1 --k 64 --prompt "..."
    python generate.py --cache full --prompt-file essay.txt --max-new-tokens 64 --compile
    python generate.py --cache specache-2bit-oracle ...                           # any config.CacheConfig name

Read it next to the paper's appendix A:
  prefill()     Algorithm 1 (decoding.py, shared with QuantSpec's loop): layer by layer, exact
                attention, quantize + offload each layer's KV.
  pre_decode()  Algorithm 2: one step with the first output token T1; its attention picks the rows
                the first decoding step needs and starts their fetch; it outputs speculative T'2.
  decode_step() Algorithm 3: feeds [T_t, T'_{t+1}] (shape [B, 2]) through one static-shape graph;
                outputs the real T_{t+1} and the next speculative T'_{t+2}.
  generate()    the loop around them; the caches' fetch policy (config.FetchPolicy) says how many tokens a
                step feeds (KIVI, the full cache and SpeCache's sequential/oracle fetch: one) and whether
                pre-decoding runs (again, after a wrong guess: `resync`).
Before them, setup_caches gives a model the caches of a configuration (the siblings' quantizers and the
baselines' caches come from their folders, imported when a configuration asks for them). After them:
hf_generate() runs the loop inside a transformers model (integrations/hf.py), and the command line (main,
run) runs it or QuantSpec's loop.
"""
import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

import cache
import config as cache_config
from cache import fetch_policy, hold_fetched
from config import DEFAULT_ATTN_PATH, CacheConfig
from decoding import Decoding, compiled_step, prefill, sample
from quant import kv_fp16_bytes

ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"


# ---- the caches of every configuration -----------------------------------------------------------------
def store_class(scheme: str) -> type:
    """The cache class of a quantizer (config.scheme): KIVI's is cache.LowBitCache; a sibling's subclasses it in
    its own module, imported here when a configuration names it."""
    if scheme == "zipcache":
        from siblings.zipcache import ZipCache
        return ZipCache
    if scheme == "quantspec":
        from siblings.quantspec import HierCache
        return HierCache
    return cache.LowBitCache


def setup_caches(model, config: CacheConfig | str = "specache", batch: int = 1, max_seq_len=None,
                 row_start=None) -> cache.KVCaches:
    """Give every layer of `model` the cache of `config` (a CacheConfig or its name): cache.setup_caches over
    the configuration's quantizer's cache class, or a block-retrieval baseline's own caches. QuantSpec's cache
    is shared with its draft: siblings.quantspec.setup_caches builds it. row_start [B]: a left-padded batch's
    first real slot per row (prompts of different lengths): the full, KIVI and SpeCache caches over KIVI's
    quantizer take it; the siblings' quantizers and the baselines refuse a batch with padding."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if config.kind == "quantspec":
        raise ValueError("the quantspec cache is shared with QuantSpec's draft: build it with "
                         "siblings.quantspec.setup_caches")
    padded = row_start is not None and bool(torch.as_tensor(row_start).any())
    retrieval = config.kind in ("quest", "infllm")
    if padded and (retrieval or config.scheme != "kivi"):
        raise ValueError(f"cache {config.name}: runs a batch of one prompt length only (prompts of different "
                         f"lengths need the full, KIVI or SpeCache cache over KIVI's quantizer)")
    if retrieval:
        from baselines import infllm, quest
        return (quest if config.kind == "quest" else infllm).setup_caches(model, config, batch, max_seq_len)
    return cache.setup_caches(model, config, batch, max_seq_len, store=store_class(config.scheme), row_start=row_start)


# ---- Algorithms 2 and 3 ---------------------------------------------------------------------------------
def pre_decode(model, t1: torch.Tensor, pos) -> torch.Tensor:
    """Algorithm 2. t1 [B] at position pos (an int or a [1] tensor): records the top-k per layer and
    starts the fetch; returns the logits [B, V] of the next (speculative) token. Nothing is kept in
    the cache: T1 is fed again, as the real token, in the next decode step."""
    pos = pos if isinstance(pos, torch.Tensor) else torch.tensor([pos], device=t1.device)
    return model(t1[:, None], pos, mode="predecode")[:, 0]


def decode_step(model, tokens: torch.Tensor, input_pos: torch.Tensor, temperature=0.0, top_k=None):
    """Algorithm 3 (tokens [B, 2] = [T_t, T'_{t+1}]) or a plain decode step (tokens [B, 1]).
    Returns (next tokens [B, T], logits [B, T, V]): column 0 is the output, column 1 the next
    speculative token."""
    logits = model(tokens, input_pos, mode="decode")
    return sample(logits, temperature, top_k), logits


@dataclass(frozen=True)
class Steps:
    """What runs each forward of the loop: the eager functions above (the default), their compiled
    graphs (`compiled`), or a stand-in (tools/eval.py replays a recorded prefill)."""
    prefill: Callable = prefill  # (model, prompt) -> last logits [B, V]
    pre_decode: Callable = pre_decode
    decode: Callable = decode_step

    def compiled(self, device, pre_decode=False) -> "Steps":
        """The decode-time forwards as fullgraph graphs (CUDA graphs on CUDA), pre-decoding too if asked (resync)."""
        return replace(self, pre_decode=compiled_step(device, self.pre_decode) if pre_decode else self.pre_decode,
                       decode=compiled_step(device, self.decode))


# ---- the generation loop ----------------------------------------------------------------------------
@torch.no_grad()
def generate(model, prompt: torch.Tensor, decoding: Decoding, steps: Steps = Steps(), on_step=None):
    """prompt [B, P] -> (generated ids [B, N], stats), over the caches set up on `model`, by their fetch
    policy (cache.fetch_policy): Algorithm 1, Algorithm 2 when the policy pre-decodes, then decode steps
    of policy.step_tokens tokens until decoding.max_new_tokens or every row has produced an eos token
    (the ids stop after the last row's). With the resync policy, whenever a row's speculative token turns
    out wrong, pre-decoding runs again with the real token, so that row's next speculative token and next
    fetch come from it, not from the wrong guess; the rows that guessed right keep theirs (cache.hold_fetched),
    so a row decodes in a batch as it does alone (one more one-token forward per step with a miss, one sync a
    step). A left-padded batch of different prompts: the caches' row_start (setup_caches) says where each
    row's prompt starts.

    on_step(step, logits, token, fed) is called after prefill (step 0, logits of the last prompt
    position, fed None) and after each decode step (logits [B, V] of the real token's row, fed
    [B, T] the tokens the step was fed); `token` [B] is the real token about to be fed next.
    Returning a tensor replaces it (teacher forcing: tools/eval.py's perplexity); the speculative
    token stays the model's own."""
    B, P = prompt.shape
    device = prompt.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    policy = fetch_policy(model)
    two = policy.step_tokens == 2
    stats = {"spec_steps": 0, "resyncs": 0}
    spec_hits = torch.zeros((), dtype=torch.int64, device=device)  # on the device: no sync per step
    eos = torch.tensor(sorted(decoding.eos_ids), device=device) if decoding.eos_ids else None
    ended_at = torch.full((B,), -1, dtype=torch.int64, device=device)  # index of each row's first eos
    t0 = time.perf_counter()
    last_logits = steps.prefill(model, prompt)  # Algorithm 1
    token = decoding.sample(last_logits)  # T1
    if on_step and (forced := on_step(0, last_logits, token, None)) is not None:
        token = forced
    sync()
    stats["prefill_s"] = time.perf_counter() - t0
    out = [token]
    t1 = time.perf_counter()
    pos = torch.tensor([P, P + 1] if two else [P], device=device)
    if policy.pre_decode:  # Algorithm 2: T'2 (lag: only the fetch)
        spec = decoding.sample(steps.pre_decode(model, token, pos[:1]))
    step = 0
    for step in range(1, decoding.max_new_tokens):
        if eos is not None:
            ended_at = torch.where((ended_at < 0) & torch.isin(token, eos), step - 1, ended_at)
            if step % decoding.eos_check_every == 0 and bool((ended_at >= 0).all()):  # the host sync
                break
        fed = torch.stack([token, spec], 1) if two else token[:, None]
        nxt, logits = steps.decode(model, fed, pos, decoding.temperature, decoding.top_k)  # Algorithm 3
        token = nxt[:, 0].clone(memory_format=torch.contiguous_format)  # (same strides every step: one graph)
        if two:
            spec_hits += (spec == token).sum()  # was T'_{t+1} == T_{t+1}?
            stats["spec_steps"] += B
            spec = nxt[:, 1].clone(memory_format=torch.contiguous_format)
        if on_step and (forced := on_step(step, logits[:, 0], token, fed)) is not None:
            token = forced
        pos = pos + 1
        more = step < decoding.max_new_tokens - 1  # (after the last step no fetch is needed)
        if policy.resync and two and more:  # a wrong guess: restart from the real token
            right = fed[:, 1] == token
            if not bool(right.all()):  # (the rows that guessed right keep their fetch and their next guess)
                hold_fetched(model, right)
                spec = torch.where(right, spec, decoding.sample(steps.pre_decode(model, token, pos[:1])))
                hold_fetched(model, None)
                stats["resyncs"] += 1
        out.append(token)
    sync()
    stats["decode_s"] = time.perf_counter() - t1
    stats["decode_steps"] = n_steps = len(out) - 1
    stats["decode_tok_s"] = B * n_steps / stats["decode_s"] if n_steps else 0.0
    stats["spec_hits"] = int(spec_hits)
    stats["spec_exact_hit_rate"] = stats["spec_hits"] / stats["spec_steps"] if stats["spec_steps"] else None
    ids = torch.stack(out, 1)
    if eos is not None:  # the steps past the last row's eos (read every few steps) are dropped
        ended_at = torch.where((ended_at < 0) & torch.isin(token, eos), len(out) - 1, ended_at)
        if bool((ended_at >= 0).all()):
            ids = ids[:, :int(ended_at.max()) + 1]
    return ids, stats


# ---- transformers models: model.generate(ids, custom_generate=generate.hf_generate, ...) -------------------
# (Here, not in integrations/hf.py: this loop is the one hf_generate runs, and hf.py imports nothing above it.)
def hf_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                synced_gpus=False, streamer=None, cache_config="specache", prefill_chunk=2048, stream=None,
                compile=False, **model_kwargs):
    """The decode loop for `model.generate(input_ids, custom_generate=generate.hf_generate, cache_config=NAME,
    ...)`: generate() over fresh caches of `cache_config` (a config.CacheConfig or its name, e.g.
    "specache-1bit-best", "kivi-2bit", "full") inside the transformers model (hf.HFModel). Honours
    max_new_tokens/max_length, eos_token_id, a left-padded batch's attention_mask (the rows' first real
    slots: cache.setup_caches' row_start), greedy decoding and sampling's temperature/top-k/top-p/min-p;
    other logits processors and stopping criteria raise hf.HFError. transformers 5.23 hands a custom_generate
    callable only the keyword arguments its own loop does not take: pass the streamer as `stream=`.
    compile=True: the decode step as one fullgraph graph, as --compile (Steps.compiled). -> [B, P + N] ids"""
    from integrations import hf

    config = CacheConfig.from_name(cache_config) if isinstance(cache_config, str) else cache_config
    hf.check_generation(config, logits_processor, stopping_criteria, generation_config)
    if compile:
        config.check_compiled()
    B, P = input_ids.shape
    pad = hf.left_padding(model_kwargs.get("attention_mask"), B, P)  # None: no padding
    prev = model.config._attn_implementation
    view = hf.HFModel(model)
    decoding = hf.generation_decoding(generation_config, P, streaming=streamer is not None or stream is not None)
    max_seq_len = P + decoding.max_new_tokens + 1
    setup_caches(view, config, B, max_seq_len, row_start=pad)  # (a left-padded batch: each row's first real slot)
    if streamer is None and stream is not None:
        streamer = stream
        streamer.put(input_ids.cpu())  # what generate() does before the loop for its own `streamer`
    on_step = (lambda step, logits, token, fed: streamer.put(token.cpu())) if streamer is not None else None
    try:
        warped = generation_config.do_sample and len(logits_processor or [])
        steps = Steps().compiled(input_ids.device, config.policy.resync) if compile else Steps()
        out, _ = generate(hf.Warped(view, logits_processor) if warped else view, input_ids, decoding,
                          replace(steps, prefill=functools.partial(prefill, chunk=prefill_chunk)), on_step)
    finally:
        model.set_attn_implementation(prev)
    if streamer is not None:
        streamer.end()
    out = hf.pad_after_eos(out, decoding.eos_ids, generation_config.pad_token_id)
    return torch.cat([input_ids, out], 1)


# ---- the command line: its flags, their checks, the model and prompts they name; --method picks the loop ---
def parse_args(argv=None, description=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help=f"a converted checkpoint (default {DEFAULT_CHECKPOINT.relative_to(ROOT)})")
    p.add_argument("--hf", type=Path, default=None, help="a transformers model directory instead (integrations/hf.py: Llama, Mistral, Qwen2/3, ...)")
    add_prompt_flags(p)
    p.add_argument("--batch-size", type=int, default=1, help="the prompt is replicated per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples")
    p.add_argument("--sample-top-k", type=int, default=None, help="sample from the k most likely tokens (not SpeCache's --k)")
    p.add_argument("--seed", type=int, default=0)
    cache_config.add_cache_flags(p)
    p.add_argument("--method", default="autoregressive", choices=["autoregressive", "quantspec"],
                   help="quantspec: self-speculative decoding over the hierarchical cache (siblings/quantspec.py)")
    p.add_argument("--gamma", type=int, default=4, help="QuantSpec: draft tokens per round")
    p.add_argument("--draft-group", type=int, default=32, help="QuantSpec: INT4 weight group of the draft (32-256)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks: run under torchrun --nproc-per-node N "
                   "(the default is torchrun's world size; the flag checks it). docs/tp.md")
    p.add_argument("--compile", action="store_true", help="compile the decode step (fullgraph; CUDA graph on CUDA)")
    p.add_argument("--compile-prefill", action="store_true", help="also compile prefill (dynamic shapes; caches stay eager)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--quiet", action="store_true", help="no streaming text")
    return p.parse_args(argv)


def add_prompt_flags(p):
    """The prompt's flags (the vLLM entry takes them too: integrations/specache_vllm)."""
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin), UTF-8")
    p.add_argument("--prompts-file", type=Path, help="a batch of different prompts, JSON Lines: one a line, a string "
                   '(text; --chat wraps it), {"text": ...}, or a chat turn {"role": "user", "content": ...}')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)


def check_args(a):
    for flag, value, low in (("--max-new-tokens", a.max_new_tokens, 1), ("--batch-size", a.batch_size, 1),
                             ("--prefill-chunk", a.prefill_chunk, 1), ("--threads", a.threads, 1),
                             ("--sample-top-k", a.sample_top_k, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if a.method == "quantspec":
        from siblings import quantspec
        quantspec.check_args(a.gamma, a.batch_size, a.draft_group)
    if a.sample_top_k is not None and a.temperature == 0:
        raise ValueError("--sample-top-k needs --temperature > 0 (greedy decoding ignores it)")
    if a.hf and a.checkpoint:
        raise ValueError("--hf DIR and --checkpoint DIR both name the model: give one")
    if a.hf and a.compile_prefill:
        raise ValueError("--compile-prefill is not available with --hf (--compile compiles its decode step)")
    if a.prompts_file is not None:
        if a.prompt_file is not None:
            raise ValueError("--prompts-file and --prompt-file both name the prompt: give one")
        if a.batch_size != 1:
            raise ValueError("--prompts-file: the batch is its prompts, one a row (drop --batch-size)")
        if a.method == "quantspec":
            raise ValueError("--prompts-file: QuantSpec's loop runs one prompt (batch 1)")


def cache_of(a) -> CacheConfig:
    """The cache the flags name; --method quantspec runs on its own cache."""
    if a.method == "quantspec" and a.cache in ("specache", "kivi", "full"):
        a.cache = "quantspec"  # the method's own cache unless a quantspec name was given
    config = cache_config.from_flags(a)
    if a.method == "quantspec" and config.kind != "quantspec":
        raise ValueError("--method quantspec runs on the quantspec cache (--cache quantspec[-gN])")
    return config


def check_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError
        torch.empty(0, device=device)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not available here")
    return device


def dtype_of(a, device: torch.device) -> torch.dtype:
    return getattr(torch, a.dtype) if a.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)


def load(a, device, dtype, tp=None):
    """(model, tokenizer) of --checkpoint (under torchrun, `tp`: this rank's slices) or --hf."""
    from model import load_model
    from tokenizer import load_tokenizer
    if a.hf:
        if tp is not None and tp.world() > 1:
            raise ValueError("--hf runs on one process: tensor parallelism under torchrun takes converted checkpoints (--checkpoint)")
        from integrations import hf
        return hf.load(a.hf, device, dtype)
    ckpt = a.checkpoint or DEFAULT_CHECKPOINT
    if not (ckpt / "config.json").exists():
        raise ValueError(f"no checkpoint at {ckpt} (run `make demo`, or `python convert_hf.py SOURCE --out {ckpt}`)")
    return (tp.load_model if tp is not None else load_model)(ckpt, device=device, dtype=dtype), load_tokenizer(ckpt)


def read_prompt(a) -> str:
    if not a.prompt_file:
        return a.prompt
    try:
        return sys.stdin.read() if str(a.prompt_file) == "-" else a.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {a.prompt_file} is not valid UTF-8 ({e.reason} at byte {e.start})")
    except OSError as e:
        raise ValueError(f"cannot read prompt file {a.prompt_file}: {e.strerror}")


def read_prompts(path: Path) -> list[tuple[str, bool]]:
    """The prompts of a JSON Lines file: [(text, is a chat turn)], one per line. ValueError naming the line
    for an unreadable file, a line that is not UTF-8, empty or not valid JSON, or a prompt that is empty."""
    import json
    try:
        raw = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read prompts file {path}: {e.strerror}")
    out = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if n == raw.count(b"\n") + 1 and not line.strip():
            break  # (the newline that ends the last line)
        where = f"prompts file {path} line {n}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} is not valid UTF-8 ({e.reason} at byte {e.start})")
        if not text.strip():
            raise ValueError(f"{where} is empty (one prompt a line)")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg} at column {e.colno})")
        if isinstance(value, dict) and set(value) == {"text"} and isinstance(value["text"], str):
            value = value["text"]
        if isinstance(value, str):
            prompt = (value, None)
        elif (isinstance(value, dict) and value.get("role") == "user" and isinstance(value.get("content"), str)
              and set(value) == {"role", "content"}):
            prompt = (value["content"], True)
        else:
            raise ValueError(f'{where}: a prompt is a JSON string, {{"text": ...}} or {{"role": "user", "content": ...}}')
        if not prompt[0].strip():
            raise ValueError(f"{where}: the prompt is empty")
        out.append(prompt)
    if not out:
        raise ValueError(f"prompts file {path} holds no prompt")
    return out


def prompts_ids(a, tok, prompts, max_seq_len: int) -> tuple:
    """(each prompt's token ids, the positions the batch's caches hold: the longest prompt, new tokens, one
    step's lookahead). A chat turn takes the chat template; text takes it with --chat."""
    rows = [tok.encode_prompt(text, chat=a.chat if chat is None else chat) for text, chat in prompts]
    P = max(len(r) for r in rows)
    seq_len = P + a.max_new_tokens + 1
    for n, r in enumerate(rows, 1):
        if len(r) + a.max_new_tokens + 1 > max_seq_len:
            raise ValueError(f"prompts file {a.prompts_file} line {n}: the prompt ({len(r)} tokens) + --max-new-tokens "
                             f"({a.max_new_tokens}) exceeds the model's max_seq_len {max_seq_len}")
    return rows, seq_len


def left_padded(rows: list, pad_id: int, device) -> tuple:
    """Prompts of different lengths as one batch: [B, P] ids padded on the left to the longest, and each row's
    first real slot [B] (cache.setup_caches' row_start)."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows], device=device)
    return ids, torch.tensor([P - len(r) for r in rows], device=device)


def prompt_ids(a, tok, max_seq_len: int) -> tuple:
    """(the prompt's token ids, the positions its caches hold: prompt, new tokens, one step's lookahead)."""
    text = read_prompt(a)
    if not text.strip():
        raise ValueError("the prompt is empty")
    ids = tok.encode_prompt(text, chat=a.chat)
    seq_len = len(ids) + a.max_new_tokens + 1 + (a.gamma if a.method == "quantspec" else 0)  # + a round's drafts
    if seq_len > max_seq_len:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({a.max_new_tokens}) exceeds the model's max_seq_len "
                         f"{max_seq_len}")
    return ids, seq_len


def main(argv=None):
    """The CLI: bad input (a ValueError) ends with one `error:` line and exit code 1."""
    a = parse_args(argv, __doc__)
    try:
        return run(a)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def run_autoregressive(model, config, prompt, max_seq_len: int, decoding: Decoding, prefill_fn, compile=False,
                       on_token=None, row_start=None):
    """generate.py's default method: caches of `config`, then generate() -> (caches, ids, stats). row_start [B]:
    a left-padded batch of different prompts (each row's first real slot)."""
    caches = setup_caches(model, config, prompt.shape[0], max_seq_len, row_start=row_start)
    steps = Steps(prefill=prefill_fn)
    steps = steps.compiled(prompt.device, pre_decode=config.policy.resync) if compile else steps
    on_step = None if on_token is None else (lambda step, logits, token, fed: on_token(token))
    return (caches, *generate(model, prompt, decoding, steps, on_step))


def run(a):
    check_args(a)
    config = cache_of(a)
    if a.compile:
        config.check_compiled()
    tp = torchrun(a)
    device = check_device(a.device) if tp is None else tp.init(a.tp, check_device(a.device))
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    listed = read_prompts(a.prompts_file) if a.prompts_file is not None else None  # (its errors before the model)
    model, tok = load(a, device, dtype_of(a, device), tp)
    row_start = None
    if listed is None:
        ids, seq_len = prompt_ids(a, tok, model.args.max_seq_len)
        prompt = torch.tensor([ids] * a.batch_size, device=device)
        prompt_lens = [len(ids)] * a.batch_size
    else:  # different prompts: one left-padded batch, each row at its own positions (cache.setup_caches' row_start)
        rows, seq_len = prompts_ids(a, tok, listed, model.args.max_seq_len)
        prompt, row_start = left_padded(rows, 0, device)  # (the padding is never attended: any id)
        prompt_lens, ids = [len(r) for r in rows], rows[0]
        a.batch_size = len(rows)
    rank = tp.rank() if tp is not None else 0
    quiet = a.quiet or rank > 0  # one rank prints
    streamed, ended = [], []

    def stream(t):  # row 0 until its first eos
        if quiet or ended or int(t[0]) in tok.eos_ids:
            ended.append(True)
            return
        before = tok.decode(streamed)
        streamed.append(int(t[0]))
        sys.stdout.write(tok.decode(streamed)[len(before):])
        sys.stdout.flush()

    def progress(done, total):
        if total > a.prefill_chunk and not quiet:
            print(f"\rprefill {done}/{total} tokens", end="" if done < total else "\n", file=sys.stderr, flush=True)

    prefill_model = torch.compile(model, dynamic=True) if a.compile_prefill else model
    fill = lambda m, p: prefill(prefill_model, p, a.prefill_chunk, progress)  # noqa: E731
    decoding = Decoding(a.max_new_tokens, a.temperature, a.sample_top_k, frozenset(tok.eos_ids),
                        eos_check_every=Decoding.eos_check_every if quiet else 1)
    on_token = None if quiet else stream
    if a.method == "quantspec":  # its own caches, draft and loop (siblings/quantspec.py)
        from siblings import quantspec
        caches, out, stats = quantspec.run(model, config, prompt, seq_len, a.gamma, a.draft_group, decoding, fill,
                                           a.compile, on_token)
    else:
        caches, out, stats = run_autoregressive(model, config, prompt, seq_len, decoding, fill, a.compile, on_token,
                                                row_start)
    rows = [[int(x) for x in row] for row in out]
    for row in rows:  # cut at the first eos
        for i, t in enumerate(row):
            if t in tok.eos_ids:
                del row[i:]
                break
    result = {
        "text": tok.decode(rows[0]), "tokens": rows[0] if a.batch_size == 1 and listed is None else rows,
        "prompt_tokens": len(ids) if listed is None else prompt_lens,
        "prefill_s": round(stats["prefill_s"], 4), "decode_tok_s": round(stats["decode_tok_s"], 3),
        # device bytes in a 16-bit deployment (quant.deployed_nbytes), and as this run holds them
        "kv_device_bytes": caches.deployed_bytes(), "kv_device_bytes_as_run": caches.device_bytes(),
        "kv_host_bytes": caches.host_bytes(),
        "kv_fp16_bytes": kv_fp16_bytes(model.args, a.batch_size, seq_len),
        "kv_peak_prefill_device_bytes": caches.meter.peak, "cache": config.name, "config": config.as_dict(),
        "attn_path": None if config.kind == "full" else "torch" if device.type != "cuda" else  # (Triton on CUDA)
        config.attn_path or DEFAULT_ATTN_PATH,
        # each method's own figures: SpeCache's speculative tokens, QuantSpec's drafts (None for the other)
        "spec_exact_hit_rate": stats.get("spec_exact_hit_rate"), "resyncs": stats.get("resyncs", 0),
        "method": a.method, "acceptance_rate": stats.get("acceptance_rate"), "gamma": stats.get("gamma"),
        # bus bytes a step, the same two ways
        "bytes_fetched_per_step": caches.fetch_bytes_per_step(deployed=True),
        "bytes_fetched_per_step_as_run": caches.fetch_bytes_per_step()}
    if listed is not None:  # one output per prompt, in the file's order
        result["texts"] = [tok.decode(r) for r in rows]
    if rank > 0:
        return result
    if not a.quiet:
        print()
        for n, text in enumerate(result.get("texts", [])[1:], 2):  # (row 0 was streamed)
            print(f"--- prompt {n} ---\n{text}")
    mib = 2 ** 20
    attn = f", attention {result['attn_path']}" if result["attn_path"] else ""
    print(f"[{config.name}{attn}] prefill {len(ids) if listed is None else sum(prompt_lens)} tok in {stats['prefill_s']:.2f}s | decode {stats['decode_tok_s']:.2f} tok/s | "
          f"KV device {result['kv_device_bytes'] / mib:.2f} MiB in 16 bits ({result['kv_device_bytes_as_run'] / mib:.2f} as run), host {result['kv_host_bytes'] / mib:.2f} MiB, "
          f"fp16 equiv {result['kv_fp16_bytes'] / mib:.2f} MiB", file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))
    return result


def torchrun(a):
    """integrations.tp when torchrun started this process or --tp asks for tensor parallelism (imported only
    then), else None."""
    if a.tp is None and "WORLD_SIZE" not in os.environ:
        return None
    from integrations import tp
    return tp


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    if "WORLD_SIZE" in os.environ:
        from integrations import tp
        tp.main(main)
    else:
        main()
