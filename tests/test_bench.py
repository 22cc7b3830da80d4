"""tools/bench.py on a tiny random Llama: fields, byte accounting, the report. No timing assertions (Table 3:
tests/test_table3.py; tools/gpu_check.py: tests/test_gpu_check.py)."""
import json
from argparse import Namespace
from dataclasses import asdict

import pytest
import torch

import quant
from cache import KVCaches
from tests.helpers import setup, tiny_model
from tools import bench, bench_report, measure

CACHES = ["full", "kivi", "kivi+2tok", "specache", "specache-sequential"]


def opts(**kw):
    a = dict(bits=1, group=16, residual=32, k=8, one_bit=None, fit=None, quant=None, warmup=1, steps=2, profile_steps=0,
             prefill_chunk=64, compile=False, max_run_batch=None, host_budget_gb=64.0, attn_path=None)
    a.update(kw)
    return Namespace(**a)


BW = {"copy_gbs": 10.0, "read_gbs": 20.0}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def attached(model):
    caches = [layer.attention.kv_cache for layer in model.layers]
    prefetcher = getattr(caches[0], "prefetcher", None)
    return KVCaches(None, caches, prefetcher, None), prefetcher


@pytest.mark.parametrize("cache", CACHES)
def test_run_config_fields_and_bytes(model, cache):
    a = opts()
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    r = bench.run_config(model, cache, 100, 2, ids, a, BW)
    caches, prefetcher = attached(model)
    cfg, T = bench.bench_config(cache, a)
    assert r["step_tokens"] == T == (2 if cache in ("specache", "kivi+2tok") else 1)
    assert r["n_timed"] == a.steps and len(r["tokens"]) == 1 + a.warmup + a.steps
    assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
    assert r["tok_s"] == pytest.approx(2 / (r["step_ms_median"] / 1e3))  # one output token per step
    assert r["cpu_share"] > 0
    # the caches' own accounting
    assert r["kv_device_bytes"] == caches.device_bytes()
    assert r["kv_host_bytes"] == caches.host_bytes()
    assert r["fetch_bytes_per_step"] == (prefetcher.bytes_per_step() if cfg.kind == "specache" else 0)
    assert (r["kv_host_bytes"] > 0) == (cfg.kind == "specache")
    n_valid = 100 + a.warmup + a.steps
    assert r["read_bytes_per_step"] == bench.weight_bytes(model) + caches.read_bytes(T)
    assert r["achieved_gbs"] == pytest.approx(r["read_bytes_per_step"] / (r["step_ms_median"] / 1e3) / 1e9)
    assert r["of_copy_bw"] == pytest.approx(r["achieved_gbs"] / BW["copy_gbs"])
    if cfg.kind != "full":  # the low-bit caches kept exactly the real tokens
        assert all(int(c.n_quant) + int(c.res_len) == n_valid for c in caches)
    json.dumps(r)


def test_weight_bytes(model):
    from model import ModelArgs, Transformer
    total = sum(p.nbytes for p in model.parameters())
    assert bench.weight_bytes(model) == total - model.tok_embeddings.weight.nbytes  # untied: only looked up
    tied = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, intermediate_size=128,
                                 max_seq_len=64, tie_embeddings=True))
    assert bench.weight_bytes(tied) == sum(p.nbytes for p in tied.parameters())  # read whole by the output head


