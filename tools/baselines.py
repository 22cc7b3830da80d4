"""The methods a user would pick instead of SpeCache, run in the kvpress venv (kvpress needs transformers
<5.3, hf.py >=5.23, so this module imports none of the project's root modules): KV eviction "presses"
from NVIDIA's kvpress (StreamingLLM, H2O, SnapKV, PyramidKV, Knorm, ...) and transformers'
QuantizedCache (an independent KIVI-style cache), greedy, batch 1. tools/baselines_grid.py drives
the grid; docs/baselines.md has the loop, the byte arithmetic and the results.

    make venv-kvpress
    .venv-kvpress/bin/python tools/baselines.py run --hf checkpoints/smollm2-135m-hf --prompt-file needle.txt \
        --press snapkv --match-bytes 7340032 --max-new-tokens 32        # one JSON line, as generate.py --json
    .venv-kvpress/bin/python tools/baselines.py cells --hf DIR --ids-file IDS --cells CELLS.json   # one prefill, many cells

`run`: prefill the context with the press's hook on each full-attention layer (a sliding layer keeps
its window, as this project's caches keep a ring of it), then the question one token at a time at its
real positions, then new tokens. `cells`: the same cells from one recorded prefill (SharedPrefill).
Every row carries prompt_sha256 (sha256 of the comma-joined ids); --ids-file passes the project's ids.
Run from another Python, it re-executes itself with .venv-kvpress/bin/python.
"""
import argparse
import contextlib
import hashlib
import importlib.metadata
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
    **{name: f"it downloads its {what} from a model hub at run time (no network here)" for name, what in (
        ("qfilter", "filters"), ("duo_attention", "head patterns"), ("kvzap", "scorer"),
        ("expected_attention_stats", "query statistics"))},
    "adakv": "it masks evicted entries but keeps their memory: no device bytes are saved",
    "criticaladakv": "it masks evicted entries but keeps their memory: no device bytes are saved",
    "kvzip": "it refuses Gemma 3 and reruns the context; not a prefill press at these budgets",
}
SNAPKV_WINDOW = 64  # kvpress SnapKVPress/PyramidKVPress window_size (their default)


def fail(msg):
    raise SystemExit(f"error: {msg}")


class CellError(Exception):
    """One cell (press x budget) that cannot run: `run` ends with its error line, `cells` skips it."""


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
    pressed layer of it. Raises CellError when the budget keeps no context entry."""
    fed = n_prompt + max_new - 1
    fixed = sum(window_entries(w, fed) for w in windows if w is not None)
    pressed = sum(w is None for w in windows)
    add = appended(n_prompt, n_compressed, max_new)
    n = (target // entry - fixed) // pressed - add
    if n < 1:
        need = entry * (fixed + pressed * (add + 1))
        raise CellError(f"--match-bytes {target} keeps no context entry: the sliding layers hold {entry * fixed} bytes and "
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


def attention_module(model, i):
    """Layer i's attention module, handed the model's rotary embedding (some presses re-rotate queries)."""
    attn = model.model.layers[i].self_attn
    attn.rotary_emb = model.model.rotary_emb
    return attn


class Hooked:
    """`hook` as a forward hook on the pressed layers' attention modules, for one prefill. With a press's
    hook it is what kvpress's `press(model)` does, minus the sliding layers it presses on Gemma 3's text model."""

    def __init__(self, model, hook, layers):
        self.model, self.hook, self.layers, self.hooks = model, hook, layers, []

    def __enter__(self):
        self.hooks = [attention_module(self.model, i).register_forward_hook(self.hook, with_kwargs=True)
                      for i in self.layers]
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
    return sum(tensor_bytes(getattr(layer, k, None)) for k in ("keys", "values", "_quantized_keys", "_quantized_values"))


def greedy_after_prefill(model, ids, start, cache, logits, max_new, eos_ids):
    """Greedy from a filled cache: ids[start:] one token at a time at their real positions, then new
    tokens up to max_new or an end token. `logits`: the prefill's last position's. Returns (new ids,
    seconds for the prompt's rest, decode seconds, peak held bytes)."""
    import torch

    def step(token, pos):
        p = torch.tensor([pos])
        return model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=p[None],
                     cache_position=p, use_cache=True).logits[0, -1]

    with torch.no_grad():
        t0 = time.perf_counter()
        for pos in range(start, len(ids)):
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
    return out, t1 - t0, time.perf_counter() - t1, peak


