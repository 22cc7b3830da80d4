"""The methods a user would pick instead of SpeCache, run in the kvpress venv (kvpress needs transformers
<5.3, hf.py >=5.23, so this module imports none of the project's root modules): KV eviction "presses"
from NVIDIA's kvpress (StreamingLLM, H2O, SnapKV, PyramidKV, Knorm, ...) and transformers'
QuantizedCache (KIVI-like, with departures: docs/baselines.md), greedy, batch 1. tools/baselines_grid.py
drives the grid; docs/baselines.md has the loop, the byte arithmetic and the results. The bytes are
those of a 16-bit deployment (tools/baselines_bytes.py), the prefill side is tools/baselines_prefill.py.

    make venv-kvpress
    .venv-kvpress/bin/python tools/baselines.py run --hf checkpoints/smollm2-135m-hf --prompt-file needle.txt \
        --press snapkv --match-bytes 7340032 --max-new-tokens 32        # one JSON line, as generate.py --json
    .venv-kvpress/bin/python tools/baselines.py cells --hf DIR --ids-file IDS --cells CELLS.json   # one prefill, many cells

`run`: prefill the context with the press's hook on each full-attention layer (a sliding layer keeps
its window, as this project's caches keep a ring of it), then the question one token at a time at its
real positions, then new tokens. `cells`: the same cells from one recorded prefill (SharedPrefill).
Every row carries prompt_sha256 (sha256 of the comma-joined ids); --ids-file passes the project's ids.
Run from another Python, it re-executes itself with .venv-kvpress/bin/python. Bad input (an unknown
press, a budget that keeps nothing, a prompt longer than the model's positions, no model directory):
one `error:` line, exit code 2; `cells` skips a cell that cannot run and exits 1 after the others.
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
sys.path.insert(0, str(ROOT))  # tools.baselines_* (no project root module is imported)
from tools.baselines_bytes import (DEPLOYED_ITEMSIZE, CellError, check_ratio_keeps, device_bytes,  # noqa: E402
                                   entry_bytes, kept_for_bytes, layer_bytes, pyramid_applies,
                                   pyramid_layer_budget, pyramid_ratio_for, ratio_for)
from tools.baselines_prefill import COLSUM, Hooked, SharedPrefill, record_colsums  # noqa: E402

KVPRESS_PYTHON = Path(os.environ.get("KVPRESS_PYTHON", ROOT / ".venv-kvpress" / "bin" / "python"))
REEXEC = "SPECACHE_BASELINES_REEXEC"

# name: (kvpress class, its arguments, scores by the prefill's attention weights: their column sums,
# tools/baselines_prefill.py). Budgets come from --ratio/--match-bytes.
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
    """Bad input: one `error:` line on stderr, exit code 2."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def ids_sha256(ids) -> str:
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


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


def layer_windows(c: dict) -> list:
    """Each layer's sliding window, None for a full-attention layer (the ones a press compresses), from
    a text config as a dict (config.json's, or its `text_config`)."""
    window = c.get("sliding_window")
    kinds = c.get("layer_types") or ["full_attention" if window is None else "sliding_attention"] * c["num_hidden_layers"]
    return [window if kind == "sliding_attention" else None for kind in kinds]


def read_text_config(path: Path) -> dict:
    """The model directory's text config (config.json, or its text_config), or an error line."""
    try:
        c = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        fail(f"{path} is not a transformers model directory (no config.json); the default model: "
             f"`python tools/baselines_grid.py hf-checkpoint --out {path}` in the project venv")
    except (OSError, ValueError) as e:
        fail(f"cannot read {path / 'config.json'}: {e}")
    return c.get("text_config") or c


def load_model(path: Path, dtype):
    """(model, tokenizer), the model's attention sdpa's plus H2O's column sums (baselines_prefill.COLSUM)."""
    import transformers
    from tools.baselines_prefill import register_colsum_attention
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    read_text_config(path)
    register_colsum_attention()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=COLSUM).eval()
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