def test_read_bytes_full_and_lowbit(model):
    """A full cache's step reads its valid tokens; a low-bit cache's read equals the per-token sizes
    of quant.quantized_bytes (codes + amortized scale/zero) plus the fp residual rows; SpeCache adds
    the fetched rows and a second pass over the quantized keys (the top-k)."""
    L, B, Hkv, D = model.args.n_layers, 2, model.args.n_kv_heads, model.args.head_dim
    caches = setup(model, "full", B, 96)
    for c in caches:
        c.length.fill_(95)
    assert caches.read_bytes(1) == caches.device_bytes()
    for kind in ("kivi", "specache"):
        caches = setup(model, kind, B, 200, bits=2, group=16, residual=32, k=8)
        pf = caches.prefetcher
        for c in caches:
            c.n_quant.fill_(128)
            c.res_len.fill_(5)
        meta = caches[0].k_scale.dtype
        key_tok, val_tok = quant.quantized_bytes("key", 2, 16, D, meta), quant.quantized_bytes("value", 2, 16, D, meta)
        fp_row = 2 * D * caches[0].k_res.element_size()
        expect = L * B * Hkv * (128 * (key_tok + val_tok) + (5 + 2) * fp_row)
        if kind == "specache":
            expect += L * B * Hkv * (8 * fp_row + 128 * key_tok)
            assert pf.bytes_per_step() == L * B * Hkv * 8 * fp_row
        assert caches.read_bytes(2) == expect


def test_overlap_stats():
    main = [(0, 10), (20, 30), (5, 12)]  # merged: [0, 12], [20, 30]
    side = [(8, 22), (40, 45)]
    st = measure.overlap_stats(main, side)
    assert st["main_busy"] == 22 and st["side_busy"] == 19
    assert st["overlapped"] == (12 - 8) + (22 - 20)
    assert st["overlap_frac"] == pytest.approx(6 / 19)
    assert measure.overlap_stats(main, [])["overlap_frac"] is None


