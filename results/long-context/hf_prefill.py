"""transformers' own prefill of a prompt file on a transformers model directory (its default
attention and its default cache, fp32): the time of one forward over the whole prompt, the bytes
its cache holds afterwards, and its greedy continuation, beside this project's `generate.py --hf`
on the same prompt.

    python results/long-context/hf_prefill.py --model checkpoints/gemma-3-270m --prompt-file P [--threads 2]
"""
import argparse
import json
import time
from pathlib import Path

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompt-file", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens after the prefill")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(a.model))
    model = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=torch.float32).eval()
    ids = tok(a.prompt_file.read_text(encoding="utf-8"), return_tensors="pt")["input_ids"]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t0
    cache = out.past_key_values
    kv = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    tokens = [int(out.logits[0, -1].argmax())]
    with torch.no_grad():
        for _ in range(a.max_new_tokens - 1):
            out = model(torch.tensor([tokens[-1:]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    print(json.dumps(dict(prompt_tokens=ids.shape[1], prefill_s=round(prefill_s, 2), cache=type(cache).__name__,
                          kv_device_bytes=kv, tokens=tokens, text=tok.decode(tokens), threads=a.threads,
                          attn_implementation=model.config._attn_implementation)))


if __name__ == "__main__":
    main()
