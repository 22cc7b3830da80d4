"""transformers' own generate() on the weights our checkpoint was converted from, timed beside this
project's caches (tools/bench.py --hf): the dynamic cache, and the static cache (compiled with --compile),
per-step times from a streamer's timestamps; then the same transformers model through hf.py with this
project's caches, eager steps (and the compiled step with --compile), timed at generate()'s step hook.

Run alone, the adapter side by side on any transformers model directory, batch 1 and a left-padded
batch of different prompts (docs/hf.md):
    python tools/bench_hf.py --hf checkpoints/gemma-3-270m --contexts 4096,8192 --json results/bench/hf/gemma.json
Each prompt (an essay window; the batch's rows 1/8, 2/8, 3/8 shorter, from other offsets) is
prefilled once through fp caches and replayed into every cache (tools/replay.py's PrefillReplay): the
rows time decode steps, eager, then compiled from a fresh replay; tok/s counts every row's tokens."""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import measure  # noqa: E402


def hf_rows(a, ids, dtype, device, adapter_configs=None) -> list[dict]:
    """generate() with the dynamic cache and the static cache (+ compile), on the GGUF our checkpoint
    was converted from, per-step times from a streamer's timestamps; then adapter_rows of the same model
    for adapter_configs ({name: CacheConfig})."""
    try:
        from transformers import AutoModelForCausalLM

        from convert_hf import find_default_gguf
        gguf = find_default_gguf()
    except (ImportError, ValueError) as e:
        return [{"name": "transformers", "skipped": f"{type(e).__name__}: {e}"}]
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
    prompt = torch.tensor([ids], device=device)
    rows = transformers_rows(a, model, prompt, device, ["dynamic", "static"])
    return rows + adapter_rows(a, model, ids, device, adapter_configs or {})


def transformers_rows(a, model, prompt, device, caches) -> list[dict]:
    """transformers' own generate() of `model` on prompt [1, P] with each of its caches ("dynamic",
    "static": compiled with --compile), per-step times from a streamer's timestamps."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # put() gets the prompt, then each new token
        def __init__(self):
            self.t = []

        def put(self, value):
            measure.synchronize(device)
            self.t.append(time.perf_counter())

        def end(self):
            pass

    n_new, rows = a.warmup + a.steps + 1, []
    for cache in caches:
        name, kw = f"hf {cache}", {"cache_implementation": cache} if cache != "dynamic" else {}
        if cache == "static" and a.compile:
            name += "+compile"
            cc = transformers.CompileConfig(fullgraph=False, mode="reduce-overhead" if device.type == "cuda" else "default")
            cc._compile_all_devices = True  # generate() only auto-compiles on accelerators otherwise
            kw = dict(kw, compile_config=cc)
            torch._dynamo.reset()
        clock = Clock()
        try:
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                     streamer=clock, pad_token_id=0, **kw)
        except Exception as e:  # noqa: BLE001 - report the skip, go on with the others
            rows.append({"name": name, "skipped": f"{type(e).__name__}: {str(e).strip()[:200]}"})
            continue
        steps = [e - s for s, e in zip(clock.t[1:-1], clock.t[2:])][a.warmup:]
        med = statistics.median(steps)
        rows.append({"name": name, "prefill_s": clock.t[1] - clock.t[0], "step_ms_median": 1e3 * med,
                     "step_ms_min": 1e3 * min(steps), "tok_s": 1 / med, "tokens": out[0, prompt.shape[1]:].tolist()})
    return rows


def adapter_rows(a, model, ids, device, configs: dict) -> list[dict]:
    """The transformers model through hf.py with this project's caches ({name: CacheConfig}): eager steps,
    and with --compile the compiled step too (generate.py --hf --compile's); per-step times at generate()'s
    step hook, as tools/bench.py's own rows. The model's attention implementation is put back after."""
    import generate
    from integrations import hf
    prev, rows = model.config._attn_implementation, []
    prompt, n_new = torch.tensor([ids], device=device), a.warmup + a.steps + 1
    try:
        view = hf.HFModel(model)
        for name, cfg in configs.items():
            for compiled in (False, True) if a.compile else (False,):
                steps = generate.Steps()
                if compiled:
                    torch._dynamo.reset()  # one graph per configuration, as tools/bench.py's rows
                    steps = steps.compiled(device, pre_decode=cfg.policy.resync)
                marks = measure.StepMarks(device)
                generate.setup_caches(view, cfg, 1, len(ids) + n_new + 2)
                with torch.no_grad():
                    out, stats = generate.generate(view, prompt, generate.Decoding(n_new), steps,
                                                   lambda *_: marks.mark())
                times = marks.durations()[a.warmup:a.warmup + a.steps]
                med = statistics.median(times)
                rows.append({"name": f"hf.py {name} {'compiled' if compiled else 'eager'}", "prefill_s": stats["prefill_s"],
                             "step_ms_median": 1e3 * med, "step_ms_min": 1e3 * min(times), "tok_s": 1 / med,
                             "tokens": out[0].tolist()})
    finally:
        model.set_attn_implementation(prev)
    return rows


# ---- python tools/bench_hf.py: the adapter side by side, batch 1 and a padded batch -------------------
def recorded_prompts(view, tok, n: int, batch: int, chunk: int):
    """`batch` different prompts of n, 7n/8, 6n/8, ... tokens (essay windows from different offsets),
    each prefilled alone once: [(ids [1, n_b], per-layer recordings, last logits [1, V])]."""
    import generate
    from tools.replay import PrefillReplay
    from tools.tasks import essay_window
    out = []
    for b in range(batch):
        ids = torch.tensor([essay_window(tok, 3000 * b, n - b * n // 8)], device=view.tok_embeddings.weight.device)
        generate.setup_caches(view, "full", 1, ids.shape[1] + 1)  # (PrefillReplay puts these back after recording)
        replay = PrefillReplay(chunk)
        with torch.no_grad():
            replay(view, ids)
        out.append((ids, [r.recording() for r in replay.recorded], replay.logits))
    return out


def padded_batch(prompts, pad_id: int):
    """Left-padded ids [B, P] and each row's padding of prompts [1, n_b]."""
    P = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=prompts[0].device)
    for i, p in enumerate(prompts):
        ids[i, P - p.shape[1]:] = p[0]
    return ids, torch.tensor([P - p.shape[1] for p in prompts])


