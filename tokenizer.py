"""Tokenizers behind one small interface, plus the chat templates of the model families.

Kinds (config.json's "tokenizer" entry, written by convert_hf.py, says which one a checkpoint uses):
  sentencepiece  tokenizer.model protobuf (Llama-2, Mistral), run by the `sentencepiece` package
  tiktoken       Llama-3's tokenizer.model (base64 token + rank per line) and its 256 special tokens
  gpt2-bpe       byte-level BPE from a Hugging Face tokenizer.json (SmolLM2, Llama-3 HF, GPT-2 style),
                 run by tiktoken for speed
Interface: encode(text, bos=False) -> ids, encode_prompt(text, chat) -> ids as the model expects them
(BOS by the tokenizer's own add_bos setting), decode(ids) -> text, bos_id, eos_ids, add_bos, and
chat(prompt, system=None) -> prompt text wrapped in the family's template (special tokens as text;
encode() maps them back to their ids).
"""
import base64
import json
import unicodedata
from pathlib import Path

import regex  # tiktoken's own dependency; same \p{..} regex dialect as tiktoken and HF tokenizers
import tiktoken

# GPT-2's pre-tokenizer (HF ByteLevel with use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 ("smollm"): HF Digits(individual_digits) then ByteLevel's GPT-2 regex on each stretch between
# digits, folded into one regex: a digit is a piece of its own, and a digit ends a stretch, so the
# whitespace rule `\s+(?!\S)` also stops before a digit (`\p{N}` is allowed after the run).
SMOLLM_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen2 (tokenizer.json's Split regex): Llama-3's, but every digit a piece of its own.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Llama-3.1's special tokens, ids len(ranks) + i (128000 + i for the real model).
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(3, 256 - len(LLAMA3_SPECIALS) + 3)]


# ---- chat templates: (prompt, system or None, bos text) -> text. They include the BOS token as text
# where the family's template does, so encode the result with bos=False.
def _none(prompt, system, bos):
    return prompt


def _chatml(prompt, system, bos):  # SmolLM2 / Qwen style; system is None => no system turn
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return head + f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _llama2(prompt, system, bos):
    if system:
        prompt = f"<<SYS>>\n{system}\n<</SYS>>\n\n{prompt}"
    return f"{bos}[INST] {prompt.strip()} [/INST]"


def _mistral(prompt, system, bos):  # Mistral has no system turn: it goes in front of the user message
    if system:
        prompt = f"{system}\n\n{prompt}"
    return f"{bos}[INST] {prompt} [/INST]"


def _llama3(prompt, system, bos):
    turn = lambda role, text: f"<|start_header_id|>{role}<|end_header_id|>\n\n{text.strip()}<|eot_id|>"
    head = turn("system", system) if system else ""
    return f"{bos}{head}{turn('user', prompt)}<|start_header_id|>assistant<|end_header_id|>\n\n"


CHAT_TEMPLATES = {"none": _none, "chatml": _chatml, "llama2": _llama2, "mistral": _mistral, "llama3": _llama3}


