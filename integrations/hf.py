"""This project's KV caches inside a Hugging Face transformers model.

    from integrations import hf
    model, tok = hf.load(DIR)                          # an HFModel: the transformers model, "specache" attention
    caches = cache.setup_caches(model, "specache-1bit-best", 1, 4096)   # then generate.generate(model, ...)
    out = hf_model.generate(ids, custom_generate=generate.hf_generate, cache_config="specache-1bit-best",
                            max_new_tokens=64)          # on any transformers model of a supported family

    python generate.py --hf DIR --cache specache --bits 1 --k 64 --prompt "..."       # the CLI
    python generate.py --hf DIR --preset best --compile --prompt "..."    # the decode step as one graph
    python tools/eval.py niah --hf DIR --quick --out results/hf-niah

How the pieces fit (transformers >= 5.23, < 6):
  HFCache     a transformers `Cache` whose layers (CacheLayer) are this project's caches (cache.py:
              FullCache, LowBitCache = KIVI, zipcache.ZipCache, SpeCache, quantspec.QuantSpecCache). `update()`
              notes the step's K/V for the attention call that follows it in the same attention module.
  attention   registered with `AttentionInterface` as "specache" (with a mask function under the
              same name) by `register()`: hands (q, k, v, positions, mode) to the layer's cache, which
              stores them and computes attention itself (kernels.py: Triton on CUDA, torch reference on
              CPU). It finds the cache through its attention module, which HFModel points at the layer's
              slot. The caches mask by position (causal, sliding windows), so the mask function builds
              nothing; it refuses a padding mask on a forward HFModel did not announce.
  padding     a left-padded batch (transformers' attention mask, `left_padding`) runs through the batched
              caches with each row's first real slot (cache.setup_caches' row_start): the caches and their
              kernels never attend, select or fetch the padding, and a row's positions (RoPE) count from
              its first real token. The rows share the quantization groups and the residual window, so a
              low-bit row decodes as its prompt alone where its padding is a multiple of the window.
  HFModel     the transformers model seen through model.Transformer's interface (`args`, `layers[i]
              .attention.kv_cache`, `setup_caches`, `forward(idx, input_pos, mode)`): cache.setup_caches
              and generate.py's prefill / pre_decode / decode_step / generate run on it unchanged:
              Algorithm 1's prefill, Algorithm 2's pre-decoding, Algorithm 3's two-token steps with
              the speculative token's K/V dropped (mode "decode" keeps one).
generate.hf_generate is the decode loop for `model.generate(..., custom_generate=...)`.
"""
import copy
import json
import types
from pathlib import Path

import torch
import torch.nn as nn

from config import CacheConfig
from decoding import Decoding
from model import ModelArgs

NAME = "specache"  # the attn_implementation
VERSIONS = ("5.23", "6")  # tested with 5.23.0 (requirements-test.txt)
# Families whose attention goes through the standard interface with q/k/v as the caches store them
# (post-RoPE, one head_dim, no soft-capping or learned sinks, full or sliding-window layers);
# tests/test_hf.py checks each against transformers' own generate(). Gemma 3's local layers get a
# windowed fp cache (cache.setup_caches); Gemma 2 (attention soft-capping) is not supported.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmo", "olmo2", "olmoe",
             "phi", "phi3", "granite", "granitemoe", "starcoder2", "smollm3", "cohere", "helium", "ministral",
             "gemma3_text")


class HFError(ValueError):
    """A model or setting this adapter cannot run (the CLIs print it as one `error:` line)."""


def check_transformers():
    """Import transformers, or raise HFError when it is missing or outside the tested range."""
    try:
        import transformers
    except ImportError:
        raise HFError(f"--hf needs transformers: pip install 'transformers>={VERSIONS[0]},<{VERSIONS[1]}'") from None
    from packaging.version import Version
    v = Version(transformers.__version__)
    if not Version(VERSIONS[0]) <= v < Version(VERSIONS[1]):
        raise HFError(f"hf.py is tested with transformers >={VERSIONS[0]},<{VERSIONS[1]}, found {transformers.__version__}: "
                      f"pip install 'transformers>={VERSIONS[0]},<{VERSIONS[1]}'")
    return transformers


def check_model_type(model_type: str):
    if model_type not in SUPPORTED:
        raise HFError(f"model type {model_type!r} is not supported by the transformers adapter "
                      f"(supported: {', '.join(SUPPORTED)})")