def kept_entries(cache) -> list:
    """Entries each layer holds (a quantized layer: the positions it represents)."""
    return [int(layer.cumulative_length) if hasattr(layer, "_quantized_keys") else int(layer.keys.shape[-2])
            for layer in cache.layers]


class SharedPrefill:
    """One prefill that every press and budget on a prompt shares. A press prunes a layer's K/V after
    that layer's exact attention, so the prefill's hidden states do not depend on the press: record what
    kvpress's hook sees in each pressed layer (input hidden states, rotary embeddings, eager attention's
    weights) and every layer's K/V; give each cell a cache as its own pressed prefill would leave it.

    Two forwards: the context ids[:at] (what a press compresses unless question-aware; the same
    forward as `run`'s prefill), then the question ids[at:] appended. A question-aware cell sees the
    two chunks joined (one forward's hidden states, K/V and causal attention rows, up to rounding). The
    recording cache keeps every entry (a sliding layer's mask still applies its window)."""

    def __init__(self, model, ids, at, pressed):
        import torch
        import transformers
        self.model, self.ids, self.at, self.pressed = model, ids, at, pressed
        self.full = transformers.DynamicCache()  # no config: full layers, every entry kept
        self.chunks = {i: [] for i in pressed}

        def hook(module, args, kwargs, output):
            self.chunks[module.layer_idx].append((kwargs["hidden_states"], kwargs["position_embeddings"], output[1]))
        self.logits = []  # the last position's logits after the context, and after the whole prompt
        t0 = time.perf_counter()
        with torch.no_grad(), Hooked(model, hook, pressed):
            for lo, hi in ((0, at), (at, len(ids))):
                if hi > lo:
                    p = torch.arange(lo, hi)
                    self.logits.append(model(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=self.full,
                                             position_ids=p[None], cache_position=p, use_cache=True,
                                             logits_to_keep=1).logits[0, -1])
        self.seconds = time.perf_counter() - t0

    def inputs(self, i, n):
        """What kvpress's hook on layer i sees after a prefill of the first n tokens (n = at or all)."""
        import torch
        chunks = self.chunks[i][:1] if n == self.at else self.chunks[i]
        hs = torch.cat([c[0] for c in chunks], dim=1)
        cos, sin = (torch.cat([c[1][j] for c in chunks], dim=1) for j in (0, 1))
        attn = None
        if chunks[0][2] is not None:  # eager: the causal attention rows of each chunk, in one [T, T] matrix
            attn = chunks[0][2].new_zeros(*chunks[0][2].shape[:2], n, n)
            row = 0
            for c in chunks:
                w = c[2]
                attn[:, :, row:row + w.shape[2], :w.shape[3]] = w
                row += w.shape[2]
        layer = self.full.layers[i]
        return hs, layer.keys[:, :, :n], layer.values[:, :, :n], attn, dict(hidden_states=hs, position_embeddings=(cos, sin))

    def cache(self, n, make_cache, press=None):
        """A cache as a pressed prefill of ids[:n] leaves it: every layer's K/V through that layer's own
        update (a sliding layer keeps its window, a quantized layer quantizes), then each pressed
        layer's entries replaced by what the press keeps (kvpress's hook does the same)."""
        import torch
        cache = make_cache()
        with torch.no_grad():
            for i, layer in enumerate(self.full.layers):
                cache.layers[i].update(layer.keys[:, :, :n], layer.values[:, :, :n])
            if press is not None:
                for i in self.pressed:
                    hs, k, v, attn, kwargs = self.inputs(i, n)
                    module = attention_module(self.model, i)
                    cache.layers[i].keys, cache.layers[i].values = press.compress(module, hs, k, v, attn, kwargs)
        return cache

    def logits_after(self, n):
        return self.logits[0] if n == self.at else self.logits[-1]


def make_press(kvpress, name: str):
    cls, kwargs, _ = PRESSES[name]
    return getattr(kvpress, cls)(**kwargs)


