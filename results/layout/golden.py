"""Greedy tokens of every method on the default model, eager, to show that a change of the code's layout
changes no number: run before and after, compare the JSON files.

    .venv/bin/python results/layout/golden.py --out results/layout/before.json
    .venv/bin/python results/layout/golden.py --out results/layout/after.json --against results/layout/before.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "checkpoints" / "smollm2-135m-instruct"
HF = ROOT / "checkpoints" / "smollm2-135m-hf"
NEW = ["--max-new-tokens", "24", "--json", "--quiet", "--chat"]
CACHES = ["full", "kivi-1bit", "kivi-2bit", "specache-1bit", "specache-2bit", "specache-1bit-best",
          "specache-1bit-lag", "specache-1bit-sequential", "specache-1bit-oracle", "specache-2bit-union-rr2",
          "kivi-2bit-zipcache", "specache-2bit-zipcache-s20", "quest", "infllm-p16-k64-r64-sink4"]


def run(args, torchrun=0):
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun)] \
        if torchrun else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run(pre + list(map(str, args)), cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if p.returncode:
        raise SystemExit(f"{' '.join(map(str, args))}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


def tiny_checkpoint(out: Path):
    """A random 2-layer Llama with 2 KV heads and the default model's tokenizer (tensor parallelism on 2 ranks)."""
    sys.path.insert(0, str(ROOT))
    from dataclasses import asdict
    from safetensors.torch import save_file
    from model import ModelArgs, Transformer, random_weights
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=49152, intermediate_size=256,
                     max_seq_len=2048)
    model = random_weights(Transformer(args), seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    cfg = json.loads((CKPT / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(asdict(args), tokenizer=cfg["tokenizer"])))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((CKPT / name).read_bytes())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--against", type=Path, default=None, help="an earlier run: the tokens must be equal")
    a = p.parse_args()
    needle = CKPT / "needle_prompt.txt"
    if not needle.exists():
        needle.write_text(subprocess.run([sys.executable, "tools/eval.py", "prompt", "--length", "1000", "--depth",
                                          "0.5"], cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    prompt = ["--checkpoint", CKPT, "--prompt-file", needle, *NEW]
    out = {}
    for cache in CACHES:
        out[cache] = run(["generate.py", *prompt, "--cache", cache])["tokens"]
        print(cache, out[cache][:8], flush=True)
    out["quantspec"] = run(["generate.py", *prompt, "--method", "quantspec"])["tokens"]
    out["bits1-k64-paper-cli"] = run(["generate.py", *prompt, "--bits", "1", "--k", "64"])["tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "prompts.jsonl"
        text = needle.read_text()
        rows.write_text("\n".join(json.dumps({"role": "user", "content": t}) for t in
                                  (text[:1500], text, "What is the capital of France?")) + "\n")
        for cache in ("full", "specache-1bit-best", "kivi-2bit"):
            out[f"prompts-file:{cache}"] = run(["generate.py", "--checkpoint", CKPT, "--prompts-file", rows, *NEW[:-1],
                                                "--cache", cache])["tokens"]
        if HF.exists():
            for cache in ("full", "specache-1bit"):
                out[f"hf:{cache}"] = run(["generate.py", "--hf", HF, "--prompt-file", needle, *NEW, "--cache", cache])["tokens"]
        tiny = Path(tmp) / "tiny"
        tiny.mkdir()
        tiny_checkpoint(tiny)
        gen = ["generate.py", "--checkpoint", tiny, "--cache", "specache-2bit", "--k", "8", "--group", "16", "--residual",
               "32", "--prompt", "The quick brown fox jumps over the lazy dog because", *NEW[:-1]]
        out["tiny:1-rank"] = run(gen)["tokens"]
        out["tiny:torchrun-2"] = run([*gen, "--tp", "2"], torchrun=2)["tokens"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    if a.against:
        before = json.loads(a.against.read_text())
        diff = sorted(k for k in set(before) | set(out) if before.get(k) != out.get(k))
        print("identical" if not diff else f"DIFFERENT: {diff}")
        raise SystemExit(1 if diff else 0)


if __name__ == "__main__":
    main()
