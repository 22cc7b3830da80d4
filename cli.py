"""generate.py's command line: its flags, their checks, and the cache, model and prompt they name.
Bad input raises ValueError, which generate.main prints as one `error:` line (exit code 1)."""
import argparse
import sys
from pathlib import Path

import torch

import config as cache_config
from siblings import quantspec
from integrations import tp
from config import CacheConfig

ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "smollm2-135m-instruct"


def parse_args(argv=None, description=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help=f"a converted checkpoint (default {DEFAULT_CHECKPOINT.relative_to(ROOT)})")
    p.add_argument("--hf", type=Path, default=None, help="a transformers model directory instead (hf.py: Llama, Mistral, Qwen2/3, ...)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--prompt-file", type=Path, help="read the prompt from a file ('-' for stdin), UTF-8")
    p.add_argument("--prompts-file", type=Path, help="a batch of different prompts, JSON Lines: one a line, a string "
                   '(text; --chat wraps it), {"text": ...}, or a chat turn {"role": "user", "content": ...}')
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1, help="the prompt is replicated per row")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default); > 0 samples")
    p.add_argument("--sample-top-k", type=int, default=None, help="sample from the k most likely tokens (not SpeCache's --k)")
    p.add_argument("--seed", type=int, default=0)
    cache_config.add_cache_flags(p)
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
    p.add_argument("--compile-prefill", action="store_true", help="also compile prefill (dynamic shapes; caches stay eager)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--quiet", action="store_true", help="no streaming text")
    return p.parse_args(argv)


def check_args(a):
    for flag, value, low in (("--max-new-tokens", a.max_new_tokens, 1), ("--batch-size", a.batch_size, 1),
                             ("--prefill-chunk", a.prefill_chunk, 1), ("--threads", a.threads, 1),
                             ("--sample-top-k", a.sample_top_k, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if a.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if a.method == "quantspec":
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


def load(a, device, dtype):
    """(model, tokenizer) of --checkpoint (this rank's slices under torchrun) or --hf."""
    from tokenizer import load_tokenizer
    if a.hf:
        if tp.world() > 1:
            raise ValueError("--hf runs on one process: tensor parallelism under torchrun takes converted checkpoints (--checkpoint)")
        from integrations import hf
        return hf.load(a.hf, device, dtype)
    ckpt = a.checkpoint or DEFAULT_CHECKPOINT
    if not (ckpt / "config.json").exists():
        raise ValueError(f"no checkpoint at {ckpt} (run `make demo`, or `python convert_hf.py SOURCE --out {ckpt}`)")
    return tp.load_model(ckpt, device=device, dtype=dtype), load_tokenizer(ckpt)


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
    if seq_len > max_seq_len:  # (each fits: the padded batch does too, as the longest row ends it)
        raise ValueError(f"the longest prompt ({P} tokens) + --max-new-tokens exceeds max_seq_len {max_seq_len}")
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