def check_press_runs(name: str, model_type: str, n_compressed: int, n_heads: int, itemsize: int, held: int = 0):
    """A press that cannot run on this prompt or model: say which and why (CellError). `held`: attention
    weights of that size kept beside the prefill's own (the shared prefill's records)."""
    if name == "expected_attention" and model_type.startswith("gemma3"):
        raise CellError(f"press expected_attention cannot run on model type {model_type!r}: under transformers 5.2 it "
                        f"calls the rotary embedding without the layer type that Gemma 3's rotary embedding needs (one per layer kind)")
    if PRESSES[name][2]:  # eager attention materializes every layer's [heads, T, T] weights (and softmax a copy)
        need = (2 + held) * n_heads * n_compressed ** 2 * itemsize
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free:
            raise CellError(f"press {name} cannot run on {n_compressed} compressed tokens here: its score needs eager "
                            f"attention: {need / 2 ** 30:.1f} GiB of weights with copies ({free / 2 ** 30:.1f} GiB free)")
    if name in ("snapkv", "pyramidkv") and n_compressed <= SNAPKV_WINDOW:
        raise CellError(f"press {name} cannot run on {n_compressed} compressed tokens: it scores them with the "
                        f"attention of the last {SNAPKV_WINDOW} (its window) and needs more than {SNAPKV_WINDOW}")
    if name == "streaming_llm" and n_compressed <= 4:
        raise CellError(f"press streaming_llm keeps 4 sink tokens and needs more than 4 compressed tokens, got {n_compressed}")


def check_cell(name: str, ratio, match_bytes, question_aware=False):
    """A cell that is not a runnable press x budget: CellError naming why."""
    if name in NOT_HERE:
        raise CellError(f"press {name} is not run here: {NOT_HERE[name]}")
    if name not in PRESSES and name not in QUANTIZED and name != "no_press":
        raise CellError(f"unknown press {name!r}; known: no_press, {', '.join(PRESSES)}, {', '.join(QUANTIZED)}")
    budget = ratio is not None or match_bytes is not None
    if name in PRESSES and not budget:
        raise CellError(f"press {name} needs a budget: --ratio R or --match-bytes B")
    if name not in PRESSES and (budget or question_aware):
        raise CellError(f"{name} keeps every entry: --ratio, --match-bytes and --question-aware apply to presses only")
    if ratio is not None and not 0 <= ratio < 1:
        raise CellError(f"--ratio is the share of entries removed, in [0, 1), got {ratio}")


