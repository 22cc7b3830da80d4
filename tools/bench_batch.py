"""A batch of different prompts decoded together (one left-padded batch, cache.setup_caches' row_start) against
the same prompts decoded one after another, side by side in one run: decode tokens/s of each cache, and whether
each row's tokens are its prompt's alone.

    flock /tmp/specache-heavy.lock env OMP_NUM_THREADS=2 python tools/bench_batch.py --threads 2 \\
        --lengths 1024,1280,1536,2048 --caches full,specache-1bit --compile --json results/ragged/DATE/bench.json

Each prompt is a window of the essays (tools/tasks.py) of the given length; every run prefills for real (not
timed: the decode steps are, --warmup of them dropped). Compiled runs keep one cache size for every run (the
longest prompt's), so the rows alone share one graph and the batch has its own. The sequential figure is the
four prompts' tokens over the sum of their step times: what serving them one after another decodes per second.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import generate  # noqa: E402
from config import CacheConfig  # noqa: E402
from generate import left_padded, setup_caches  # noqa: E402
from tools import measure  # noqa: E402


def decode(model, cfg, ids, starts, seq_len, steps, a):
    """-> (median step seconds over the timed steps, the rows' tokens, the first step's seconds)."""
    setup_caches(model, cfg, ids.shape[0], seq_len, row_start=starts)
    marks = measure.StepMarks(ids.device)
    t0 = time.perf_counter()
    out, _ = generate.generate(model, ids, generate.Decoding(a.warmup + a.steps + 1), steps, lambda *_: marks.mark())
    times = marks.durations()
    return statistics.median(times[a.warmup:]), out.tolist(), times[0] if times else time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-instruct")
    p.add_argument("--lengths", default="1024,1280,1536,2048", help="each prompt's tokens (one row each)")
    p.add_argument("--caches", default="full,specache-1bit")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    from model import load_model
    from tokenizer import load_tokenizer
    from tools.tasks import essay_ids
    if a.threads:
        torch.set_num_threads(a.threads)
    if not (a.checkpoint / "config.json").exists():
        raise SystemExit(f"error: no checkpoint at {a.checkpoint}")
    lengths = [int(x) for x in a.lengths.split(",")]
    model, tok = load_model(a.checkpoint), load_tokenizer(a.checkpoint)
    stream = essay_ids(tok)
    prompts = [stream[i * 3000:i * 3000 + n] for i, n in enumerate(lengths)]  # (different text in each row)
    ids, starts = left_padded(prompts, 0, torch.device("cpu"))
    seq_len = ids.shape[1] + a.warmup + a.steps + 3
    res = {"environment": measure.environment(torch.device("cpu"), torch.float32, command=" ".join(sys.argv)),
           "lengths": lengths, "compile": a.compile, "rows": []}
    for name in a.caches.split(","):
        cfg = CacheConfig.from_name(name)
        steps = generate.Steps().compiled(torch.device("cpu"), cfg.policy.resync) if a.compile else generate.Steps()
        torch._dynamo.reset()
        alone = [decode(model, cfg, torch.tensor([pr]), None, seq_len, steps, a) for pr in prompts]
        batch = decode(model, cfg, ids, starts, seq_len, steps, a)
        seq_tok_s = len(prompts) / sum(t for t, _, _ in alone)
        row = {"cache": cfg.name, "batch": len(prompts), "step_ms_batch": 1e3 * batch[0],
               "step_ms_alone": [1e3 * t for t, _, _ in alone], "tok_s_batch": len(prompts) / batch[0],
               "tok_s_one_after_another": seq_tok_s, "speedup": len(prompts) / batch[0] / seq_tok_s,
               "first_step_s_batch": batch[2], "first_step_s_alone": [f for _, _, f in alone],
               "rows_equal_alone": [b == s[1][0] for b, s in zip(batch[1], alone)]}
        res["rows"].append(row)
        print(f"{cfg.name}: batch of {len(prompts)} {row['tok_s_batch']:.2f} tok/s ({row['step_ms_batch']:.1f} ms a step), "
              f"one after another {seq_tok_s:.2f} tok/s: {row['speedup']:.2f}x; rows equal alone: {row['rows_equal_alone']}",
              flush=True)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
