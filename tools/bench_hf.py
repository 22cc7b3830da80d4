"""transformers' own generate() on the weights our checkpoint was converted from, timed beside this
project's caches (tools/bench.py --hf): the dynamic cache, and the static cache (compiled with --compile).
Per-step times come from a streamer's timestamps."""
import statistics
import time

import torch

from tools import measure


def hf_rows(a, ids, dtype, device) -> list[dict]:
    """generate() with the dynamic cache and the static cache (+ compile), on the GGUF our checkpoint
    was converted from; per-step times from a streamer's timestamps."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer
        from convert_hf import find_default_gguf
        gguf = find_default_gguf()
    except (ImportError, ValueError) as e:
        return [{"name": "transformers", "skipped": f"{type(e).__name__}: {e}"}]

    class Clock(BaseStreamer):  # put() gets the prompt, then each new token
        def __init__(self):
            self.t = []

        def put(self, value):
            measure.synchronize(device)
            self.t.append(time.perf_counter())

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
    prompt, n_new, rows = torch.tensor([ids], device=device), a.warmup + a.steps + 1, []
    configs = [("hf dynamic", {}), ("hf static+compile" if a.compile else "hf static", {"cache_implementation": "static"})]
    for name, kw in configs:
        if kw.get("cache_implementation") == "static" and a.compile:
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
                     "step_ms_min": 1e3 * min(steps), "tok_s": 1 / med, "tokens": out[0, len(ids):].tolist()})
    return rows