def replayed(recordings, logits, pad=None):
    """A Steps.prefill that stores each row's recording (its prompt prefilled alone: per layer (k, v, pos, q))
    at the row's slots of the batch's caches, past its left padding pad [B] (zeros there: padding is never
    attended, and the quantizer fills it from the row's first real row)."""
    def fill(view, prompt):
        P = prompt.shape[1]
        starts = pad.tolist() if pad is not None else [0] * len(recordings)
        for i, layer in enumerate(view.layers):
            parts = [rec[i] for rec in recordings]
            lo = min(int(pos[0]) + s for (_, _, pos, _), s in zip(parts, starts))  # (a window's ring: its last rows)
            k = parts[0][0].new_zeros(len(parts), parts[0][0].shape[1], P - lo, parts[0][0].shape[3])
            v = torch.zeros_like(k)
            for b, ((kb, vb, pos, _), s) in enumerate(zip(parts, starts)):
                at = pos + s - lo
                k[b, :, at], v[b, :, at] = kb[0], vb[0]
            layer.attention.kv_cache.append_prefill(k, v, torch.arange(lo, P, device=k.device))
        return logits
    return fill


def side_by_side(a, view, tok, n: int) -> list[dict]:
    """One context: transformers' static-cache generate (compiled with --compile), then per cache the
    adapter's eager and compiled steps at batch 1 and (for --batch-caches) the padded batch."""
    import generate
    from config import CacheConfig
    from integrations import hf
    device = view.tok_embeddings.weight.device
    recs = recorded_prompts(view, tok, n, a.batch, a.prefill_chunk)
    view.hf.set_attn_implementation("sdpa")  # transformers' own attention for its own generate()
    rows = [dict(r, batch=1) for r in transformers_rows(a, view.hf, recs[0][0], device, ["static"])]
    for r in rows:
        print(f"  {r['name']:<40} batch 1: " + (f"{r['step_ms_median']:8.1f} ms/step  {r['tok_s']:7.2f} tok/s"
                                                if "skipped" not in r else r["skipped"]), flush=True)
    view.hf.set_attn_implementation(hf.NAME)
    n_new = a.warmup + a.steps + 1
    for name in a.caches.split(","):
        for batch in (1, a.batch) if name in a.batch_caches.split(",") and a.batch > 1 else (1,):
            use = recs[:batch]
            ids, pad = padded_batch([r[0] for r in use], pad_id=0)
            fill = replayed([r[1] for r in use], torch.cat([r[2] for r in use]), pad)
            tokens = {}
            for compiled in (False, True):
                torch._dynamo.reset()
                steps = generate.Steps(prefill=fill)
                if compiled:
                    steps = steps.compiled(device, pre_decode=CacheConfig.from_name(name).policy.resync)
                generate.setup_caches(view, name, batch, ids.shape[1] + n_new + 2, row_start=pad)
                marks, t0 = measure.StepMarks(device), time.perf_counter()
                with torch.no_grad():
                    out, _ = generate.generate(view, ids, generate.Decoding(n_new), steps, lambda *_: marks.mark())
                times = marks.durations()
                first = times[0] if times else 0.0  # the step that compiles
                times = times[a.warmup:a.warmup + a.steps]
                med = statistics.median(times)
                tokens[compiled] = out.tolist()
                rows.append({"name": f"hf.py {name} {'compiled' if compiled else 'eager'}", "batch": batch,
                             "step_ms_median": 1e3 * med, "step_ms_min": 1e3 * min(times), "tok_s": batch / med,
                             "first_step_s": first, "wall_s": time.perf_counter() - t0,
                             "prompt_tokens": [r[0].shape[1] for r in use]})
                print(f"  {rows[-1]['name']:<40} batch {batch}: {1e3 * med:8.1f} ms/step  {batch / med:7.2f} tok/s", flush=True)
            rows[-1]["same_tokens_as_eager"] = tokens[True] == tokens[False]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", type=Path, required=True, help="a transformers model directory")
    p.add_argument("--contexts", default="4096,8192", help="prompt tokens of batch 1 (the batch's longest row)")
    p.add_argument("--caches", default="full,kivi-1bit,specache-1bit-best")
    p.add_argument("--batch", type=int, default=4, help="rows of the padded batch")
    p.add_argument("--batch-caches", default="full,kivi-1bit,specache-1bit-best", help="caches also timed on the padded batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--json", type=Path, default=None, help="write the rows here (appended per context)")
    a = p.parse_args(argv)
    a.compile = True
    from integrations import hf
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        view, tok = hf.load(a.hf)
    except hf.HFError as e:
        raise SystemExit(f"error: {e}") from None
    res = {"model": a.hf.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "contexts": {}}
    for n in map(int, a.contexts.split(",")):
        print(f"{a.hf.name} at {n} tokens", flush=True)
        res["contexts"][n] = side_by_side(a, view, tok, n)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
