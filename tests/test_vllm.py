"""SpeCache and KIVI inside vLLM (integrations/specache_vllm). The page format runs in the project's venv; the engine
tests need vLLM (`make test-vllm` runs them in .venv-vllm) and are skipped cleanly without it."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

import generate
from config import CacheConfig
from integrations.specache_vllm import pages
from quant import kv_fp16_bytes
from model import ModelArgs, Transformer
from tests.helpers import DEFAULT_CKPT, ROOT

SMOLLM2 = dict(n_kv_heads=3, head_dim=64, n_heads=9, dim=576)  # the default model's attention shapes
HF_DIR = ROOT / "checkpoints" / "smollm2-135m-hf"


def one_layer(n_kv_heads, head_dim, n_heads, dim, max_seq_len=8192):
    return Transformer(ModelArgs(name="one-layer", dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                 head_dim=head_dim, vocab_size=16, intermediate_size=16, max_seq_len=max_seq_len))


# ---- the page, without vLLM ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["specache-1bit-lag", "kivi-1bit", "specache-2bit-sequential-sink4", "kivi-2bit-g32"])
def test_a_slot_costs_what_the_projects_caches_hold(name):
    """In a 16-bit deployment a page's slot is what the project's own cache holds a token for, every device byte
    counted (codes, scales, zeros, and a 4k request's share of its residual window, sinks and fetched rows): the
    default model's 1-bit SpeCache at 4k is about 8x the fp16 cache."""
    model = one_layer(**SMOLLM2)
    layout = pages.PageLayout.build(CacheConfig.from_name(name), 3, 64, 64, torch.float32, 4096)
    project = generate.setup_caches(model, name, 1, 4096).deployed_bytes()
    assert layout.slot_bytes_16 * 3 * 4096 == pytest.approx(project, rel=1e-9)
    ratio = kv_fp16_bytes(model.args, 1, 4096) / project
    if name == "specache-1bit-lag":
        assert 7.5 < ratio < 8.5
    assert layout.slot_bytes % 4 == 0 and layout.slot_bytes >= layout.offsets[-1] / 64  # (as run: fp32 rows)


def test_pages_hold_the_projects_codes_to_the_bit():
    """Tokens quantized block by block into pages and read back are LowBitCache's codes, scales and zeros for the
    same tokens (its quantizer, its schedule: whole blocks, the first group keeping its range under lsq)."""
    cfg = CacheConfig.from_name("kivi-2bit-lsq-g32-r64")
    H, D, blk, n = 2, 64, 32, 192
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, H, n, D, generator=g) * 3, torch.randn(1, H, n, D, generator=g)
    ref = generate.cache.LowBitCache(1, H, 256, D, torch.float32, "cpu", cfg)
    ref.append_prefill(k, v, torch.arange(n))
    layout = pages.PageLayout.build(cfg, H, D, blk, torch.float32, 1024)
    kv_cache = torch.zeros(9, H, blk, layout.slot_bytes // 4)
    pg = layout.bytes_of(kv_cache)
    blocks = torch.tensor([7, 2, 5, 0, 8, 1])  # a request's blocks, in any order of the pool
    q = pages.quantizer(cfg, H, D, torch.float32)
    for b0 in range(0, n, 64):  # flushes of two blocks at a time, as the residual window fills
        per_row, per_group = pages.quantize_blocks(q, k[:, :, b0:b0 + 64], v[:, :, b0:b0 + 64], b0)
        layout.write(pg, blocks[b0 // blk:(b0 + 64) // blk], per_row, per_group)
    got = layout.read(pg, blocks, 256, torch.float16)
    want = ref.stored()
    for f in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
        rows = n // cfg.group if f in ("k_scale", "k_zero") else n
        assert torch.equal(getattr(got, f)[:, :, :rows], getattr(want, f)[:, :, :rows]), f


@pytest.mark.parametrize("name,block,message", [
    ("specache-1bit", 64, "runs sequential, lag, oracle"), ("specache-1bit-resync", 64, "runs sequential, lag, oracle"),
    ("kivi-2bit-zipcache", 64, "KIVI's quantizer only"), ("quest", 64, "runs the kivi and specache caches"),
    ("full", 64, "vLLM's own attention"), ("specache-1bit-lag", 32, "multiple of the key group (64)"),
    ("specache-1bit-lag", 128, "divide the residual window (64)")])
def test_what_the_engine_cannot_run_is_one_error(name, block, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pages.PageLayout.build(CacheConfig.from_name(name), 3, 64, block, torch.float32, 4096)


# ---- the engine (the vLLM venv) --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="vLLM is not installed here: make test-vllm runs these in .venv-vllm")


@pytest.fixture(scope="module")
def tiny(vllm, tmp_path_factory):
    """A random 2-layer Llama with 2 KV heads of head_dim 64, as a transformers directory."""
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True, rope_theta=10000.0, torch_dtype="float32")
    return random_llama(cfg, tmp_path_factory.mktemp("tiny-llama"))


def random_llama(cfg, out):
    """A LlamaForCausalLM of `cfg` with N(0, 0.08) matrices (greedy tokens that vary), saved to `out`."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    m.save_pretrained(out)
    return out


def engine(vllm, model, cache=None, kv_bytes=8 << 20, max_model_len=1024, block=64, **kw):
    """An in-process vLLM engine with the backend for `cache` (a name), or vLLM's own attention (None)."""
    from integrations.specache_vllm import register
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_PLUGINS"] = ""  # (registered by hand: in one process the tests switch backends)
    if cache is None:
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend")
    else:
        os.environ["SPECACHE_CACHE"] = cache
        register()
    selector._cached_get_attn_backend.cache_clear()
    return vllm.LLM(model=str(model), dtype="float32", enforce_eager=True, enable_prefix_caching=False, block_size=block,
                    max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes, seed=0, skip_tokenizer_init=True, **kw)


def greedy(vllm, llm, prompts, n=16):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], vllm.SamplingParams(max_tokens=n, temperature=0.0,
                                                                                       ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def prompt(n, seed=0):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stepped(vllm, llm, schedule, n=16):
    """Continuous batching: schedule = [(step, request id, prompt)]: each request added at its step, while the
    earlier ones decode. -> {request id: tokens}."""
    eng, params, out, step = llm.llm_engine, vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), {}, 0
    todo = sorted(schedule)
    while todo or eng.has_unfinished_requests():
        while todo and todo[0][0] <= step:
            _, rid, p = todo.pop(0)
            eng.add_request(rid, {"prompt_token_ids": p}, params)
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    return out


@pytest.mark.parametrize("cache", ["specache-1bit-sequential-k2048", "specache-1bit-lag-k2048"])
def test_every_row_fetched_gives_vllms_own_tokens(vllm, tiny, cache):
    """With k at least the context every quantized row is replaced by its fp row: the greedy tokens are vLLM's
    own attention's, on prompts of different lengths, requests added while others decode."""
    schedule = [(0, "a", prompt(30)), (0, "b", prompt(150, 1)), (3, "c", prompt(333, 2)), (5, "d", prompt(97, 3))]
    want = stepped(vllm, engine(vllm, tiny, kv_bytes=32 << 20), schedule)
    got = stepped(vllm, engine(vllm, tiny, cache, kv_bytes=32 << 20), schedule)
    assert got == want


def replay(name, steps, H, Hq, D):
    """One request's captured steps (q, k, v of a layer, as the engine saw them) through the project's own cache of
    the same name -> (its outputs, its rows fetched after each step: per head the positions' set)."""
    model = one_layer(H, D, Hq, Hq * D, max_seq_len=1024)
    c = generate.setup_caches(model, name, 1, 1024)[0]
    outs, fetched = [], []
    for i, s in enumerate(steps):
        computed, L = s["pos"]
        q, k, v, pos = s["q"], s["k"].transpose(0, 1)[None], s["v"].transpose(0, 1)[None], torch.arange(computed, L)
        if computed == 0:
            outs.append(c(q, k, v, pos, mode="prefill"))
        else:
            if c.policy.pre_decode and steps[i - 1]["pos"][0] == 0:  # Algorithm 2 before the first step
                c(q, k, v, pos, mode="predecode")
            outs.append(c(q, k, v, pos, mode="decode"))
        if hasattr(c, "fetch_idx"):
            idx, ok = c.fetch_idx[0, :, c.sinks:], c.fetch_valid[0, :, c.sinks:]
            fetched.append([set(idx[h][ok[h]].tolist()) for h in range(H)])
    return outs, fetched


@pytest.mark.parametrize("name", ["kivi-1bit", "specache-1bit-sequential", "specache-1bit-lag", "kivi-2bit-lsq-g32",
                                  "specache-1bit-lag-sink4-rr2", "specache-2bit-oracle-g32-r64"])
def test_a_request_replayed_through_the_projects_cache_gives_its_rows_and_outputs(vllm, tiny, name):
    """A request's per-layer q/k/v captured inside the engine, replayed through the project's own cache of the same
    name (group, residual, k = 64; sinks, re-ranking, the least-squares fit, the oracle): each step's output, and
    each step's fetched rows, are the cache's."""
    from integrations.specache_vllm import backend
    backend.CAPTURE = {}
    try:
        greedy(vllm, engine(vllm, tiny, name), [prompt(300, 5)], n=24)
        captured = backend.CAPTURE
    finally:
        backend.CAPTURE = None
    assert len(captured) == 2
    for layer, steps in captured.items():
        assert len(steps) == 24 and steps[0]["pos"] == (0, 300)  # the prompt, then one row a step
        outs, fetched = replay(name, steps, 2, 4, 64)
        for s, out in zip(steps, outs):
            torch.testing.assert_close(s["out"], out, atol=2e-5, rtol=1e-5)
        if name.startswith("specache"):
            got = [[set(s["fetch"][0][0, h][s["fetch"][1][0, h]].tolist()) for h in range(2)] for s in steps[1:]]
            assert got == fetched[1:] and all(len(f) == 64 for step in got for f in step)  # (k rows from the first step)


def blocks_of(llm) -> int:
    return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def test_the_block_count_grows_by_the_page_ratio(vllm, tiny):
    """The same budget, vLLM's own page and the packed one: the engine's block count grows by the ratio of the
    pages (each block a page per layer), which the entry's formula gives for vLLM's own too."""
    from integrations.specache_vllm.__main__ import stock_capacity
    budget, shape = 24 << 20, dict(layers=2, kv_heads=2, head_dim=64)
    stock = blocks_of(engine(vllm, tiny, kv_bytes=budget))
    for name in ("kivi-1bit", "specache-1bit-lag", "specache-2bit-sequential"):
        layout = pages.PageLayout.build(CacheConfig.from_name(name), 2, 64, 64, torch.float32, 1024)
        got = blocks_of(engine(vllm, tiny, name, kv_bytes=budget))
        assert got == budget // (2 * 2 * 64 * layout.slot_bytes), name
        assert got / stock == pytest.approx(layout.stock_slot_bytes() / layout.slot_bytes, rel=0.02), name
    assert stock_capacity(shape, budget, 64, 1024, 2 * 64 * 4)[0] == stock * 64


def count_preemptions(monkeypatch) -> list:
    from vllm.v1.core.sched.scheduler import Scheduler
    seen, preempt = [], Scheduler._preempt_request

    def counted(self, request, *a, **kw):
        seen.append(request.request_id.split("-")[0])  # (the engine's own id: ours, then a suffix)
        return preempt(self, request, *a, **kw)
    monkeypatch.setattr(Scheduler, "_preempt_request", counted)
    return seen


def test_more_requests_than_vllm_holds_run_at_once_each_as_alone(vllm, tiny, monkeypatch):
    """A budget whose own pages hold 2 requests of 1,024 tokens: the packed pages hold 8, which run at once without
    a preemption, each request's tokens those it gets alone."""
    budget = (2 * 16 + 1) * (2 * 2 * 64 * 512)  # vLLM's pages: 2 requests of 16 blocks, and the null block
    stock = engine(vllm, tiny, kv_bytes=budget)
    assert float(stock.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency) < 3
    prompts = [prompt(900 + 7 * i, 10 + i) for i in range(8)]
    llm = engine(vllm, tiny, "specache-1bit-lag", kv_bytes=budget)
    assert float(llm.llm_engine.vllm_config.cache_config.kv_cache_max_concurrency) >= 8
    preempted = count_preemptions(monkeypatch)
    together = greedy(vllm, llm, prompts, n=24)
    assert preempted == []
    assert together == [greedy(vllm, llm, [p], n=24)[0] for p in prompts]


def test_preemption_aborts_and_rejected_drafts_corrupt_no_other_request(vllm, tiny, monkeypatch, tmp_path):
    """A budget too small for the requests at once (some are preempted and recomputed), a request aborted
    mid-way, and ngram speculative decoding (a rejected draft's slot is written again): every other request's
    tokens are those it gets alone (KIVI's with drafts: those it gets without)."""
    name, short = "specache-1bit-lag", [prompt(90 + 10 * i, 30 + i) for i in range(4)]
    layout = pages.PageLayout.build(CacheConfig.from_name(name), 2, 64, 64, torch.float32, 640)
    small = engine(vllm, tiny, name, kv_bytes=12 * 2 * 2 * 64 * layout.slot_bytes, max_model_len=640)  # 12 blocks
    alone = [greedy(vllm, small, [p], n=400)[0] for p in short]
    preempted = count_preemptions(monkeypatch)
    together = stepped(vllm, small, [(0, str(i), p) for i, p in enumerate(short)], n=400)  # (admitted at 2 blocks each,
    assert preempted and len(set(preempted)) < 4                                          # grown to 8)
    # (a preempted request is recomputed by exact prefill attention: from there on it is the answer to a prompt
    # holding its earlier answer, the low-bit steps' K/V not kept; the others are untouched)
    assert all(together[str(i)] == alone[i] for i in range(4) if str(i) not in preempted)
    prompts = [prompt(400 + 50 * i, 20 + i) for i in range(4)]
    want = [greedy(vllm, engine(vllm, tiny, name, kv_bytes=4 << 20), [p], n=40)[0] for p in prompts]
    llm = engine(vllm, tiny, name, kv_bytes=4 << 20)
    eng, params = llm.llm_engine, vllm.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    out, step = {}, 0
    while eng.has_unfinished_requests():
        if step == 6:
            eng.abort_request(["1"])
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in eng.step() if o.finished})
        step += 1
    assert "1" not in out and [out[str(i)] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    kivi = [greedy(vllm, engine(vllm, tiny, "kivi-1bit", kv_bytes=4 << 20), [p], n=40)[0] for p in prompts]
    drafts = dict(speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4,
                                          prompt_lookup_min=1))
    assert run_apart(tiny, "kivi-1bit", prompts, 40, tmp_path, **drafts) == kivi


