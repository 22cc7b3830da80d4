"""Tensor parallelism on CPU with gloo, 2 processes (tp.py): the split model against the one-process
model on a tiny random fp32 Llama with 4 KV heads, the compiled step as one graph per rank, and the
launch errors of the CLIs. docs/tp.md says what else was checked by hand."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import ROOT

WORLD = 2
PROMPT, NEW = 150, 10
CACHES = ["full", "kivi-2bit", "specache-1bit", "specache-1bit-sequential", "specache-1bit-oracle",
          "specache-1bit-lag", "specache-1bit-union", "specache-1bit-resync", "specache-2bit-best",
          "kivi-2bit-zipcache", "kivi-2bit-zipcache+salient"]


def tiny(seed=0, vocab=256):
    from model import ModelArgs, Transformer
    torch.manual_seed(seed)
    args = ModelArgs(name="tiny-tp", dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=vocab,
                     intermediate_size=256, max_seq_len=512)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model.eval()


def test_random_weights_agree_across_ranks_where_replicated():
    """tools/bench.py's random-weight models under torchrun: a tensor every rank holds whole (the
    embedding and head when the ranks do not split the vocabulary) must be the same on every rank,
    or the ranks compute different models; the slices of split tensors differ from rank to rank."""
    from integrations import tp
    from model import ModelArgs, random_weights
    args = ModelArgs(name="t", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=255, intermediate_size=128,
                     max_seq_len=16)
    assert args.vocab_size % 2  # 2 ranks do not split it: the embedding and head are replicated
    ranks = [random_weights(tp.build_rank_model(args, r, 2), seed=7, rank=r,
                            split=lambda name: tp.split_dim(name, args, 2) is not None).state_dict() for r in (0, 1)]
    assert torch.equal(ranks[0]["tok_embeddings.weight"], ranks[1]["tok_embeddings.weight"])  # replicated
    assert torch.equal(ranks[0]["output.weight"], ranks[1]["output.weight"])
    assert not torch.equal(ranks[0]["layers.0.attention.wq.weight"], ranks[1]["layers.0.attention.wq.weight"])


def _join(rank, store):
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever the host name resolves to
    # a file rendezvous: no port to pick (a port taken between picking and binding is a failed run)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _leave():
    # every rank reaches the barrier before any tears gloo down, so no rank leaves while its peer still talks
    # to it (a worker once died at the end with SIGABRT, "terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


def greedy(model, name, prompt):
    import generate as gen
    from config import CacheConfig
    from generate import setup_caches
    from siblings import quantspec as qs
    from tests.helpers import run_generate
    cfg = CacheConfig.from_name(name.split("+")[0], salient=0.5 if name.endswith("+salient") else None)
    if cfg.kind == "quantspec":
        qs.setup_caches(model, cfg, 1, PROMPT + NEW + 8, gamma=3)
        draft = qs.make_draft(model, group=32)
        qs.share_caches(draft, model)
        return qs.generate_quantspec(model, draft, prompt, 3, gen.Decoding(NEW))[0]
    setup_caches(model, cfg, 1, PROMPT + NEW + 4)
    return run_generate(model, prompt, NEW, cfg)[0]


def _parity(rank, store, out):
    _join(rank, store)
    from cache import setup_caches
    from integrations import tp
    full = tiny()
    local = tp.shard_model(full)
    assert local.args.n_kv_heads == 2 and local.layers[0].attention.wk.weight.shape == (32, 128)
    prompt = torch.randint(0, 256, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(PROMPT)
    setup_caches(full, "full", 2, PROMPT + 4)
    setup_caches(local, "full", 2, PROMPT + 4)
    with torch.no_grad():  # batch 2: the whole batch is all-reduced, not row 0
        ref, got = full(prompt, pos, mode="prefill", all_logits=True), local(prompt, pos, mode="prefill", all_logits=True)
    report = {"logits_max_err": float((ref - got).abs().max()), "logits_max": float(ref.abs().max()), "tokens": {}}
    for name in CACHES + ["quantspec"]:
        a, b = greedy(full, name, prompt[:1]), greedy(local, name, prompt[:1])
        report["tokens"][name] = [a.tolist(), b.tolist()]
    if rank == 0:
        out.put(report)
    _leave()


def _compiled(rank, store, out):
    _join(rank, store)
    from torch._dynamo.utils import counters

    import generate as gen
    from cache import setup_caches
    from integrations import tp
    from tests.helpers import run_generate
    local = tp.shard_model(tiny())
    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    setup_caches(local, "specache-1bit", 1, 64)
    eager = run_generate(local, prompt, 6, "specache-1bit")[0]
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(gen.decode_step, backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    setup_caches(local, "specache-1bit", 1, 64)
    compiled = run_generate(local, prompt, 6, "specache-1bit", step_fn=step)[0]
    if rank == 0:
        out.put({"graphs": counters["stats"]["unique_graphs"], "same": torch.equal(eager, compiled)})
    _leave()


def _loads_slices(rank, store, out, ckpt_dir):
    _join(rank, store)
    from pathlib import Path

    from integrations import tp
    local = tp.load_model(Path(ckpt_dir))  # each rank reads its rows/columns from the two shard files
    want = tp.shard_model(tiny())
    same = all(torch.equal(local.state_dict()[k], v) for k, v in want.state_dict().items())
    assert same, f"rank {rank}"  # (a worker's exception fails spawn)
    if rank == 0:
        out.put({"same": same, "keys": sorted(local.state_dict()) == sorted(want.state_dict())})
    _leave()


def spawn(fn, *args):
    import tempfile
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    store = os.path.join(tempfile.mkdtemp(prefix="tp-rdzv-"), "store")
    mp.start_processes(fn, args=(store, q, *args), nprocs=WORLD, start_method="spawn")
    return q.get()


def test_sharded_checkpoint_loads_each_ranks_slices(tmp_path):
    """Hugging Face's layout (an index naming two shard files): every rank's tensors equal the
    slices of the in-memory model."""
    from dataclasses import asdict

    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in tiny().state_dict().items()}
    first = {k: v for k, v in state.items() if k.startswith(("tok_embeddings", "layers.0"))}
    save_file(first, str(tmp_path / "a.safetensors"))
    save_file({k: v for k, v in state.items() if k not in first}, str(tmp_path / "b.safetensors"))
    index = {k: "a.safetensors" if k in first else "b.safetensors" for k in state}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (tmp_path / "config.json").write_text(json.dumps(asdict(tiny().args)))
    r = spawn(_loads_slices, str(tmp_path))
    assert r["same"] and r["keys"]


def test_split_model_equals_one_process():
    r = spawn(_parity)
    assert r["logits_max_err"] < 1e-5
    for name, (ref, got) in r["tokens"].items():
        assert got == ref, name


def test_compiled_step_is_one_graph_per_rank():
    r = spawn(_compiled)
    assert r["graphs"] == 1 and r["same"]


# ---- the CLIs under torchrun, on a tiny checkpoint with the default model's tokenizer ----------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import shutil
    from dataclasses import asdict

    from safetensors.torch import save_file

    from tests.helpers import require_default_checkpoint
    src = require_default_checkpoint()
    out = tmp_path_factory.mktemp("tiny-tp")
    model = tiny(vocab=49152)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    tokenizer = json.loads((src / "config.json").read_text())["tokenizer"]
    (out / "config.json").write_text(json.dumps(dict(asdict(model.args), tokenizer=tokenizer)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


def torchrun(*args, n=WORLD):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           *map(str, args)] if n else [sys.executable, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def error_lines(proc):
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]


GEN = ["--cache", "specache-2bit", "--k", "8", "--group", "16", "--residual", "32", "--max-new-tokens", "8",
       "--prompt", "The quick brown fox jumps over the lazy dog because", "--json", "--quiet"]


def test_generate_under_torchrun_equals_one_process(ckpt):
    """generate.py on 2 ranks (each reads its slices from the safetensors file) prints the tokens
    one process generates, once."""
    import generate
    ref = generate.main(["--checkpoint", str(ckpt), *GEN])
    proc = torchrun("generate.py", "--checkpoint", ckpt, "--tp", WORLD, *GEN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1  # rank 0 prints; the other rank prints nothing
    assert json.loads(lines[0])["tokens"] == ref["tokens"]


def broken(ckpt, tmp_path, drop=None, index=False):
    import shutil

    from safetensors.torch import load_file, save_file
    out = tmp_path / "broken"
    shutil.copytree(ckpt, out)
    if drop:
        state = load_file(str(out / "model.safetensors"))
        del state[drop]
        save_file(state, str(out / "model.safetensors"))
    if index:  # Hugging Face's layout for large models: an index naming the shard files
        names = load_file(str(out / "model.safetensors")).keys()
        weight_map = {n: "model-00001-of-00002.safetensors" if n.startswith("layers.0") else "model-00002-of-00002.safetensors"
                      for n in names}
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


@pytest.mark.parametrize("case", ["no-torchrun", "world-size", "kv-heads", "missing-tensor", "missing-shard", "hf"])
def test_launch_errors_are_one_line(case, ckpt, tmp_path):
    from tests.helpers import DEFAULT_CKPT
    args, n = ["generate.py", "--checkpoint", ckpt, "--max-new-tokens", "2", "--quiet"], WORLD
    if case == "no-torchrun":
        args, n, want = args + ["--tp", "2"], 0, "error: --tp 2 needs torchrun: torchrun --nproc-per-node 2 generate.py ..."
    elif case == "world-size":
        args, want = args + ["--tp", "3"], "error: --tp 3 but torchrun started 2 processes (--nproc-per-node x nodes must equal --tp)"
    elif case == "kv-heads":  # the default model has 3 KV heads
        args[2], want = DEFAULT_CKPT, "error: 2 ranks do not divide the model's 3 KV heads; use 1 or 3 ranks"
    elif case == "missing-tensor":
        args[2] = bad = broken(ckpt, tmp_path, drop="layers.1.feed_forward.w2.weight")
        want = f"error: checkpoint {bad} has no tensor layers.1.feed_forward.w2.weight"
    elif case == "hf":
        args[1] = "--hf"
        want = "error: --hf runs on one process: tensor parallelism under torchrun takes converted checkpoints (--checkpoint)"
    else:
        args[2] = bad = broken(ckpt, tmp_path, index=True)
        want = f"error: checkpoint {bad} is missing shard model-00001-of-00002.safetensors (named in model.safetensors.index.json)"
    proc = torchrun(*args, n=n)
    assert proc.returncode == 1
    assert error_lines(proc) == [want]  # once, for every rank


def test_floors_per_rank():
    """tools/bench.py --floors --tp N: a rank's weights are 1/N of the split ones plus its vocabulary
    slice; its KV bytes are 1/N (its KV heads); N must divide the KV heads."""
    from model import ModelArgs
    from tools import bench
    rows = {}
    for n in (1, 2, 8):
        a = bench.parse_args(["--floors", "--model", "Llama-3.1-70B", "--contexts", "4096", "--caches", "specache",
                              *(["--tp", str(n)] if n > 1 else [])])
        rows[n] = bench.floor_rows(ModelArgs.from_name("Llama-3.1-70B"), a.caches, 4096, 1, a)[0]
    norms, counters = (2 * 80 + 1) * 8192 * 2, 80 * 2 * 8  # replicated: RMSNorm weights, each cache's two int64 counters
    for n in (2, 8):  # 128256 = 8 x 16032: the vocabulary splits too
        assert rows[n]["weight_bytes"] == (rows[1]["weight_bytes"] - norms) // n + norms
        assert rows[n]["kv_device_bytes"] == (rows[1]["kv_device_bytes"] - counters) // n + counters
        assert rows[n]["pcie_bytes"] == rows[1]["pcie_bytes"] // n  # top-k rows of its own KV heads only
        assert rows[n]["kv_read_bytes"] == rows[1]["kv_read_bytes"] // n
    T = 2  # SpeCache feeds two tokens a step: 161 all-reduces of [1, 2, 8192] bf16 and the fp32 logits' all-gather
    assert rows[1]["comm_bytes"] == 0 and rows[2]["comm_bytes"] == (2 * 80 + 1) * T * 8192 * 2 + T * 128256 * 4 // 2
    with pytest.raises(SystemExit, match="^error: 3 ranks do not divide the model's 8 KV heads; use 1 or 2 or 4 or 8 ranks$"):
        bench.main(["--floors", "--model", "Llama-3.1-70B", "--tp", "3", "--contexts", "4096", "--caches", "specache"])


NIAH = ["--methods", "full,specache-1bit", "--depths", "0.2,0.8", "--max-new-tokens", "6"]


def cells(out):
    return {r["key"]: r["output"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_eval_cells_over_ranks_and_a_failed_rank(ckpt, tmp_path):
    """tools/eval.py niah on 2 ranks writes the cells one process writes, into one results file; a rank
    that fails (here: its prompts exceed the tiny model's 512 positions) ends the run non-zero
    instead of leaving the other rank waiting; the cells finished so far stay for a rerun."""
    from tools import eval as ev
    ev.main(["niah", "--checkpoint", str(ckpt), *NIAH, "--lengths", "150,250", "--out", str(tmp_path / "one")])
    proc = torchrun("tools/eval.py", "niah", "--checkpoint", ckpt, *NIAH, "--lengths", "150,250", "--out", tmp_path / "two")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "two").glob("*.jsonl")) == ["results.jsonl"]
    assert cells(tmp_path / "two") == cells(tmp_path / "one") and len(cells(tmp_path / "one")) == 8
    bad = tmp_path / "bad"
    proc = torchrun("tools/eval.py", "niah", "--checkpoint", ckpt, *NIAH, "--lengths", "150,700", "--out", bad)
    assert proc.returncode != 0
    assert "IndexError" in proc.stderr and "[rank1]" in proc.stderr  # the long prompts are rank 1's share
    kept = [json.loads(ln) for ln in (bad / "results.rank0.jsonl").read_text().splitlines()] \
        if (bad / "results.rank0.jsonl").exists() else []  # what rank 0 finished before torchrun stopped it
    assert len(kept) <= 4 and all(r["length"] == 150 for r in kept)