class Prompt:
    """The model, the prompt's ids and the layer facts every cell on it shares."""

    def __init__(self, a, eager: bool):
        import torch
        if a.max_new_tokens < 1:
            fail(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
        self.kvpress = import_kvpress()
        torch.set_num_threads(a.threads)
        self.a, self.dtype = a, getattr(torch, a.dtype)
        self.model, self.tok = load_model(a.hf, self.dtype, eager=eager)
        if a.ids_file:
            try:
                spec = json.loads(a.ids_file.read_text())
            except (OSError, ValueError) as e:
                fail(f"cannot read --ids-file {a.ids_file}: {e}")
            if isinstance(spec, list):
                spec = dict(ids=spec)
            self.ids, self.at = [int(i) for i in spec["ids"]], int(spec.get("question_at", len(spec["ids"])))
        else:
            try:
                text = a.prompt_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                fail(f"cannot read prompt file {a.prompt_file}: {e}")
            self.ids, self.at = encode(self.tok, text, a.prompt_form, a.question_start)
        self.sha = ids_sha256(self.ids)
        if a.expect_sha256 and a.expect_sha256 != self.sha:
            fail(f"the prompt's token ids differ from the expected ones (sha256 {self.sha[:16]}... != "
                 f"{a.expect_sha256[:16]}...): pass the project's ids with --ids-file")
        if not 1 <= self.at:
            fail(f"the question starts at token {self.at} of {len(self.ids)}: nothing to compress before it")
        self.at = min(self.at, len(self.ids))
        c = self.c = self.model.config.get_text_config()
        if len(self.ids) + a.max_new_tokens > c.max_position_embeddings:
            fail(f"prompt ({len(self.ids)} tokens) + --max-new-tokens exceeds the model's {c.max_position_embeddings} positions")
        self.windows = layer_windows(self.model.config)
        self.pressed = [i for i, w in enumerate(self.windows) if w is None]
        if not self.pressed:
            fail(f"model type {c.model_type!r}: every layer is a sliding-window layer; there is nothing to press")
        self.itemsize = torch.empty(0, dtype=self.dtype).element_size()
        self.entry = entry_bytes(c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                                 self.itemsize)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else eos or [])

    def make_cache(self, name):
        import transformers
        a = self.a
        if name in QUANTIZED:
            return lambda: transformers.QuantizedCache(backend=a.quant_backend, config=self.model.config, nbits=QUANTIZED[name],
                                                       q_group_size=a.quant_group, residual_length=a.quant_residual)
        return lambda: transformers.DynamicCache(config=self.model.config)

    def run_cell(self, name, ratio=None, match_bytes=None, question_aware=False, shared=None, held=0):
        """One press at one budget (or no_press, or a QuantizedCache): the JSON row. Through kvpress's own
        hook in a prefill of its own, or from `shared` (a SharedPrefill of this prompt)."""
        import torch
        import transformers
        a, ids, c, model = self.a, self.ids, self.c, self.model
        check_cell(name, ratio, match_bytes, question_aware)
        n_compressed = len(ids) if question_aware else self.at
        max_new = a.max_new_tokens
        row = dict(press=name, question_aware=bool(question_aware), ratio=None, target_bytes=match_bytes)
        press = None
        if name in PRESSES:
            check_press_runs(name, c.model_type, n_compressed, c.num_attention_heads, self.itemsize, held)
            press = make_press(self.kvpress, name)
            press.post_init_from_model(model)
            if match_bytes is not None:
                n = kept_for_bytes(match_bytes, self.windows, len(ids), n_compressed, max_new, self.entry)
                ratio = (pyramid_ratio_for(press, n * len(self.pressed), self.pressed, n_compressed, c)
                         if name == "pyramidkv" else ratio_for(n, n_compressed))
            press.compression_ratio = ratio
            row["ratio"] = ratio
        if name in QUANTIZED:
            row.update(quant_backend=a.quant_backend, quant_group=a.quant_group, quant_residual=a.quant_residual)
        try:
            if shared is None:
                t0, cache = time.perf_counter(), self.make_cache(name)()
                hooked = Hooked(model, press.forward_hook, self.pressed) if press else contextlib.nullcontext()
                with torch.no_grad(), hooked:
                    logits = model(input_ids=torch.tensor([ids[:n_compressed]]), past_key_values=cache, use_cache=True,
                                   logits_to_keep=1).logits[0, -1]  # the prefill, pressed by kvpress's own hook
            else:
                t0, cache = time.perf_counter(), shared.cache(n_compressed, self.make_cache(name), press)
                logits = shared.logits_after(n_compressed)
                row["shared_prefill_s"] = round(shared.seconds, 4)
            kept = kept_entries(cache)
            out, _, decode_s, peak = greedy_after_prefill(model, ids, n_compressed, cache, logits, max_new, self.eos_ids)
            prefill_s = time.perf_counter() - t0 - decode_s  # the prefill (or the cache from the shared one) and the question
        except (AssertionError, RuntimeError, ValueError, TypeError, AttributeError, ImportError) as e:
            what = f"press {name}" if name in PRESSES else name
            raise CellError(f"{what} cannot run on model type {c.model_type!r}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}")
        n_new = len(out)
        out = out[:next((i for i, t in enumerate(out) if t in self.eos_ids), len(out))]  # cut at the first end token
        # a QuantizedCache: its codes, scales and fp residual at their largest; otherwise the entries held
        kv_bytes = peak if name in QUANTIZED else device_bytes(kept, self.windows, len(ids), n_compressed, max_new, self.entry)
        row.update({
            "text": self.tok.decode(out), "tokens": out,
            "prompt_tokens": len(ids), "prompt_sha256": self.sha, "compressed_tokens": n_compressed,
            "question_tokens": len(ids) - n_compressed,
            "kept_per_layer": kept, "pressed_layers": self.pressed if name in PRESSES else [],
            "kv_device_bytes": kv_bytes, "kv_held_peak_bytes": peak, "kv_entry_bytes": self.entry,
            "kv_fp_full_bytes": device_bytes([n_compressed] * len(self.windows), self.windows, len(ids), n_compressed,
                                             max_new, self.entry),
            "prefill_s": round(prefill_s, 4), "decode_tok_s": round(n_new / decode_s, 3) if decode_s > 0 else None,
            "new_tokens": n_new, "dtype": a.dtype, "model": a.hf.name, "model_type": c.model_type,
            "versions": dict(kvpress=importlib.metadata.version("kvpress"), transformers=transformers.__version__,
                             torch=torch.__version__),
        })
        if match_bytes is not None:
            row["bytes_gap"] = match_bytes - kv_bytes
        return row