def greedy_after_prefill(model, ids, start, cache, logits, max_new, eos_ids):
    """Greedy from a filled cache: ids[start:] one token at a time at their real positions, then new
    tokens up to max_new or an end token. `logits`: the prefill's last position's. Returns (new ids,
    seconds for the prompt's rest, decode seconds, (peak held bytes as run, the same in 16 bits))."""
    import torch

    def step(token, pos):
        p = torch.tensor([pos])
        return model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=p[None],
                     cache_position=p, use_cache=True).logits[0, -1]

    def held():
        return [sum(layer_bytes(layer, deployed) for layer in cache.layers) for deployed in (False, True)]

    with torch.no_grad():
        t0 = time.perf_counter()
        for pos in range(start, len(ids)):
            logits = step(ids[pos], pos)
        t1 = time.perf_counter()
        out, peak = [], held()
        for i in range(max_new):
            token = int(logits.argmax())
            out.append(token)
            if token in eos_ids or i == max_new - 1:
                break
            logits = step(token, len(ids) + i)
            peak = [max(a, b) for a, b in zip(peak, held())]
    return out, t1 - t0, time.perf_counter() - t1, peak


def kept_entries(cache) -> list:
    """Entries each layer holds (a quantized layer: the positions it represents)."""
    return [int(layer.cumulative_length) if hasattr(layer, "_quantized_keys") else int(layer.keys.shape[-2])
            for layer in cache.layers]


class Fallback(CellError):
    """A press that at this budget would run as another press does (PyramidKV below its pyramid's minimum):
    not run; `cells` gives a row that names the press it equals."""

    def __init__(self, msg, equals):
        super().__init__(msg)
        self.equals = equals


def make_press(kvpress, name: str, pressed):
    """The press; PyramidKV with its pyramid spread over the pressed layers (baselines_bytes.pyramid_layer_budget)."""
    cls, kwargs, _ = PRESSES[name]
    base = getattr(kvpress, cls)
    if name != "pyramidkv":
        return base(**kwargs)

    class PressedLayersPyramid(base):
        def pyramid_budget(self, module, q_len):  # kvpress's own budget for a layer of a model
            return base.get_layer_budget(self, module, q_len)

        def get_layer_budget(self, module, q_len):
            return pyramid_layer_budget(self, module.layer_idx, pressed, q_len)
    return PressedLayersPyramid(**kwargs)


def check_press_runs(name: str, model_type: str, n_compressed: int):
    """A press that cannot run on this prompt or model: say which and why (CellError)."""
    if name == "expected_attention" and model_type.startswith("gemma3"):
        raise CellError(f"press expected_attention cannot run on model type {model_type!r}: under transformers 5.2 it "
                        f"calls the rotary embedding without the layer type that Gemma 3's rotary embedding needs (one per layer kind)")
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


class Layout:
    """What the byte arithmetic needs of a model, from its text config (a dict): each layer's window, the
    pressed (full-attention) layers, an entry's bytes in 16 bits and as run, the positions it takes."""

    def __init__(self, c: dict, itemsize: int):
        self.model_type, self.positions = c.get("model_type", "?"), c.get("max_position_embeddings")
        self.windows = layer_windows(c)
        self.pressed = [i for i, w in enumerate(self.windows) if w is None]
        if not self.pressed:
            fail(f"model type {self.model_type!r}: every layer is a sliding-window layer; there is nothing to press")
        dims = (c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        self.entry, self.entry_as_run = entry_bytes(*dims, DEPLOYED_ITEMSIZE), entry_bytes(*dims, itemsize)

    def check_prompt(self, n_prompt: int, max_new: int):
        if self.positions and n_prompt + max_new > self.positions:
            fail(f"prompt ({n_prompt} tokens) + --max-new-tokens ({max_new}) exceeds the model's {self.positions} positions")

    def context_kept(self, ratio, match_bytes, n_prompt: int, n_compressed: int, max_new: int):
        """Context entries a pressed layer keeps at --match-bytes (None at a --ratio); CellError when the
        budget keeps none."""
        if match_bytes is not None:
            return kept_for_bytes(match_bytes, self.windows, n_prompt, n_compressed, max_new, self.entry)
        check_ratio_keeps(ratio, n_compressed)


def read_ids(path: Path):
    """(ids, index of the first question token) of an --ids-file."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        fail(f"cannot read --ids-file {path}: {e}")
    if isinstance(spec, list):
        spec = dict(ids=spec)
    try:
        ids = [int(i) for i in spec["ids"]]
        return ids, int(spec.get("question_at", len(ids)))
    except (KeyError, TypeError, ValueError) as e:
        fail(f"--ids-file {path}: expected a list of ids or {{\"ids\": [...], \"question_at\": N}} ({e})")


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def preflight(a) -> Layout:
    """The checks that need neither kvpress nor the model's weights (so they answer at once, from any
    Python): --max-new-tokens, the model directory, and with --ids-file the prompt's length."""
    if a.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    layout = Layout(read_text_config(a.hf), ITEMSIZE[a.dtype])
    if a.ids_file:
        layout.check_prompt(len(read_ids(a.ids_file)[0]), a.max_new_tokens)
    return layout