class Tokenizer:
    """What generation needs from a tokenizer. Subclasses set self.specials (text -> id) and
    implement _encode and decode."""

    def __init__(self, bos_id=None, eos_ids=(), chat_template="none", system_prompt=None, add_bos=False):
        if chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"unknown chat template {chat_template!r}; known: {sorted(CHAT_TEMPLATES)}")
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids or ())
        self.chat_template = chat_template
        self.system_prompt = system_prompt  # the template's default system prompt (SmolLM2 has one)
        self.add_bos = add_bos  # whether the model was trained with BOS at the start of a document

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self._encode(text)
        return [self.bos_id] + ids if bos and self.bos_id is not None else ids

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        """Ids of a prompt, the way the model expects it: a chat turn (its template writes the BOS
        token where the family's does), or plain text with BOS only if the tokenizer adds one
        (tokenizer_config.json's / GGUF's add_bos_token; SmolLM2: no)."""
        if chat:
            return self.encode(self.chat(text), bos=False)
        return self.encode(text, bos=self.add_bos)

    def decode(self, ids) -> str:
        raise NotImplementedError

    def chat(self, prompt: str, system: str | None = None) -> str:
        """Prompt wrapped for a single user turn, ending where the assistant's answer starts."""
        system = self.system_prompt if system is None else system
        return CHAT_TEMPLATES[self.chat_template](prompt, system, self.bos_text)

    @property
    def bos_text(self) -> str:
        """The BOS token as text ("" without one): encode() reads it back as the BOS id."""
        return self.id_to_special.get(self.bos_id, "") if self.bos_id is not None else ""

    @property
    def id_to_special(self):
        return {i: s for s, i in self.specials.items()}

    def _split_specials(self, text):
        """Yield (is_special, part): special-token text is cut out before normal tokenization."""
        if not self.specials:
            yield False, text
            return
        if not hasattr(self, "_special_re"):
            alternatives = sorted(self.specials, key=len, reverse=True)  # longest first
            self._special_re = regex.compile("(" + "|".join(map(regex.escape, alternatives)) + ")")
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2 or part:
                yield bool(i % 2), part


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path, bos_id=None, eos_ids=None, **kw):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        n = self.sp.get_piece_size()
        # sentencepiece never parses control pieces (<s>, </s>, Mistral-v3's [INST]) out of text, so we
        # split them out ourselves and chat() text encodes to the right ids.
        self.specials = {self.sp.id_to_piece(i): i for i in range(n) if self.sp.is_control(i)}
        self.specials.pop("", None)
        if bos_id is None and self.sp.bos_id() >= 0:
            bos_id = self.sp.bos_id()
        if eos_ids is None:
            eos_ids = [self.sp.eos_id()] if self.sp.eos_id() >= 0 else []
        super().__init__(bos_id, eos_ids, **kw)

    def _encode(self, text):
        ids = []
        for is_special, part in self._split_specials(text):
            # each plain segment gets sentencepiece's dummy-prefix space, as in Meta's llama2 chat code
            ids += [self.specials[part]] if is_special else self.sp.encode(part)
        return ids

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self):
        return self.sp.get_piece_size()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, used to spell tokens in tokenizer.json."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The single regex equivalent to a tokenizer.json byte-level pre_tokenizer."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [s.get("type") for s in steps]
    if kinds and kinds[-1] == "ByteLevel" and steps[-1].get("add_prefix_space"):
        raise ValueError("ByteLevel add_prefix_space=true is not supported")
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return GPT2_PATTERN
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return SMOLLM_PATTERN
    if (kinds == ["Split", "ByteLevel"] and "Regex" in steps[0].get("pattern", {})
            and not steps[1].get("use_regex", True) and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert")):
        return steps[0]["pattern"]["Regex"]  # Llama-3 style
    raise ValueError(f"unsupported tokenizer.json pre_tokenizer: {kinds}")


class BPETokenizer(Tokenizer):
    """Byte-level BPE run by tiktoken.

    ranks: token bytes -> merge priority (lower merges first). It is the token id when the vocabulary's
    ids follow merge order (GPT-2, SmolLM2, Llama-3); otherwise rank_to_id translates.
    Bytes with no single-byte token (SmolLM2 lacks 21, e.g. 0x04 and 0xf5-0xff) are dropped like HF's
    BPE with unk_token=null does: they vanish before BPE, so their neighbours may merge across the gap.
    """

    def __init__(self, ranks, pattern, specials, rank_to_id=None, extra_tokens=None, nfc=False, **kw):
        self.specials = dict(specials)
        self.rank_to_id = rank_to_id
        self.nfc = nfc  # compose the text to Unicode NFC first (Qwen2's tokenizer.json normalizer)
        self.enc = tiktoken.Encoding("bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.specials)
        self.pattern = regex.compile(pattern)
        self.missing_bytes = bytes(b for b in range(256) if bytes([b]) not in ranks)
        id_bytes = {(rank_to_id or {}).get(r, r): b for b, r in ranks.items()}
        id_bytes.update(extra_tokens or {})  # tokens BPE never produces but a model may still emit
        id_bytes.update({i: s.encode() for s, i in self.specials.items()})
        self.id_to_bytes = [b""] * (max(id_bytes) + 1)
        for i, b in id_bytes.items():
            self.id_to_bytes[i] = b
        super().__init__(**kw)

    @classmethod
    def from_tiktoken_file(cls, path, bos_id=None, eos_ids=None, **kw):
        """Llama-3's tokenizer.model: ranks are the ids; the 256 special tokens follow them."""
        ranks = {}
        for line in Path(path).read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        specials = {s: len(ranks) + i for i, s in enumerate(LLAMA3_SPECIALS)}
        bos_id = specials["<|begin_of_text|>"] if bos_id is None else bos_id
        if eos_ids is None:
            eos_ids = [specials[s] for s in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
        return cls(ranks, LLAMA3_PATTERN, specials, bos_id=bos_id, eos_ids=eos_ids, **kw)

    @classmethod
    def from_tokenizer_json(cls, path, **kw):
        tj = json.loads(Path(path).read_text(encoding="utf-8"))
        model, normalizer = tj["model"], tj.get("normalizer")
        if model.get("type") != "BPE" or normalizer not in (None, {"type": "NFC"}) or model.get("byte_fallback"):
            raise ValueError(f"{path}: only byte-level BPE tokenizer.json files are supported (normalizer: none or NFC)")
        pattern = pattern_from_pre_tokenizer(tj.get("pre_tokenizer"))
        specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
        special_ids = set(specials.values())
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        to_bytes = lambda token: bytes(byte_of[c] for c in token)
        vocab = {tok: i for tok, i in model["vocab"].items() if i not in special_ids}
        merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
        token_of = {i: to_bytes(tok) for tok, i in vocab.items()}
        merged_ids = [vocab[a + b] for a, b in merges]
        # BPE reaches only single bytes and merge results; other tokens are kept for decoding only.
        reachable = {i for i, b in token_of.items() if len(b) == 1} | set(merged_ids)
        extra = {i: b for i, b in token_of.items() if i not in reachable}
        if all(a < b for a, b in zip(merged_ids, merged_ids[1:])):
            ranks, rank_to_id = {token_of[i]: i for i in reachable}, None
        else:  # ids are not in merge order: rank merge results by merge position, past every id
            offset = max([*model["vocab"].values(), *special_ids]) + 1
            ranks = {b: i for i, b in token_of.items() if len(b) == 1}
            rank_to_id = {}
            for m, i in enumerate(merged_ids):
                if token_of[i] not in ranks:  # the first merge making a token is the one BPE uses
                    ranks[token_of[i]] = offset + m
                    rank_to_id[offset + m] = i
        return cls(ranks, pattern, specials, rank_to_id=rank_to_id, extra_tokens=extra, nfc=normalizer is not None, **kw)

    def _encode(self, text):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        raw = text.encode("utf-8", "replace")
        if self.missing_bytes and len(raw.translate(None, self.missing_bytes)) != len(raw):
            ids = self._encode_dropping_missing(text)
        else:
            ids = self.enc.encode(text, allowed_special="all")
        if self.rank_to_id:
            ids = [self.rank_to_id.get(r, r) for r in ids]
        return ids

    def _encode_dropping_missing(self, text):
        # tiktoken would fail on a byte it has no rank for: split as it does, delete such bytes from each
        # piece (as HF does), then BPE the rest of the piece.
        ids = []
        for is_special, part in self._split_specials(text):
            if is_special:
                ids.append(self.specials[part])
                continue
            for piece in self.pattern.findall(part):
                data = piece.encode("utf-8", "replace").translate(None, self.missing_bytes)
                if data:
                    ids += self.enc._encode_single_piece(data)  # BPE of one piece, no regex split
        return ids

    def decode(self, ids) -> str:
        return b"".join(self.id_to_bytes[int(i)] for i in ids).decode("utf-8", errors="replace")

    @property
    def vocab_size(self):
        return len(self.id_to_bytes)


def load_tokenizer(ckpt_dir) -> Tokenizer:
    """The tokenizer of a converted checkpoint, as described by config.json's "tokenizer" entry."""
    path = Path(ckpt_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{path} is not a valid model config: {e}") from None
    if not isinstance(cfg, dict) or not cfg.get("tokenizer"):
        raise ValueError(f"{ckpt_dir}: the checkpoint has no tokenizer")
    return tokenizer_from_entry(ckpt_dir, cfg["tokenizer"])


def tokenizer_from_entry(ckpt_dir, entry: dict) -> Tokenizer:
    path = Path(ckpt_dir) / entry["file"]
    kw = dict(bos_id=entry.get("bos_id"), eos_ids=entry.get("eos_ids"), add_bos=entry.get("add_bos", False),
              chat_template=entry.get("chat_template", "none"), system_prompt=entry.get("system_prompt"))
    kind = entry["kind"]
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path, **kw)
    if kind == "tiktoken":
        return BPETokenizer.from_tiktoken_file(path, **kw)
    if kind == "gpt2-bpe":
        return BPETokenizer.from_tokenizer_json(path, **kw)
    raise ValueError(f"unknown tokenizer kind {kind!r}")