def emit(row, out):
    line = json.dumps(row)
    if out:  # one complete line, appended only once the cell has succeeded
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)


def cmd_run(a):
    try:
        check_cell(a.press, a.ratio, a.match_bytes, a.question_aware)
        prompt = Prompt(a, eager=PRESSES.get(a.press, (None, None, False))[2])
        row = prompt.run_cell(a.press, a.ratio, a.match_bytes, a.question_aware)
    except CellError as e:
        fail(str(e))
    emit(row, a.out)
    return row


def cmd_cells(a):
    """Cells on one prompt from one shared prefill per attention implementation (eager for H2O): a JSON line
    per finished cell (with its `tag`); one that cannot run prints its tagged `error:` line; exit 1 if any did."""
    try:
        cells = json.loads(a.cells.read_text())
    except (OSError, ValueError) as e:
        fail(f"cannot read --cells {a.cells}: {e}")
    groups = {}
    for cell in cells:
        groups.setdefault(PRESSES.get(cell["press"], (None, None, False))[2], []).append(cell)
    failed = 0
    for eager, group in sorted(groups.items()):  # sdpa first, then eager
        prompt = Prompt(a, eager=eager)
        held = len(prompt.pressed) + 1 if eager else 0  # the recorded weights, and a question-aware [T, T] copy
        shared = None
        for cell in group:
            try:
                check_cell(cell["press"], cell.get("ratio"), cell.get("match_bytes"), cell.get("question_aware", False))
                own = False  # True: kept weights would not fit (or the press cannot run): a prefill of its own, if any
                if cell["press"] in PRESSES:
                    try:
                        check_press_runs(cell["press"], prompt.c.model_type, len(prompt.ids), prompt.c.num_attention_heads,
                                         prompt.itemsize, held)
                    except CellError:
                        own = True
                shared = shared or (None if own else SharedPrefill(prompt.model, prompt.ids, prompt.at, prompt.pressed))
                row = prompt.run_cell(cell["press"], cell.get("ratio"), cell.get("match_bytes"), cell.get("question_aware", False),
                                      shared=None if own else shared, held=0 if own else held)
            except CellError as e:
                failed += 1
                print(f"error: {cell.get('tag', cell['press'])}: {e}", file=sys.stderr, flush=True)
                continue
            emit(dict(row, tag=cell.get("tag")), a.out)
        del shared, prompt
    if failed:
        raise SystemExit(1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--hf", type=Path, required=True, help="a transformers model directory")
    src = common.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="the prompt text (UTF-8), tokenized as generate.py does")
    src.add_argument("--ids-file", type=Path, help='JSON: the prompt ids, or {"ids": [...], "question_at": N}')
    common.add_argument("--prompt-form", default="chat", choices=["chat", "completion"])
    common.add_argument("--question-start", default=None, help="text where the question starts (default: the last line)")
    common.add_argument("--max-new-tokens", type=int, default=32)
    common.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    common.add_argument("--threads", type=int, default=1)
    common.add_argument("--expect-sha256", default=None, help="refuse a prompt whose ids hash otherwise")
    common.add_argument("--quant-backend", default="quanto", choices=["quanto", "hqq"])
    common.add_argument("--quant-group", type=int, default=64)
    common.add_argument("--quant-residual", type=int, default=128)
    common.add_argument("--out", type=Path, default=None, help="also append each JSON line to this results file")
    r = sub.add_parser("run", parents=[common], help="one press on one prompt at one budget: one JSON line")
    r.add_argument("--question-aware", action="store_true", help="compress the question too (kvpress's default is not to)")
    r.add_argument("--press", required=True, help=f"no_press, {', '.join(PRESSES)}, {', '.join(QUANTIZED)}")
    budget = r.add_mutually_exclusive_group()
    budget.add_argument("--ratio", type=float, default=None, help="share of the compressed entries removed")
    budget.add_argument("--match-bytes", type=int, default=None, help="kv_device_bytes to match (generate.py --json)")
    c = sub.add_parser("cells", parents=[common], help="many cells on one prompt from one shared prefill: a JSON line each")
    c.add_argument("--cells", type=Path, required=True,
                   help='JSON list of {"press", "ratio" or "match_bytes", "question_aware", "tag"}')
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    return {"run": cmd_run, "cells": cmd_cells}[a.cmd](a)


if __name__ == "__main__":
    main()
