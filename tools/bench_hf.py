"""transformers' own generate() on the weights our checkpoint was converted from, timed beside this
project's caches (tools/bench.py --hf): the dynamic cache, and the static cache (compiled with --compile),
per-step times from a streamer's timestamps; then the same transformers model through hf.py with this
project's caches, eager steps (and the compiled step with --compile), timed at generate()'s step hook."""
import statistics
import time

import torch

from tools import measure


def hf_rows(a, ids, dtype, device, adapter_configs=None) -> list[dict]:
    """generate() with the dynamic cache and the static cache (+ compile), on the GGUF our checkpoint
    was converted from, per-step times from a streamer's timestamps; then adapter_rows of the same model
    for adapter_configs ({name: CacheConfig})."""
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
    return rows + adapter_rows(a, model, ids, device, adapter_configs or {})


def adapter_rows(a, model, ids, device, configs: dict) -> list[dict]:
    """The transformers model through hf.py with this project's caches ({name: CacheConfig}): eager steps,
    and with --compile the compiled step too (generate.py --hf --compile's); per-step times at generate()'s
    step hook, as tools/bench.py's own rows. The model's attention implementation is put back after."""
    import generate
    import hf
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
