"""vLLM's own attention and the plugin's pages side by side at one KV budget (run it in the vLLM venv: make vllm):
per cache, the engine's capacity and maximum concurrency, how many requests ran at once, the preemptions, and the
tokens/s of one batch of requests, each cache in a fresh process of its own, one after another.

    .venv-vllm/bin/python tools/bench_vllm.py --hf checkpoints/smollm2-135m-hf --kv-bytes 40000000 --requests 8 \\
        --prompt-tokens 1500 --new-tokens 32 --out results/vllm/2026-12-06-cpu

The prompts are random token ids (a fixed seed): the same work for every cache. On a CPU the host store and the
device pages are one memory and the plugin's decode runs the torch references one request row at a time, so its
tokens/s say little of a GPU's; what the run shows is how many requests one budget holds and serves.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHES = ("full", "kivi-1bit", "specache-1bit-lag")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-hf")
    p.add_argument("--caches", default=",".join(CACHES), help="full (vLLM's own attention) and cache names")
    p.add_argument("--kv-bytes", type=int, default=40_000_000)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None, help="a results folder: bench.jsonl and bench.md")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # (a child process: one cache)
    return p.parse_args(argv)


def one(a) -> dict:
    """One cache's engine and batch, in this process."""
    import torch
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(ROOT))
    from integrations.specache_vllm.__main__ import start_engine
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    seen = dict(preempted=0, running=0)
    preempt, schedule = Scheduler._preempt_request, Scheduler.schedule

    def counted(self, *args, **kw):
        seen["preempted"] += 1
        return preempt(self, *args, **kw)

    def watched(self, *args, **kw):
        out = schedule(self, *args, **kw)
        seen["running"] = max(seen["running"], len(self.running))
        return out
    Scheduler._preempt_request, Scheduler.schedule = counted, watched
    llm = start_engine(a.hf, a.one, 64, a.max_model_len, a.kv_bytes, seed=0, skip_tokenizer_init=True)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(1000, 40000, (a.prompt_tokens,), generator=g).tolist()}
               for _ in range(a.requests)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t
    cc = llm.llm_engine.vllm_config.cache_config
    new = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(cache=a.one, kv_bytes=a.kv_bytes, blocks=int(cc.num_gpu_blocks), kv_capacity_tokens=int(cc.kv_cache_size_tokens),
                max_concurrency=round(float(cc.kv_cache_max_concurrency), 3), requests=a.requests,
                prompt_tokens=a.prompt_tokens, new_tokens=a.new_tokens, max_model_len=a.max_model_len,
                most_running=seen["running"], preemptions=seen["preempted"], wall_s=round(wall, 2),
                tokens_per_s=round((a.requests * a.prompt_tokens + new) / wall, 1), new_tokens_per_s=round(new / wall, 2))


def report(rows: list) -> str:
    lines = ["| cache | KV blocks | capacity (tokens) | max concurrency | requests at once (most) | preemptions | "
             "wall s | tokens/s (prompt + new) | new tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['blocks']:,} | {r['kv_capacity_tokens']:,} | {r['max_concurrency']:.2f} | "
                     f"{r['most_running']} of {r['requests']} | {r['preemptions']} | {r['wall_s']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['new_tokens_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    if a.one:
        print(json.dumps(one(a)))
        return
    rows = []
    for cache in a.caches.split(","):
        cmd = [sys.executable, __file__, "--one", cache, "--hf", str(a.hf), "--kv-bytes", str(a.kv_bytes),
               "--requests", str(a.requests), "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
               "--max-model-len", str(a.max_model_len)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        if r.returncode:
            raise SystemExit(f"error: {cache}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
        rows.append(json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(report(rows))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (a.out / "bench.md").write_text(f"`{' '.join(['python', 'tools/bench_vllm.py', *(argv or sys.argv[1:])])}`\n\n"
                                        + report(rows) + "\n")


if __name__ == "__main__":
    main()