# ---- the cache ---------------------------------------------------------------------------------------
def _layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class CacheLayer(CacheLayerMixin):
        """One layer: `slot.kv_cache` is the project's cache module (HFModel.layers[i].attention)."""
        is_compileable = False

        def __init__(self, slot, capacity):
            super().__init__()
            self.slot, self.capacity, self.is_initialized = slot, capacity, True

        def lazy_initialization(self, key_states, value_states):
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            return key_states, value_states  # the cache stores them when attention hands them over

        def get_mask_sizes(self, query_length):
            return self.capacity, 0

        def get_seq_length(self):
            return 0

        def get_max_length(self):
            return self.capacity

        def reset(self):
            raise HFError("an HFCache is not reset: build a new one (HFModel.setup_caches)")
    return CacheLayer


def _cache_class():
    from transformers.cache_utils import Cache

    class HFCache(Cache):
        """A transformers Cache over the project's caches. `mode` and `input_pos` of the next forward
        are set by HFModel.forward (`begin`); a forward without them (model(ids, past_key_values=
        cache)) is a prefill when it has more than one token or nothing is stored yet, else a
        one-token decode step, at the positions after the tokens stored so far (`seen()`).

        A compiled step reads no Python number that changes from step to step (each would be a
        guard, and a recompilation every step): an announced forward's cache length is its first
        position (a tensor), and it only records which positions it stored (`stored`); the count is
        read, with a host sync, by a forward nobody announced."""

        def __init__(self, slots, capacity):
            super().__init__(layers=[_CacheLayer(s, capacity) for s in slots])
            self.mode = self.input_pos = None
            self.stored = None  # (input_pos, kept) of the last forward that stored tokens: input_pos[:kept]
            self.inferred = None  # tokens of a forward whose step update() inferred (ends after the last layer)
            self.pending = None  # (layer, key) of the last update(): the attention call that belongs to it

        def begin(self, mode, input_pos):
            self.mode, self.input_pos = mode, input_pos

        def end(self, kept):
            if kept:
                self.stored = (self.input_pos, kept)
            self.mode = self.input_pos = None

        def seen(self) -> int:
            return 0 if self.stored is None else int(self.stored[0][self.stored[1] - 1]) + 1

        def get_seq_length(self, layer_idx: int = 0):
            return self.input_pos[0] if self.input_pos is not None else self.seen()

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx == 0 and self.mode is None:  # a forward that nobody announced: infer its step
                T, seen = key_states.shape[2], self.seen()
                self.begin("prefill" if T > 1 or seen == 0 else "decode", torch.arange(seen, seen + T, device=key_states.device))
                self.inferred = T
            self.pending = (layer_idx, key_states)
            return key_states, value_states

        def after_layer(self, layer_idx):
            if layer_idx == len(self.layers) - 1 and self.inferred is not None:
                self.end(self.inferred)  # prefill keeps every token, a one-token decode step its one
                self.inferred = None
    return HFCache


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The AttentionInterface function: the layer's cache stores k/v and attends (q [B,H,T,D] ->
    out [B,T,H,D], no weights). Runs in an HFModel's modules with its HFCache as past_key_values."""
    slot = getattr(module, "specache_slot", None)
    cache = slot.owner if slot is not None else None
    if cache is None or cache.pending is None or cache.pending[0] != module.layer_idx or cache.pending[1] is not key:
        raise HFError(f"attn_implementation {NAME!r} runs with this project's caches: use hf.HFModel (hf.load) with "
                      f"past_key_values=its .cache, or custom_generate=generate.hf_generate")
    layer_idx = module.layer_idx
    cache.pending = None
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise HFError("attention logit soft-capping and learned attention sinks are not implemented by the caches")
    D = query.shape[-1]
    if scaling is not None and abs(scaling * D ** 0.5 - 1) > 1e-6:
        query = query * (scaling * D ** 0.5)  # the caches scale by 1/sqrt(D)
    out = cache.layers[layer_idx].slot.kv_cache(query, key, value, cache.input_pos, cache.mode)
    cache.after_layer(layer_idx)
    return out.transpose(1, 2).contiguous(), None


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs):
    """The caches mask by position themselves, a padded batch's padding by the rows' first real slots given
    when they are set up (setup_caches' row_start), so the forward passes no mask."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise HFError("a padded batch's caches are set up with its rows' starts: generate with "
                      "custom_generate=generate.hf_generate and attention_mask=, or set them up with "
                      "setup_caches(..., row_start=hf.left_padding(mask, B, P))")
    return None


def left_padding(attention_mask, batch: int, length: int):
    """Each row's count of left padding ([B] int64) from transformers' attention mask [B, P] (1 = token),
    or None for a mask of ones. HFError for another shape, right padding, holes, or a row of padding only."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() != 2 or tuple(m.shape) != (batch, length):
        raise HFError(f"attention_mask of shape {tuple(m.shape)} for input_ids of shape {(batch, length)}")
    if not bool(((m == 0) | (m == 1)).all()):
        raise HFError("attention_mask holds values other than 0 and 1")
    m = m.long()
    n = m.sum(1)
    if bool((n == 0).any()):
        raise HFError(f"attention_mask: row {int((n == 0).nonzero()[0])} is padding only")
    if bool(m.all()):
        return None
    ones_after_first = torch.cumsum(m, 1) > 0  # from each row's first token on, every entry must be 1
    bad = (ones_after_first & (m == 0)).any(1)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        right = bool(m[b, -1] == 0)
        raise HFError(f"attention_mask: row {b} is " + ("right-padded: pad on the left (tokenizer.padding_side = 'left')"
                                                          if right else "not contiguous (a hole inside the prompt)"))
    return (length - n).to(torch.int64)


