"""generate.py's command line: one-line errors, the --json contract, batching, streaming."""
import json

import pytest

from generate import main
from tests.helpers import require_default_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return str(require_default_checkpoint())


def run_json(ckpt, capsys, *args):
    main(["--checkpoint", ckpt, "--json", "--quiet", "--max-new-tokens", "6", *args])
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("args,message", [
    (["--checkpoint", "/nonexistent"], "no checkpoint at /nonexistent"),
    (["--max-new-tokens", "9000"], "exceeds the model's max_seq_len 8192"),
    (["--device", "cuda"], "device 'cuda' is not available"),
    (["--device", "tpu9"], "device 'tpu9' is not available"),
    (["--cache", "kivi", "--quant", "quantspec", "--bits", "1"], "--bits 1 is not available for scheme quantspec"),
    (["--cache", "kivi", "--group", "32", "--residual", "48"], "must be a positive multiple of --group"),
    (["--max-new-tokens", "0"], "must be >= 1"),
    (["--group", "-64"], "--group must be a positive power of two, got -64"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--residual", "0"], "--residual (0) must be a positive multiple"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "0.7", "--sample-top-k", "0"], "--sample-top-k must be >= 1"),
    (["--sample-top-k", "5"], "--sample-top-k needs --temperature > 0"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "   \n"], "the prompt is empty"),
    (["--cache", "specache-3bit"], "--bits 3 is not available"),
    (["--cache", "h2o"], "unknown cache 'h2o'"),
    (["--fetch", "magic"], "unknown fetch policy 'magic'"),
    (["--cache", "kivi", "--preset", "best"], "are SpeCache configurations"),
    (["--compile", "--fetch-impl", "staged"], "--fetch-impl staged runs eager only"),
])
def test_bad_input_is_one_clear_line(ckpt, args, message):
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", ckpt, *args] if "--checkpoint" not in args else args)
    assert message in str(e.value) and "\n" not in str(e.value)


def broken_copy(ckpt, tmp_path, name, data):
    """A copy of the checkpoint with one file replaced."""
    import shutil
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    (dst / name).write_bytes(data)
    return str(dst)