def test_cuda_profile_attributes_kernels_by_name_not_stream():
    """Under CUDA-graph replay a trace's stream ids do not say which kernels are the side stream's: the profile
    finds the transfer by its kernel's name, reports time per class and the top kernels with calls per step."""
    from types import SimpleNamespace
    cuda = torch.autograd.DeviceType.CUDA

    def ev(name, start, end, stream=7):
        return SimpleNamespace(device_type=lambda: cuda, duration_ns=lambda: end - start, start_ns=lambda: start,
                               end_ns=lambda: end, name=lambda: name, device_resource_id=lambda: stream)
    events = [ev("_attn_words_kernel", 0, 40), ev("_select_kernel", 40, 50), ev("_transfer_rows_kernel", 45, 65),
              ev("sm90_xmma_gemm_bf16", 50, 60), ev("triton_poi_fused_bitwise_or_round_3", 70, 80),
              ev("_attn_words_kernel", 100, 140), ev("_select_kernel", 140, 150), ev("_transfer_rows_kernel", 150, 160)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    p = measure.profile_of(prof, n_steps=2)
    assert p["class_us_per_step"] == pytest.approx({"attention": 0.04, "selection": 0.01, "transfer": 0.015,
                                                    "gemm": 0.005, "quantizer": 0.005})
    assert p["transfer_overlapped_frac"] == pytest.approx(15 / 30)  # 45-50 beside the selection, 50-60 the GEMM
    assert p["launches_per_step"] == 4 and p["busy_ms_per_step"] == pytest.approx((65 + 10 + 60) / 1e6 / 2)
    assert [(k["name"], k["calls_per_step"]) for k in p["kernels"][:2]] == [("_attn_words_kernel", 1), ("_transfer_rows_kernel", 1)]


def test_ratio_rows():
    grid = [{"label": lb, "context": 64, "batch": 1, "step_ms_median": ms, "step_tokens": t}
            for lb, ms, t in (("full", 1.0, 1), ("kivi-1bit", 2.0, 1), ("specache-1bit", 2.2, 2), ("kivi-1bit+2tok", 2.1, 2))]
    rows = {o["label"]: (o["vs_full"], o["vs_kivi"]) for o in bench_report.ratio_rows(grid)}
    assert rows == {"kivi-1bit": ("2.00x", "1.00x"), "specache-1bit": ("2.20x", "1.10x"),
                    "kivi-1bit+2tok": ("2.10x", "1.05x")}


def test_labels_and_bad_names():
    a = opts(bits=None, group=None, residual=None, k=None)
    assert [bench.label(c, a) for c in CACHES] == ["full", "kivi-1bit", "kivi-1bit+2tok", "specache-1bit",
                                                   "specache-1bit-sequential"]
    a = opts(bits=2, group=None, residual=None, k=None)
    assert bench.label("kivi", a) == "kivi-2bit" and bench.label("kivi-4bit", a) == "kivi-4bit"  # the name wins
    for bad in ("specache+2tok", "h2o", "kivi-3bit"):
        with pytest.raises(ValueError):
            bench.bench_config(bad, a)
    with pytest.raises(SystemExit):
        bench.parse_args(["--caches", "full,h2o"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--contexts", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--random-weights"])


def test_main_end_to_end(tmp_path, model):
    """The CLI on a tiny checkpoint (no tokenizer: random ids): JSON fields, markdown tables, budget."""
    from safetensors.torch import save_file
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(asdict(model.args)))
    out = tmp_path / "bench.json"
    bench.main(["--checkpoint", str(ckpt), "--contexts", "64,600", "--caches", "full,kivi,specache",
                "--group", "16", "--residual", "32", "--k", "8", "--warmup", "1", "--steps", "2",
                "--kv-budget-gb", "0.004", "--max-run-batch", "2", "--bandwidth-mb", "8", "--threads", "1",
                "--json", str(out)])
    data = json.loads(out.read_text())
    md = out.with_suffix(".md").read_text()
    assert data["prompt_source"] == "random"
    assert data["config"]["contexts"] == [64, 512 - bench.cache_len(0, bench.parse_args(["--warmup", "1", "--steps", "2"]))]
    for key in ("date", "torch", "cpu", "threads", "dtype", "device"):
        assert key in data["environment"]
    assert data["environment"]["threads"] == 1
    assert data["bandwidth"]["copy_gbs"] > 0 and data["bandwidth"]["read_gbs"] > 0
    ctx2 = data["config"]["contexts"][1]
    grid = {(r["cache"], r["context"], r["batch"]): r for r in data["grid"]}
    for c in ("full", "kivi", "specache"):
        for ctx in (64, ctx2):
            assert (c, ctx, 1) in grid
    assert data["budget"]["rows"] and all(r.get("run_batch", 0) <= 2 for r in data["budget"]["rows"])
    for title in ("## Decode steps", "## Step time ratios", "## Table 3", "reviewers' Q6"):
        assert title in md
    assert f"| specache-1bit-g16-r32-k8 | {ctx2} | 1 |" in md or f"| specache-1bit-k8-g16-r32 | {ctx2} | 1 |" in md


def test_random_weights_of_a_known_config_and_kernel_table(tmp_path):
    """--model NAME --random-weights needs no checkpoint; --kernels prints each kernel against its floor."""
    res = bench.main(["--model", "SmolLM2-135M", "--random-weights", "--contexts", "256", "--caches", "full,kivi",
                      "--warmup", "0", "--steps", "1", "--bandwidth-mb", "8", "--threads", "1"])
    assert res["model"] == "SmolLM2-135M (random weights)" and res["prompt_source"] == "random"
    assert {r["label"] for r in res["grid"]} == {"full", "kivi-1bit"}
    res = bench.main(["--model", "SmolLM2-135M", "--random-weights", "--contexts", "256", "--kernels",
                      "--kernel-bits", "1", "--kernel-reps", "2", "--bandwidth-mb", "8", "--threads", "1"])
    names = [r["kernel"] for r in res["kernels"]]
    assert names[0].startswith("full-cache SDPA") and any("1-bit attention" in n for n in names)
    assert any("selection from the logits" in n for n in names) and any("fetch" in n for n in names) and any("re-rank" in n for n in names)
    assert any("beside the 64-row fetch kernel" in n for n in names) and any("beside a copy-engine copy" in n for n in names)
    for r in res["kernels"]:
        assert r["bytes"] > 0 and r["us"] > 0 and r["floor_us_h100"] == pytest.approx(r["bytes"] / 3350e9 * 1e6)