# transformers is optional: its subclasses are made, and the attention registered with it (a registry:
# from_pretrained(attn_implementation=NAME) looks the function up there), on first use.
_CacheLayer = _HFCache = None


def register():
    """Make attn_implementation "specache" known to transformers (HFModel and load() call it)."""
    global _CacheLayer, _HFCache
    if _HFCache is not None:
        return
    check_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask)
    _CacheLayer, _HFCache = _layer_class(), _cache_class()


# ---- the project's model interface over a transformers model ----------------------------------------
def layer_windows(config) -> list:
    """Each layer's sliding window, None for a global layer (as transformers' own caches read
    `layer_types`, else `sliding_window`). Raises HFError for other layer kinds."""
    c = config.get_text_config()
    window = getattr(c, "sliding_window", None)
    kinds = getattr(c, "layer_types", None) or \
        ["full_attention" if window is None else "sliding_attention"] * c.num_hidden_layers
    if not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise HFError(f"model type {c.model_type!r}: layers of kinds {', '.join(sorted(set(kinds)))}; the caches "
                      f"implement full and sliding-window attention")
    return [window if kind == "sliding_attention" else None for kind in kinds]


def model_args(config) -> ModelArgs:
    """ModelArgs of a transformers config: what the caches and the byte accounting need, with each
    layer's sliding window (cache.setup_caches gives a windowed layer its windowed fp cache)."""
    c = config.get_text_config()
    windows = layer_windows(config)
    heads = c.num_attention_heads
    return ModelArgs(name=getattr(c, "_name_or_path", "") or c.model_type, dim=c.hidden_size, n_layers=c.num_hidden_layers,
                     n_heads=heads, n_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                     head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
                     intermediate_size=getattr(c, "intermediate_size", 0), max_seq_len=c.max_position_embeddings,
                     tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                     sliding_window=windows[0] if len(set(windows)) == 1 else None,
                     layer_windows=tuple(windows) if len(set(windows)) > 1 else None)