ENGINE_RUN = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, enable_prefix_caching=False, block_size=64,
              max_model_len=1024, kv_cache_memory_bytes=8 << 20, seed=0, skip_tokenizer_init=True, **json.loads(sys.argv[4]))
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True))
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def run_apart(model, cache, prompts, n, tmp_path, env=(), **kw):
    """An engine with the plugin in a process of its own (vLLM's ngram drafts load numba, whose llvmlite objects
    stop a later in-process engine's kernel scan; tensor parallel needs processes anyway) -> each prompt's tokens."""
    (tmp_path / "engine.py").write_text(ENGINE_RUN)
    env = dict(os.environ, VLLM_PLUGINS="specache", SPECACHE_CACHE=cache, OMP_NUM_THREADS="1", **dict(env))
    r = subprocess.run([sys.executable, str(tmp_path / "engine.py"), str(model), json.dumps(prompts), str(n), json.dumps(kw)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("[[")][-1])  # (vLLM logs to stdout too)


def test_two_ranks_give_one_ranks_tokens(vllm, tiny, tmp_path):
    """tensor_parallel_size=2 across processes (one core a rank): each rank's backend holds its own KV head's pages
    and host store; the greedy tokens are one rank's."""
    prompts, env = [prompt(200, 40), prompt(333, 41)], dict(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    runs = {n: run_apart(tiny, "specache-1bit-lag", prompts, 16, tmp_path, env, tensor_parallel_size=n,
                         distributed_executor_backend="mp") for n in (1, 2)}
    assert runs[2] == runs[1]


# ---- what a user runs: python -m integrations.specache_vllm, vllm serve ------------------------------------------------
def entry(*args, timeout=900, **env):
    return subprocess.run([sys.executable, "-m", "integrations.specache_vllm", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **env))


@pytest.fixture(scope="module")
def tiny_chat(tiny, tmp_path_factory):
    """The tiny Llama with the default model's tokenizer (and its vocabulary's size)."""
    import shutil
    from transformers import LlamaConfig
    if not (HF_DIR / "tokenizer.json").is_file():
        pytest.fail(f"{HF_DIR} is missing: make test-vllm builds it")
    cfg = LlamaConfig.from_pretrained(tiny)
    cfg.vocab_size = 49152
    out = random_llama(cfg, tmp_path_factory.mktemp("tiny-chat"))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (HF_DIR / f).is_file():
            shutil.copy(HF_DIR / f, out / f)
    return out


@pytest.mark.parametrize("args,message", [
    (["--cache", "specache-1bit"], "fetch policy 'speculative' is not available in the vLLM backend: it runs sequential, lag, oracle"),
    (["--cache", "specache-1bit-resync"], "it runs sequential, lag, oracle"),
    (["--cache", "nonsense"], "unknown cache 'nonsense'"),
    (["--cache", "specache-1bit-lag", "--block-size", "32"], "must be a multiple of the key group (64)"),
    (["--cache", "kivi-1bit", "--block-size", "256"], "divide the residual window (128)"),
    (["--model-type", "gpt2"], "gpt2"),
    (["--head-dim", "48"], "head size 48")])
def test_the_entry_refuses_what_the_engine_cannot_run_before_it_starts(vllm, tiny, tmp_path, args, message):
    """One `error:` line, before an engine (or a weight) loads."""
    model = tiny
    if args[0] in ("--model-type", "--head-dim"):
        cfg = json.loads((tiny / "config.json").read_text())
        cfg.update({"model_type": args[1]} if args[0] == "--model-type" else {"head_dim": int(args[1])})
        model = tmp_path / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        args = ["--cache", "specache-1bit-lag"]
    t = time.perf_counter()
    r = entry("--hf", model, *args, timeout=120)
    errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and message in errors[0], r.stdout[-2000:] + r.stderr[-2000:]
    assert "Loading weights" not in r.stdout + r.stderr and time.perf_counter() - t < 60


def test_the_entry_prints_answers_and_capacities(vllm, tiny_chat, tmp_path):
    """A prompts file of chat turns and text, served at once; --json's last line is generate.py's object with the
    engine's capacity and vLLM's own side by side (the latter what a stock engine counts for the same budget)."""
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"role": "user", "content": "Name three colours."}) + "\n" + json.dumps("Once upon a time")
                 + "\n" + json.dumps({"text": "The capital of France is"}) + "\n")
    r = entry("--hf", tiny_chat, "--cache", "specache-1bit-lag", "--prompts-file", f, "--max-new-tokens", 8,
              "--kv-bytes", 16 << 20, "--max-model-len", 1024, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(res["texts"]) == 3 and len(res["tokens"]) == 3 and res["cache"] == "specache-1bit-lag"
    assert res["kv_capacity_tokens"] > 5 * res["stock_kv_capacity_tokens"] and res["max_concurrency"] > 5 * res["stock_max_concurrency"]
    assert res["kv_capacity_tokens_16bit"] > res["stock_kv_capacity_tokens_16bit"] > 0
    assert "--- prompt 3 ---" in r.stderr and "vLLM's own attention" in r.stderr
    stock = engine(vllm, tiny_chat, kv_bytes=16 << 20)
    cc = stock.llm_engine.vllm_config.cache_config
    assert res["stock_kv_capacity_tokens"] == blocks_of(stock) * 64 == int(cc.kv_cache_size_tokens)
    assert res["stock_max_concurrency"] == pytest.approx(float(cc.kv_cache_max_concurrency), abs=1e-3)


def test_the_default_models_needles_get_the_projects_answers(vllm, tmp_path):
    """The default model's chat needles (about 400 and 800 tokens), served together by the engine's 1-bit SpeCache:
    each answer is the one generate.py's cache of the same name gives that prompt alone."""
    if not (DEFAULT_CKPT / "config.json").is_file() or not (HF_DIR / "config.json").is_file():
        pytest.fail("the default model is missing: make test-vllm converts it")
    main_py = ROOT / ".venv" / "bin" / "python"  # (the project's venv: its generate.py reads the converted checkpoint)
    texts = [subprocess.run([main_py, "tools/eval.py", "prompt", "--length", str(n), "--depth", "0.4"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout for n in (400, 800)]
    f = tmp_path / "needles.jsonl"
    f.write_text("".join(json.dumps({"role": "user", "content": t}) + "\n" for t in texts))
    r = entry("--hf", HF_DIR, "--cache", "specache-1bit-lag", "--prompts-file", f, "--max-new-tokens", 24,
              "--kv-bytes", 64 << 20, "--max-model-len", 2048, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])["texts"]
    want = []
    for t in texts:
        p = subprocess.run([main_py, "generate.py", "--checkpoint", DEFAULT_CKPT, "--cache", "specache-1bit-lag", "--chat",
                            "--prompt", t, "--max-new-tokens", "24", "--json", "--quiet"], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stderr[-2000:]
        want.append(json.loads(p.stdout.strip().splitlines()[-1])["text"])
    assert got == want and all(want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_with_the_plugin_answers_a_completion(vllm, tiny_chat, tmp_path):
    """vLLM's OpenAI server (what `vllm serve` runs; that script of vllm-cpu 0.32.0 stops at once, asking for the
    version of a distribution named vllm) with the plugin registered by its entry point: a completion over
    loopback, the backend's host store in the server's log, the answer the in-process engine gives."""
    port, log = free_port(), tmp_path / "serve.log"
    env = dict(os.environ, VLLM_PLUGINS="specache", SPECACHE_CACHE="specache-1bit-lag", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_chat), "--host", "127.0.0.1",
           "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching", "--block-size", "64",
           "--max-model-len", "1024", "--kv-cache-memory-bytes", str(16 << 20), "--seed", "0"]
    server = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
        body = json.dumps(dict(model=str(tiny_chat), prompt="Once upon a time", max_tokens=8, temperature=0)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert "SpeCache host store (specache-1bit-lag)" in log.read_text()
    r = entry("--hf", tiny_chat, "--cache", "specache-1bit-lag", "--prompt", "Once upon a time", "--max-new-tokens", 8,
              "--kv-bytes", 16 << 20, "--max-model-len", 1024, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert answer == json.loads(r.stdout.strip().splitlines()[-1])["text"]