def test_quantspec_section(tmp_path, model):
    """--quantspec: the full-cache baseline, the target alone (gamma 0) and each gamma, with the same
    greedy tokens for every gamma, and read bytes per token from the draft's and the verify step's reads."""
    from safetensors.torch import save_file
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(asdict(model.args)))
    res = bench.main(["--checkpoint", str(ckpt), "--contexts", "300", "--quantspec", "--gammas", "0,2,4",
                      "--warmup", "1", "--steps", "20", "--bandwidth-mb", "8", "--threads", "1"])
    rows = res["quantspec"]
    assert [r["gamma"] for r in rows] == [None, 0, 2, 4] and not res["grid"]
    assert rows[1]["tokens"] == rows[2]["tokens"] == rows[3]["tokens"] and rows[1]["n_quant"] > 0
    for r in rows[1:]:
        assert r["draft_read_bytes"] < r["verify_read_bytes"]
        assert r["read_bytes_per_token"] == pytest.approx(
            (r["gamma"] * r["draft_read_bytes"] + r["verify_read_bytes"]) / r["tokens_per_round"])
    assert rows[1]["tokens_per_round"] == 1.0 and rows[1]["acceptance"] is None
    assert "## QuantSpec vs autoregressive decoding" in bench_report.report(res)


def test_byte_floors_without_running():
    """--floors: the 8B shapes' bytes from one layer's caches, against the closed forms."""
    from model import ModelArgs
    args = ModelArgs.from_name("Llama-3.1-8B")
    L, Hkv, D, ctx = args.n_layers, args.n_kv_heads, args.head_dim, 4096
    rows = {r["cache"]: r for r in bench.floor_rows(args, ["full", "kivi", "specache"], ctx, 2, opts(k=None, group=None,
                                                                                                    residual=None))}
    assert rows["full"]["weight_bytes"] == 2 * (L * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
                                                + 128256 * 4096 + 4096)
    assert rows["full"]["kv_read_bytes"] == 2 * L * 2 * Hkv * (ctx + 1) * D * 2  # K and V, batch 2, bf16, + the step
    assert rows["full"]["pcie_bytes"] == 0
    spec = rows["specache-1bit"]
    assert spec["pcie_bytes"] == 2 * L * 2 * Hkv * 64 * D * 2  # k = 64 rows of K and V per layer and kv head
    # 1-bit codes of K and V plus their fp16 scale/zero: about 1.5 bits a value, against 16
    assert 1.4 / 16 < rows["kivi-1bit"]["kv_read_bytes"] / rows["full"]["kv_read_bytes"] < 1.7 / 16
    assert rows["kivi-1bit"]["kv_read_bytes"] < spec["kv_read_bytes"] < 2 * rows["kivi-1bit"]["kv_read_bytes"]
    with pytest.raises(ValueError, match="--quantspec"):
        bench.floor_rows(args, ["quantspec"], ctx, 1, opts(bits=None, k=None, group=None, residual=None))
    assert "| 4096 | 1 | specache-1bit |" in bench.main(["--floors", "--contexts", "4096", "--caches", "full,specache"])