class HFModel(nn.Module):
    """A transformers causal LM behind model.Transformer's interface: cache.setup_caches attaches the
    project's caches (`setup_caches`), and `forward(idx, input_pos, mode)` runs the transformers
    forward with them through the "specache" attention. Returns fp32 logits (prefill: the last
    position's only, which is all prefill() reads)."""

    def __init__(self, hf_model):
        super().__init__()
        register()
        check_model_type(hf_model.config.model_type)
        self.hf = hf_model
        self.args = model_args(hf_model.config)
        self.row_start = None  # [B] a left-padded batch's first real slot per row (the caches', setup_caches)
        if hf_model.config._attn_implementation != NAME:
            hf_model.set_attn_implementation(NAME)
        self._new_layers()

    def _new_layers(self):
        """The slots the caches hang in (as model.Transformer's layers[i].attention.kv_cache), the
        transformers Cache over them, and each attention module pointed at its layer's slot."""
        self.layers = [types.SimpleNamespace(attention=types.SimpleNamespace(kv_cache=None, owner=None))
                       for _ in range(self.args.n_layers)]
        self.cache = _HFCache([layer.attention for layer in self.layers], self.args.max_seq_len)
        bound = set()
        for m in self.hf.modules():
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int):
                m.specache_slot = self.layers[m.layer_idx].attention
                m.specache_slot.owner = self.cache
                bound.add(m.layer_idx)
        if len(bound) != self.args.n_layers:
            raise HFError(f"found attention modules for {len(bound)} of {self.args.n_layers} layers")

    @property
    def tok_embeddings(self):
        return self.hf.get_input_embeddings()

    def setup_caches(self, make_cache, row_start=None) -> list:
        """make_cache(i) per layer (model.Transformer.setup_caches): caches of the batch's rows together, at the
        same slots; row_start [B]: each row's first real slot (a left-padded batch), its positions counted from it."""
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = make_cache(i)
        self.cache.stored, self.row_start = None, row_start
        return [layer.attention.kv_cache for layer in self.layers]

    def forward(self, idx, input_pos, mode="decode"):
        B, T = idx.shape
        if self.row_start is not None and len(self.row_start) != B:
            raise HFError(f"the caches were set up for a batch of {len(self.row_start)} rows, not {B}")
        row_start = self.row_start if self.row_start is not None else input_pos.new_zeros(1)
        self.cache.begin(mode, input_pos)
        try:  # (each row's positions count from its first real slot)
            out = self.hf(input_ids=idx, position_ids=(input_pos[None] - row_start[:, None]).clamp(min=0).expand(B, T),
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1 if mode == "prefill" else 0)
        finally:
            self.cache.end({"prefill": T, "decode": 1}.get(mode, 0))
        return out.logits.float()

    def int4_draft(self, group=32) -> "HFModel":
        """QuantSpec's draft (quantspec.make_draft): the same module tree with every linear layer of
        the decoder and the head replaced by a group-wise INT4 copy (biases kept in full precision);
        embeddings, norms and rotary tables are shared. The caches are shared by share_caches."""
        from siblings.quantspec import Int4Linear

        def swap(m):
            if isinstance(m, nn.Linear):
                if m.in_features % group:
                    raise HFError(f"QuantSpec's INT4 draft needs in_features ({m.in_features}) divisible by "
                                  f"--draft-group {group}")
                q = Int4Linear(m.weight.detach(), group)
                return q if m.bias is None else _Biased(q, m.bias.detach())
            new = copy.copy(m)
            new._modules = {n: swap(c) if c is not None else None for n, c in m._modules.items()}
            return new

        draft = copy.copy(self)
        draft._modules = dict(self._modules, hf=swap(self.hf))
        draft._new_layers()
        return draft


class _Biased(nn.Module):
    def __init__(self, linear, bias):
        super().__init__()
        self.linear, self.bias = linear, bias

    def forward(self, x):
        return self.linear(x) + self.bias.to(x.dtype)


class HFTokenizer:
    """A transformers tokenizer behind tokenizer.Tokenizer's interface (encode, encode_prompt, chat,
    decode, bos_id, eos_ids, add_bos)."""

    def __init__(self, tok, eos_ids=()):
        self.tok = tok
        self.bos_id = tok.bos_token_id
        self.eos_ids = set(eos_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        probe = tok("a")["input_ids"]
        self.add_bos = self.bos_id is not None and bool(probe) and probe[0] == self.bos_id

    @property
    def bos_text(self):
        return self.tok.bos_token or ""

    def encode(self, text, bos=False):
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def encode_prompt(self, text, chat=False):
        return self.encode(self.chat(text), bos=False) if chat else self.encode(text, bos=self.add_bos)

    def chat(self, prompt, system=None):
        if not self.tok.chat_template:
            return prompt
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "tiktoken.model")


