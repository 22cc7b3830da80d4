"""The prompts through vLLM with SpeCache's or KIVI's pages: generate.py's flags where they apply, and the KV budget.

    .venv-vllm/bin/python -m integrations.specache_vllm --hf checkpoints/smollm2-135m-hf --cache specache-1bit-lag \\
        --prompts-file prompts.jsonl --chat --max-new-tokens 40 --kv-bytes 64000000 --max-model-len 4096 [--json]

It prints each prompt's answer, then, side by side for vLLM's own attention and the chosen cache, the engine's KV
capacity in tokens and its maximum concurrency at --max-model-len (vLLM's own numbers for the run's cache; the
stock backend's by vLLM's formula, 2 * head_dim elements a slot), and both again as a 16-bit deployment would hold
them. With --json the last line is generate.py's JSON object with the capacities beside it.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

import config as cache_config
import generate
from integrations import hf
from integrations.specache_vllm import pages

KEYS = ("kv_capacity_tokens", "stock_kv_capacity_tokens", "max_concurrency", "stock_max_concurrency")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", type=Path, required=True, help="a transformers model directory (vLLM loads it)")
    generate.add_prompt_flags(p)  # (a prompts file's prompts are served together)
    cache_config.add_cache_flags(p)
    p.set_defaults(cache="specache-lag")  # (the speculative two-token step is generate.py's: docs/vllm.md)
    p.add_argument("--kv-bytes", type=int, default=64 << 20, help="the engine's KV budget in bytes (vLLM's "
                   "kv_cache_memory_bytes: its pages, which carry the caches' device rows too)")
    p.add_argument("--max-model-len", type=int, default=4096, help="tokens a request may hold (prompt and answer)")
    p.add_argument("--block-size", type=int, default=None, help="tokens a block (default: the key group, at least 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    a = p.parse_args(argv)
    a.method, a.gamma = "autoregressive", 0  # (what generate.py's prompt helpers read)
    return a


def model_shape(path: Path) -> dict:
    """layers, kv heads, head_dim of a transformers directory (hf.read_config checks the model family)."""
    cfg = hf.read_config(path)
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg.get("num_key_value_heads", heads),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads)


def stock_capacity(shape: dict, kv_bytes: int, block: int, max_model_len: int, slot_bytes: float) -> tuple[int, float]:
    """(tokens, maximum concurrency) of a budget whose pages hold `slot_bytes` per (slot, kv head): vLLM's
    count (its blocks of `block` tokens, every layer's page a block; the null block among them)."""
    n_blocks = int(kv_bytes // (shape["layers"] * shape["kv_heads"] * block * slot_bytes))
    return n_blocks * block, n_blocks / math.ceil(max_model_len / block)


def start_engine(hf: Path, cache: str, block: int, max_model_len: int, kv_bytes: int, **kw):
    """An in-process vLLM engine (fp32, eager, no prefix caching) whose attention is the plugin's for the cache name
    `cache`, or vLLM's own for "full"; kw: more of vllm.LLM's arguments."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: an engine starts in seconds here
    os.environ["VLLM_PLUGINS"] = "" if cache == "full" else "specache"
    os.environ["SPECACHE_CACHE"] = cache
    from vllm import LLM
    return LLM(model=str(hf), dtype="float32", enforce_eager=True, enable_prefix_caching=False, block_size=block,
               max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes, **kw)


def run(a) -> dict:
    if a.kv_bytes < 1 or a.max_model_len < 2 or a.max_new_tokens < 1:
        raise ValueError("--kv-bytes, --max-model-len and --max-new-tokens must be positive")
    config = cache_config.from_flags(a)
    shape = model_shape(a.hf)
    block = a.block_size or max(32, config.group)
    from integrations.specache_vllm.backend import check_head_size
    check_head_size(shape["head_dim"])
    layout = None
    if config.kind != "full":  # every check the engine would make, before it starts (and before weights load)
        layout = pages.PageLayout.build(config, shape["kv_heads"], shape["head_dim"], block, torch.float32, a.max_model_len)
    tok = hf.load_tokenizer(a.hf, any_transformers=True)
    if a.prompts_file is not None:
        rows, _ = generate.prompts_ids(a, tok, generate.read_prompts(a.prompts_file), a.max_model_len)
    else:
        ids, _ = generate.prompt_ids(a, tok, a.max_model_len)
        rows = [ids]
    llm = start_engine(a.hf, config.name, block, a.max_model_len, a.kv_bytes, seed=a.seed)
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": r} for r in rows],
                        SamplingParams(max_tokens=a.max_new_tokens, temperature=0.0, stop_token_ids=sorted(tok.eos_ids)))
    cc = llm.llm_engine.vllm_config.cache_config
    item = 4  # (fp32 on this CPU)
    stock_tokens, stock_conc = stock_capacity(shape, a.kv_bytes, block, a.max_model_len, 2 * shape["head_dim"] * item)
    tokens = [[t for t in o.outputs[0].token_ids if t not in tok.eos_ids] for o in outs]
    result = dict(text=tok.decode(tokens[0]), tokens=tokens[0] if a.prompts_file is None else tokens,
                  prompt_tokens=len(rows[0]) if a.prompts_file is None else [len(r) for r in rows],
                  cache=config.name, config=config.as_dict(), engine="vllm", kv_bytes=a.kv_bytes,
                  max_model_len=a.max_model_len, block_size=block,
                  kv_capacity_tokens=int(cc.kv_cache_size_tokens), stock_kv_capacity_tokens=stock_tokens,
                  max_concurrency=round(float(cc.kv_cache_max_concurrency), 3), stock_max_concurrency=round(stock_conc, 3))
    if layout is not None:
        n_blocks = int(cc.num_gpu_blocks)
        result.update(slot_bytes=layout.slot_bytes, stock_slot_bytes=layout.stock_slot_bytes(),
                      host_store_bytes=2 * n_blocks * block * shape["kv_heads"] * shape["head_dim"] * item * shape["layers"],
                      kv_capacity_tokens_16bit=stock_capacity(shape, a.kv_bytes, block, a.max_model_len, layout.slot_bytes_16)[0],
                      stock_kv_capacity_tokens_16bit=stock_capacity(shape, a.kv_bytes, block, a.max_model_len,
                                                                    2 * shape["head_dim"] * 2)[0])
    if a.prompts_file is not None:
        result["texts"] = [tok.decode(t) for t in tokens]
    show(a, result)
    return result


def show(a, result: dict):
    out = sys.stderr if a.json else sys.stdout
    for n, text in enumerate(result.get("texts", [result["text"]]), 1):
        print(f"--- prompt {n} ---\n{text}", file=out)
    print(f"[{result['cache']} in vLLM, {a.kv_bytes / 2**20:.1f} MiB of KV, requests of {a.max_model_len} tokens] "
          f"capacity {result['kv_capacity_tokens']:,} tokens, {result['max_concurrency']:.2f} requests at once | "
          f"vLLM's own attention: {result['stock_kv_capacity_tokens']:,} tokens, {result['stock_max_concurrency']:.2f}",
          file=out)
    if "host_store_bytes" in result:
        print(f"  as a 16-bit deployment: {result['kv_capacity_tokens_16bit']:,} tokens against "
              f"{result['stock_kv_capacity_tokens_16bit']:,}; host store {result['host_store_bytes'] / 2**20:.1f} MiB "
              f"(outside the KV budget); a slot {result['slot_bytes']} B a kv head against {result['stock_slot_bytes']}",
              file=out)
    if a.json:
        print(json.dumps(result))


def main(argv=None):
    a = parse_args(argv)
    try:
        return run(a)
    except (ValueError, hf.HFError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