def test_truncated_weights_malformed_config_and_binary_prompt(ckpt, tmp_path):
    from pathlib import Path
    weights = (Path(ckpt) / "model.safetensors").read_bytes()
    bad = {"truncated": ("model.safetensors", weights[:len(weights) // 3], "cannot read"),
           "config": ("config.json", b'{"dim": 576, "n_layers": ', "is not a valid model config")}
    for case, (name, data, message) in bad.items():
        path = broken_copy(ckpt, tmp_path / case, name, data)
        with pytest.raises(SystemExit) as e:
            main(["--checkpoint", path, "--max-new-tokens", "2", "--quiet"])
        assert message in str(e.value) and name in str(e.value) and "\n" not in str(e.value), str(e.value)
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", ckpt, "--prompt-file", str(prompt)])
    assert "is not valid UTF-8" in str(e.value) and "\n" not in str(e.value)


def test_json_contract(ckpt, capsys):
    r = run_json(ckpt, capsys, "--prompt", "What is the capital of France?", "--chat", "--cache", "specache")
    for key in ("text", "tokens", "prefill_s", "decode_tok_s", "kv_device_bytes", "kv_host_bytes", "kv_fp16_bytes"):
        assert key in r
    assert "Paris" in r["text"] and r["tokens"] and all(isinstance(t, int) for t in r["tokens"])
    assert r["kv_host_bytes"] > 0 and r["bytes_fetched_per_step"] > 0
    full = run_json(ckpt, capsys, "--prompt", "What is the capital of France?", "--chat", "--cache", "full")
    assert full["kv_host_bytes"] == 0 and full["kv_fp16_bytes"] == r["kv_fp16_bytes"]
    assert full["text"] == r["text"]  # a short prompt never leaves the fp residual: identical


def test_preset_flag_names_the_config(ckpt, capsys):
    from config import CacheConfig
    r = run_json(ckpt, capsys, "--prompt", "What is the capital of France?", "--chat", "--preset", "best", "--k", "32")
    assert r["cache"] == CacheConfig.from_name("specache-1bit-best-k32").name and r["config"]["k"] == 32
    assert r["config"]["fetch"] == "resync" and "Paris" in r["text"]


def test_attention_path_is_recorded(ckpt, capsys):
    """--attn-path picks the low-bit kernels' path on CUDA; the JSON records the path asked for and the one
    that ran (the torch reference on CPU)."""
    r = run_json(ckpt, capsys, "--prompt", "What is the capital of France?", "--chat", "--attn-path", "planes")
    assert r["config"]["attn_path"] == "planes" and r["attn_path"] == "torch" and "Paris" in r["text"]
    assert run_json(ckpt, capsys, "--prompt", "Hi", "--cache", "full")["attn_path"] is None


def test_zipcache_mixed_precision_flags(ckpt, capsys):
    """--quant zipcache --salient-ratio 0.4 --bits 2: the mixed cache, its device bytes between the
    uniform 2-bit and 4-bit ZipCache caches'."""
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)
    common = ["--prompt", prompt, "--cache", "kivi", "--quant", "zipcache", "--group", "32", "--residual", "32"]
    r = run_json(ckpt, capsys, *common, "--salient-ratio", "0.4", "--bits", "2")
    assert r["cache"] == "kivi-2bit-zipcache-g32-r32-s40-hi4" and r["config"]["bits_salient"] == 4
    two = run_json(ckpt, capsys, *common, "--bits", "2")
    four = run_json(ckpt, capsys, *common, "--bits", "4")
    assert two["kv_device_bytes"] < r["kv_device_bytes"] < four["kv_device_bytes"]
    with pytest.raises(SystemExit, match="--quant zipcache"):
        main(["--checkpoint", ckpt, "--salient-ratio", "0.4"])


def test_batched_tokens_are_a_list_per_row(ckpt, capsys):
    r = run_json(ckpt, capsys, "--prompt", "Once upon a time", "--batch-size", "2", "--cache", "kivi", "--bits", "2")
    assert len(r["tokens"]) == 2 and r["tokens"][0] == r["tokens"][1]


def prompts_file(tmp_path, data: bytes):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("data,message", [
    (b'"one"\n\n"three"\n', "line 2 is empty"),
    (b'"one"\n{"text": "two"\n', "line 2 is not valid JSON"),
    (b'"one"\n"\xff\xfe"\n', "line 2 is not valid UTF-8"),
    (b'"one"\n' + b'"' + b"word " * 9000 + b'"\n', "line 2: the prompt ("),
    (b'{"role": "system", "content": "x"}\n', 'line 1: a prompt is a JSON string'),
    (b'"  "\n', "line 1: the prompt is empty"),
    (b"", "holds no prompt"),
])
def test_a_bad_prompts_file_is_one_line_naming_the_line(ckpt, tmp_path, capsys, data, message):
    with pytest.raises(SystemExit) as e:
        main(["--checkpoint", ckpt, "--prompts-file", prompts_file(tmp_path, data), "--max-new-tokens", "4"])
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("error: ")
    assert capsys.readouterr().out == ""  # (nothing generated)


def test_a_prompts_file_is_one_batch_with_an_output_per_prompt(ckpt, tmp_path, capsys):
    """Three different prompts (text, a chat turn, text under --chat's absence) in one left-padded batch: --json
    gives each its text, tokens and prompt length; with the fp cache each row is its prompt's output alone."""
    lines = ['"The capital of France is"', '{"role": "user", "content": "Name three colors."}',
             '{"text": "' + "The quick brown fox jumps over the lazy dog. " * 12 + 'Then it"}']
    path = prompts_file(tmp_path, ("\n".join(lines) + "\n").encode())
    r = run_json(ckpt, capsys, "--prompts-file", path, "--cache", "full")
    assert len(r["texts"]) == len(r["tokens"]) == len(r["prompt_tokens"]) == 3 and r["text"] == r["texts"][0]
    assert len(set(r["prompt_tokens"])) == 3
    alone = [run_json(ckpt, capsys, "--prompt", "The capital of France is", "--cache", "full"),
             run_json(ckpt, capsys, "--prompt", "Name three colors.", "--chat", "--cache", "full")]
    assert r["tokens"][:2] == [a["tokens"] for a in alone]
    with pytest.raises(SystemExit, match="--prompts-file: the batch is its prompts"):
        main(["--checkpoint", ckpt, "--prompts-file", path, "--batch-size", "2"])
    with pytest.raises(SystemExit, match="runs a batch of one prompt length only"):
        main(["--checkpoint", ckpt, "--prompts-file", path, "--cache", "kivi", "--quant", "zipcache", "--bits", "2"])


def test_streams_text_and_summary(ckpt, capsys):
    main(["--checkpoint", ckpt, "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert "Paris" in out and "decode" in out and "<|im_end|>" not in out


def count_decode_syncs(monkeypatch, argv):
    """Run generate.main and count the tensor-to-host conversions (a sync on CUDA: bool(), int(),
    .item(), .tolist()) made while the decode loop runs, from its first decode step until generate()
    returns -> (conversions, decode steps)."""
    import torch
    import generate
    import model
    state = {"steps": 0, "conversions": 0, "done": False}
    forward = model.Transformer.forward

    def counted(self, idx, input_pos, mode="decode"):
        state["steps"] += mode == "decode"
        return forward(self, idx, input_pos, mode)
    monkeypatch.setattr(model.Transformer, "forward", counted)
    for name in ("__bool__", "__int__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *a, _original=original, **kw):
            state["conversions"] += state["steps"] >= 1 and not state["done"]
            return _original(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    loop = generate.generate

    def until_done(*a, **kw):
        try:
            return loop(*a, **kw)
        finally:
            state["done"] = True
    monkeypatch.setattr(generate, "generate", until_done)
    main(argv)
    return state["conversions"], state["steps"]


@pytest.mark.parametrize("cache", ["specache", "kivi"])
def test_quiet_decoding_reads_eos_every_few_steps_not_every_step(ckpt, monkeypatch, capsys, cache):
    """With --quiet (or --json) nothing reads a token on the host each step: the loop keeps the eos
    test on the device and reads it once every Decoding.eos_check_every (8) steps, plus the hit count
    at the end. Streaming reads every token, so every step converts."""
    args = ["--checkpoint", ckpt, "--cache", cache, "--max-new-tokens", "40", "--prompt", "Count from one to fifty:",
            "--chat"]
    quiet, steps = count_decode_syncs(monkeypatch, args + ["--quiet"])
    assert steps == 39 and quiet <= steps // 8 + 2, (quiet, steps)
    monkeypatch.undo()
    streamed, steps = count_decode_syncs(monkeypatch, args)
    assert streamed >= steps, (streamed, steps)