def read_config(path) -> dict:
    """config.json of a transformers model directory of a supported family; HFError otherwise."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except OSError as e:
        raise HFError(f"{path} is not a transformers model directory: cannot read config.json ({e.strerror})") from None
    except ValueError as e:
        raise HFError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    check_model_type(cfg.get("model_type", "unknown"))
    return cfg


def ids_list(v) -> list:
    return [] if v is None else [v] if isinstance(v, int) else list(v)


def check_tokenizer_files(path):
    """HFError for a directory without tokenizer files (transformers' own message there is about
    installing sentencepiece or tiktoken)."""
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise HFError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, ...): save the tokenizer "
                      f"next to the weights (tokenizer.save_pretrained(DIR))")


def load_tokenizer(path, eos_ids=None, any_transformers=False) -> "HFTokenizer":
    """The HFTokenizer of a transformers model directory (HFError as load() gives it). eos_ids:
    default generation_config.json's, else config.json's. any_transformers: a tokenizer only, so any transformers
    version will do (the vLLM venv's is older than the adapter's)."""
    path = Path(path)
    cfg = read_config(path)
    if any_transformers:
        import transformers
    else:
        transformers = check_transformers()
    check_tokenizer_files(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    if eos_ids is None:
        gen = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").is_file() else {}
        eos_ids = ids_list(gen.get("eos_token_id", cfg.get("eos_token_id")))
    return HFTokenizer(tok, eos_ids)


def load(path, device="cpu", dtype=torch.float32):
    """(HFModel, HFTokenizer) of a transformers model directory (config.json, safetensors, tokenizer
    files). Raises HFError for a missing directory, missing tokenizer files, an unsupported family or
    transformers version."""
    path = Path(path)
    read_config(path)
    transformers = check_transformers()
    check_tokenizer_files(path)  # before the weights are read
    register()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=NAME)
    model = model.to(device).eval()
    return HFModel(model), load_tokenizer(path, ids_list(model.generation_config.eos_token_id))


# ---- model.generate(ids, custom_generate=generate.hf_generate, ...): what transformers hands the loop --------
WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
STOPPERS = ("MaxLengthCriteria", "EosTokenCriteria")


def check_generation(config: CacheConfig, logits_processor, stopping_criteria, generation_config):
    """HFError for what generate.hf_generate does not run: QuantSpec's draft-and-verify loop, beams, a
    result dict, logits processors other than sampling's warpers, stopping criteria other than length and eos."""
    if config.kind == "quantspec":
        raise HFError("QuantSpec is a draft-and-verify loop: run it with generate.py --hf DIR --method quantspec")
    other = [type(p).__name__ for p in (logits_processor or []) if type(p).__name__ not in WARPERS]
    other += [type(s).__name__ for s in (stopping_criteria or []) if type(s).__name__ not in STOPPERS]
    if other or generation_config.num_beams > 1 or generation_config.return_dict_in_generate:
        raise HFError(f"custom_generate=generate.hf_generate does greedy decoding or plain sampling; not "
                      f"supported here: {', '.join(other) or 'beams / return_dict_in_generate'}")


def generation_decoding(generation_config, prompt_len: int, streaming: bool) -> Decoding:
    """generation_config as the loop's Decoding: tokens up to max_length, greedy or sampled at temperature 1
    (the warpers, `Warped`, do the rest), its eos ids; a streamer reads each token, so eos is read each step."""
    eos = generation_config.eos_token_id
    eos = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
    return Decoding(generation_config.max_length - prompt_len, temperature=1.0 if generation_config.do_sample else 0.0,
                    eos_ids=eos, eos_check_every=1 if streaming else Decoding.eos_check_every)


def pad_after_eos(out: torch.Tensor, eos_ids: frozenset, pad_token_id) -> torch.Tensor:
    """out [B, N] with each row's tokens after its first eos replaced by pad_token_id (else the smallest
    eos id), as transformers pads the rows that ended."""
    if not eos_ids:
        return out
    pad = pad_token_id if pad_token_id is not None else min(eos_ids)
    eos = torch.tensor(sorted(eos_ids), device=out.device)
    ended = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for i in range(out.shape[1]):
        out[:, i] = torch.where(ended, pad, out[:, i])
        ended |= torch.isin(out[:, i], eos)
    return out


class Warped:
    """HFModel with transformers' sampling warpers applied to each row's logits: sample() at
    temperature 1 then draws from softmax(warped logits), which is what transformers samples
    (generate.hf_generate)."""

    def __init__(self, view, warpers):
        self.view, self.layers, self.warpers = view, view.layers, warpers

    def __call__(self, idx, input_pos, mode="decode"):
        logits = self.view(idx, input_pos, mode)
        return self.warpers(None, logits.flatten(0, -2)).view_as(logits)