class Prompt:
    """The model, the prompt's ids and the layer facts every cell on it shares."""

    def __init__(self, a, layout: Layout):
        import torch
        self.kvpress = import_kvpress()
        torch.set_num_threads(a.threads)
        self.a, self.dtype, self.layout = a, getattr(torch, a.dtype), layout
        self.model, self.tok = load_model(a.hf, self.dtype)
        if a.ids_file:
            self.ids, self.at = read_ids(a.ids_file)
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
        self.c = self.model.config.get_text_config()
        layout.check_prompt(len(self.ids), a.max_new_tokens)
        self.windows, self.pressed = layout.windows, layout.pressed
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else eos or [])

    def make_cache(self, name):
        import transformers
        a = self.a
        if name in QUANTIZED:
            return lambda: transformers.QuantizedCache(backend=a.quant_backend, config=self.model.config, nbits=QUANTIZED[name],
                                                       q_group_size=a.quant_group, residual_length=a.quant_residual)
        return lambda: transformers.DynamicCache(config=self.model.config)

    def press_for(self, name, ratio, match_bytes, n_compressed):
        """The press at its budget: (press, ratio). Fallback where PyramidKV would be SnapKV."""
        L = self.layout
        n = L.context_kept(ratio, match_bytes, len(self.ids), n_compressed, self.a.max_new_tokens)
        press = make_press(self.kvpress, name, self.pressed)
        press.post_init_from_model(self.model)
        if n is not None:
            ratio = (pyramid_ratio_for(press, n * len(self.pressed), self.pressed, n_compressed)
                     if name == "pyramidkv" else ratio_for(n, n_compressed))
        press.compression_ratio = ratio
        if name == "pyramidkv" and not pyramid_applies(press, self.pressed, n_compressed):
            raise Fallback(f"press pyramidkv at ratio {ratio:.4f} of {n_compressed} compressed tokens keeps "
                           f"{round(n_compressed * (1 - ratio))} entries a layer, under the {20 * SNAPKV_WINDOW} its pyramid "
                           f"needs (1/beta of the mean >= its window): kvpress runs SnapKV's single budget (run snapkv)",
                           "snapkv")
        return press, ratio

    def run_cell(self, name, ratio=None, match_bytes=None, question_aware=False, shared=None):
        """One press at one budget (or no_press, or a QuantizedCache): the JSON row. Through kvpress's own
        hook in a prefill of its own, or from `shared` (a SharedPrefill of this prompt)."""
        import torch
        import transformers
        a, ids, c, model, L = self.a, self.ids, self.c, self.model, self.layout
        check_cell(name, ratio, match_bytes, question_aware)
        n_compressed = len(ids) if question_aware else self.at
        max_new = a.max_new_tokens
        row = dict(press=name, question_aware=bool(question_aware), ratio=None, target_bytes=match_bytes)
        press, colsums = None, PRESSES.get(name, (0, 0, False))[2]
        if name in PRESSES:
            check_press_runs(name, c.model_type, n_compressed)
            press, row["ratio"] = self.press_for(name, ratio, match_bytes, n_compressed)
        if name in QUANTIZED:
            row.update(quant_backend=a.quant_backend, quant_group=a.quant_group, quant_residual=a.quant_residual)
        try:
            if shared is None:
                t0, cache = time.perf_counter(), self.make_cache(name)()
                hooked = Hooked(model, press.forward_hook, self.pressed) if press else contextlib.nullcontext()
                record_colsums(model, self.pressed, colsums)
                with torch.no_grad(), hooked:
                    logits = model(input_ids=torch.tensor([ids[:n_compressed]]), past_key_values=cache, use_cache=True,
                                   logits_to_keep=1).logits[0, -1]  # the prefill, pressed by kvpress's own hook
                record_colsums(model, self.pressed, False)
            else:
                t0 = time.perf_counter()
                cache = shared.cache(n_compressed, self.make_cache(name), press, colsums)
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

        def held(entry):  # a QuantizedCache: its codes, scales and fp residual at their largest; else the entries
            return device_bytes(kept, self.windows, len(ids), n_compressed, max_new, entry)
        kv_bytes = peak[1] if name in QUANTIZED else held(L.entry)
        row.update({
            "text": self.tok.decode(out), "tokens": out,
            "prompt_tokens": len(ids), "prompt_sha256": self.sha, "compressed_tokens": n_compressed,
            "question_tokens": len(ids) - n_compressed,
            "kept_per_layer": kept, "pressed_layers": self.pressed if name in PRESSES else [],
            "kv_device_bytes": kv_bytes, "kv_device_bytes_as_run": peak[0] if name in QUANTIZED else held(L.entry_as_run),
            "kv_held_peak_bytes": peak[0], "kv_entry_bytes": L.entry, "kv_entry_bytes_as_run": L.entry_as_run,
            "kv_fp_full_bytes": device_bytes([n_compressed] * len(self.windows), self.windows, len(ids), n_compressed,
                                             max_new, L.entry),
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
        layout = preflight(a)
        if a.ids_file and a.press in PRESSES:  # a budget that keeps nothing, before the model loads
            ids, at = read_ids(a.ids_file)
            layout.context_kept(a.ratio, a.match_bytes, len(ids), len(ids) if a.question_aware else min(at, len(ids)),
                                a.max_new_tokens)
        row = Prompt(a, layout).run_cell(a.press, a.ratio, a.match_bytes, a.question_aware)
    except CellError as e:
        fail(str(e))
    emit(row, a.out)
    return row


def cmd_cells(a):
    """Cells on one prompt from one shared prefill (H2O's column sums recorded in it when a cell needs
    them): a JSON line per finished cell (with its `tag`), or for a PyramidKV cell that would be SnapKV
    a line that says so (`equals`); one that cannot run prints its tagged `error:` line; exit 1 if any did."""
    try:
        cells = json.loads(a.cells.read_text())
    except (OSError, ValueError) as e:
        fail(f"cannot read --cells {a.cells}: {e}")
    prompt = Prompt(a, preflight(a))
    colsums = any(PRESSES.get(cell["press"], (0, 0, False))[2] for cell in cells)
    shared, failed = None, 0
    for cell in cells:
        tag = cell.get("tag", cell["press"])
        try:
            check_cell(cell["press"], cell.get("ratio"), cell.get("match_bytes"), cell.get("question_aware", False))
            shared = shared or SharedPrefill(prompt.model, prompt.ids, prompt.at, prompt.pressed, colsums)
            row = prompt.run_cell(cell["press"], cell.get("ratio"), cell.get("match_bytes"), cell.get("question_aware", False),
                                  shared=shared)
        except Fallback as e:
            emit(dict(tag=tag, press=cell["press"], equals=e.equals, why=str(e), prompt_sha256=prompt.sha), a.out)
            continue
        except CellError as e:
            failed += 1
            print(f"error: {tag}: {e}", file=sys.stderr, flush=True)
            continue
        emit(dict(row, tag=tag), a.out)
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
    budget.add_argument("--match-bytes", type=int, default=None, help="kv_device_bytes to match: 16-bit bytes, as generate.py --json gives them")
    c = sub.add_parser("cells", parents=[common], help="many cells on one prompt from one shared prefill: a JSON line each")
    c.add_argument("--cells", type=Path, required=True,
                   help='JSON list of {"press", "ratio" or "match_bytes", "question_aware", "tag"}')
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    return {"run": cmd_run, "cells": cmd_cells}[a.cmd](a)


if __name__ == "__main__":
    main()