def test_kernel_sweep_needs_cuda_and_says_so_in_one_line():
    import subprocess
    import sys

    from tests.helpers import ROOT
    r = subprocess.run([sys.executable, "tools/bench.py", "--kernels", "--sweep"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == "error: --sweep times Triton kernels on a CUDA GPU, and there is none here\n", r.stderr


def test_every_sweep_configuration_is_one_the_launchers_take():
    """Each kernel path and configuration the GPU sweep times goes through the launcher (interpreted
    here: warps and stages are ignored, the split count is not) and matches the torch reference."""
    import kernels
    from tools import bench_kernels
    g = torch.Generator().manual_seed(0)
    c, store, fetched, q2 = bench_kernels.lowbit_kernel_case(2, 4, 64, 128, 2, torch.float32, torch.device("cpu"), g,
                                                             group=32, k=8)
    ref, ref_lse = kernels.attention_lowbit_ref(q2, store, c.residual_rows(2), fetched, c.sm_scale)
    configs = bench_kernels.sweep_configs(4)
    assert len(configs) == 1 + 9 + 2 and {cfg.get("n_splits") for cfg in configs} == {None, 2, 8}
    # the Gluon kernel's warps are its own: its rows take the launcher's choice and the split counts
    assert bench_kernels.sweep_configs(4, "gluon") == [{}, {"n_splits": 2}, {"n_splits": 8}]
    assert bench_kernels.sweep_configs(4, "planes", every=False) == [{}]
    for name, launcher in bench_kernels.sweep_kernels().items():
        for cfg in bench_kernels.sweep_configs(4, name):
            if name == "gluon":  # (GPU only: the interpreter refuses it by name)
                with pytest.raises(ValueError, match="Gluon path"):
                    launcher(q2, store, c.residual_rows(2), fetched, c.sm_scale, **cfg)
                continue
            out, lse = launcher(q2, store, c.residual_rows(2), fetched, c.sm_scale, **cfg)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=f"{name} {cfg}")
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_the_sweep_json_is_rewritten_after_every_row(tmp_path, monkeypatch):
    """--kernels --sweep keeps each row in its JSON as it comes (the sweep itself faked: it needs CUDA)."""
    from tools import bench_kernels
    out, seen = tmp_path / "sweep.json", []

    def fake_sweep(args, bw, every=True, on_row=None, **kw):
        assert not every  # --sweep-configs launcher
        for i in range(3):
            on_row(dict(kernel="gluon", gluon=True, us=float(i)))
            seen.append(len(json.loads(out.read_text())["sweep"]))
        return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "measure_bandwidth", lambda device, mb: BW)
    monkeypatch.setattr(measure, "environment", lambda device, dtype: {"device": "cuda"})
    monkeypatch.setattr(bench_kernels, "sweep_rows", fake_sweep)
    bench.main(["--kernels", "--sweep", "--sweep-configs", "launcher", "--device", "cuda", "--json", str(out)])
    assert seen == [1, 2, 3] and json.loads(out.read_text())["complete"] is True


def test_layers_and_attention_path_are_run_and_recorded(tmp_path):
    """--layers builds the first N decoder layers of a known shape; each row says its depth, ms per layer
    and the attention path (the torch reference on CPU; the path asked for is in its config)."""
    out = tmp_path / "b.json"
    bench.main(["--model", "SmolLM2-135M", "--random-weights", "--layers", "2", "--contexts", "64", "--caches",
                "full,specache", "--warmup", "1", "--steps", "2", "--bandwidth-mb", "8", "--attn-path", "planes",
                "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["model"] == "SmolLM2-135M (random weights, 2 of 30 layers)"
    rows = {r["cache"]: r for r in data["grid"]}
    assert rows["full"]["n_layers"] == 2 and rows["full"]["attn_path"] is None
    assert rows["specache"]["attn_path"] == "torch" and rows["specache"]["config"]["attn_path"] == "planes"
    assert rows["specache"]["step_ms_per_layer"] == pytest.approx(rows["specache"]["step_ms_median"] / 2)
    assert "| 64 | 1 | specache-1bit | torch | 2 |" in out.with_suffix(".md").read_text()
    for bad in (["--layers", "2"], ["--model", "SmolLM2-135M", "--random-weights", "--layers", "31"],
                ["--model", "SmolLM2-135M", "--random-weights", "--layers", "0"], ["--attn-path", "tiles"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def gpu_doc_commands() -> list[tuple[str, list]]:
    """(script, argv) of every `python[3] SCRIPT ...` in docs/gpu.md, inline (across line breaks) or in a code block."""
    import re
    import shlex

    from tests.helpers import ROOT
    text = (ROOT / "docs" / "gpu.md").read_text()
    spans = [m.group(1) for m in re.finditer(r"`([^`]+)`", text)] + [ln for ln in text.splitlines() if ln.startswith("    ")]
    out = []
    for span in spans:
        m = re.match(r"(?:python3?|\.venv/bin/python) ((?:[\w.-]+/)*[\w-]+\.py)(.*)", " ".join(span.split()))
        if m:
            out.append((m.group(1), shlex.split(m.group(2))))
    return out


def test_every_gpu_doc_command_parses_as_written():
    """The commands docs/gpu.md gives parse with their tools' parsers, and a bench run names a model shape
    (the GPU machine has no checkpoint) unless it needs none (--sweep, --floors)."""
    import generate
    from tools import eval as eval_tool, gpu_check
    parsers = {"tools/bench.py": bench.parse_args, "tools/gpu_check.py": gpu_check.parse_args, "generate.py": generate.parse_args,
               "tools/eval.py": eval_tool.parse_args}
    cmds = gpu_doc_commands()
    assert sum(script == "tools/bench.py" for script, _ in cmds) >= 8 and any(s == "tools/gpu_check.py" for s, _ in cmds)
    for script, argv in cmds:
        if script not in parsers:  # (results/*/sweep.py, convert_hf.py: not a tool with a parser to call)
            continue
        try:
            a = parsers[script](argv)
        except SystemExit as e:
            raise AssertionError(f"docs/gpu.md: `{script} {' '.join(argv)}` does not parse") from e
        if script == "tools/bench.py":
            assert a.model or a.sweep or a.floors, f"docs/gpu.md: `{script} {' '.join(argv)}` needs a checkpoint"


def test_the_presets_resync_forwards_are_run_and_counted(model):
    """`--caches specache-1bit-best`: the row runs the resync policy's own loop, whose extra
    pre-decoding forward after every wrong speculative token falls between two steps' time marks,
    and reports how many there were beside the median and mean step times."""
    modes = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: modes.append(kw.get("mode", args[2] if len(args) > 2 else "decode")),
                                           with_kwargs=True)
    try:
        a = opts(steps=12)
        ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        r = bench.run_config(model, "specache-1bit-best", 100, 1, ids, a, BW)
    finally:
        hook.remove()
    assert bench.bench_config("specache-1bit-best", a)[0].policy.resync
    assert r["resyncs"] > 0 and modes.count("predecode") == 1 + r["resyncs"]  # Algorithm 2, then one per miss
    assert r["step_ms_min"] <= r["step_ms_mean"] <= r["step_ms_max"] and r["n_timed"] == 12


def test_shared_prefill_gives_each_cache_its_own_prefills_tokens(tmp_path, model):
    """--shared-prefill: one recorded prefill per context replayed into every cache; each cache decodes the
    tokens its own one-chunk prefill gives (in chunks, KIVI's own prefill would attend to its codes of the
    earlier chunks; the replay's attention is exact, as tools/eval.py's)."""
    from safetensors.torch import save_file
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(asdict(model.args)))
    args = ["--checkpoint", str(ckpt), "--contexts", "200", "--caches", "full,kivi,specache,specache-1bit-best",
            "--group", "16", "--residual", "32", "--k", "8", "--warmup", "1", "--steps", "3", "--prefill-chunk", "256",
            "--bandwidth-mb", "8", "--threads", "1"]
    own = {r["cache"]: r["tokens"] for r in bench.main(args)["grid"]}
    shared = {r["cache"]: r["tokens"] for r in bench.main(args + ["--shared-prefill"])["grid"]}
    assert shared == own and len(own) == 4
