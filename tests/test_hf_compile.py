"""The decode step compiled through transformers (hf.py + generate.py --hf --compile): one fullgraph
graph, no graph break, no recompilation from step to step nor from prompt to prompt of one cache
size, the eager tokens; and a step that would recompile every call is an error.

The fast tests trace with dynamo's "eager" backend (what can break a graph or recompile is dynamo's
tracing of transformers' code and hf.py's state; inductor's code generation is the native step's,
tests/test_specache.py); the `full` ones compile with inductor through the public entry points."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hf.py's tests need transformers (requirements-test.txt)")

import torch._dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import generate  # noqa: E402
from config import CacheConfig  # noqa: E402
from decoding import RecompileError, recompile_guard  # noqa: E402
from integrations import hf  # noqa: E402
from tests.helpers import run_generate  # noqa: E402
from tests.test_hf import NEW, P, adapter, both, prompt, tiny, tiny_gemma3  # noqa: E402,F401 (both: a fixture)

CACHES = ["full", "kivi-1bit-g32-r32", "specache-1bit-best"]  # the preset: resync, so pre-decoding compiles too
MODELS = {"llama": lambda: tiny("llama"), "gemma3": tiny_gemma3}  # Gemma 3: local layers keep rings of 8 tokens


def traced(fn):
    """fn as generate's compiled steps make it (fullgraph, the recompilation check), traced only."""
    return recompile_guard(torch.compile(fn, fullgraph=True, backend="eager"), fn)


def tokens(view, ids, cache, steps=None):
    generate.setup_caches(view, cache, 1, P + NEW + 1)  # one cache size for every prompt
    config = CacheConfig.from_name(cache)
    steps = steps or generate.Steps()
    return run_generate(view, ids, NEW, config, step_fn=steps.decode, pre_decode_fn=steps.pre_decode)[0].tolist()


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("family", MODELS)
def test_step_is_one_graph_across_steps_prompts_and_views(family, cache):
    model = MODELS[family]()
    view = hf.HFModel(model)
    a, b = prompt(1), prompt(2)
    eager = [tokens(view, a, cache), tokens(view, b, cache)]
    resync = CacheConfig.from_name(cache).policy.resync
    steps = generate.Steps(pre_decode=traced(generate.pre_decode) if resync else generate.pre_decode,
                           decode=traced(generate.decode_step))
    torch._dynamo.reset()
    counters.clear()
    got = [tokens(view, a, cache, steps), tokens(view, b, cache, steps)]
    graphs = 2 if resync else 1  # Algorithm 3's step, and resync's pre-decoding (a graph of its own)
    assert got == eager
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"], dict(counters)
    # a second HFModel over the same transformers model (what each hf_generate call builds): the same graphs
    assert tokens(hf.HFModel(model), b, cache, steps) == eager[1]
    assert counters["stats"]["unique_graphs"] == graphs


def test_quantspec_rounds_through_the_adapter_are_three_graphs():
    """QuantSpec (generate.py --hf --method quantspec --compile): the INT4 draft's step, the target's
    verify step and the commit each one graph over every round, the eager tokens."""
    from siblings import quantspec
    view, ids = hf.HFModel(tiny("llama", seed=3)), prompt(5, 120)
    draft = quantspec.make_draft(view, 32)

    def run(steps):
        quantspec.setup_caches(view, "quantspec-g32", 1, ids.shape[1] + 24, gamma=3)
        quantspec.share_caches(draft, view)
        return quantspec.generate_quantspec(view, draft, ids, 3, generate.Decoding(16), steps)[0][0].tolist()
    eager = run(quantspec.Steps())
    torch._dynamo.reset()
    counters.clear()
    steps = quantspec.Steps(draft=traced(quantspec.draft_step), verify=traced(quantspec.verify_step),
                            commit=traced(quantspec.commit))
    assert run(steps) == eager
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"], dict(counters)


def test_a_step_that_recompiles_every_call_is_an_error():
    """A Python int a step reads that changes every step (here a module's attribute, which dynamo takes
    as a constant) is a new graph per step: the third in a row raises, naming the guard."""
    class Offset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.at = 0

        def forward(self, x):
            return x + self.at

    m = Offset()
    step = traced(lambda x: m(x))
    torch._dynamo.reset()
    x = torch.zeros(2)
    for m.at in range(3):  # the first compilation, then two recompilations: not yet a storm
        assert step(x).tolist() == [m.at] * 2
    m.at = 3
    with pytest.raises(RecompileError, match=r"compiled a new graph on 3 calls in a row \(a recompilation "
                                             r"every step\); the guard that failed: .*m.at == 2 "):
        step(x)
    m.at = 1
    assert step(x).tolist() == [1, 1]  # graphs already made are still used


def test_recompile_limit_is_named():
    """Past dynamo's recompile_limit a fullgraph step fails; the error names the limit and the guard."""
    step = traced(lambda x, n: x + n)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        step(torch.zeros(1), 1)
        with pytest.raises(RecompileError, match=r"hit torch._dynamo.config.recompile_limit \(1\); the guard that "
                                             r"failed: .*n == 1"):
            step(torch.zeros(1), 2)


# ---- inductor, through the public entry points ------------------------------------------------------------
@pytest.mark.full
@pytest.mark.parametrize("family", MODELS)
def test_hf_generate_compile_equals_eager(family):
    """model.generate(custom_generate=generate.hf_generate, compile=True): inductor's step, the eager tokens,
    one graph per step function (the preset's decode step and its pre-decoding)."""
    model = MODELS[family]()
    ids = prompt()
    eager = adapter(model, ids, "specache-1bit-best")
    torch._dynamo.reset()
    counters.clear()
    assert adapter(model, ids, "specache-1bit-best", compile=True) == eager
    assert adapter(model, prompt(2), "specache-1bit-best", compile=True) == adapter(model, prompt(2), "specache-1bit-best")
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters)


@pytest.mark.full
def test_hf_generate_compile_samples_with_the_warpers():
    """Sampling through transformers' warpers inside the compiled step: top_k=1 leaves the greedy token."""
    model, ids = tiny("llama"), prompt()
    greedy = adapter(model, ids, "specache-1bit-g32-r32")
    torch._dynamo.reset()
    counters.clear()
    assert adapter(model, ids, "specache-1bit-g32-r32", do_sample=True, top_k=1, temperature=0.7, compile=True) == greedy
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.full
def test_generate_and_eval_cli_hf_compile(both, capsys, tmp_path):
    """generate.py --hf DIR --compile prints the eager run's tokens, with SpeCache and QuantSpec;
    tools/eval.py niah --hf DIR --compile gives the eager run's answers."""
    _, _, d = both
    out = {}
    torch._dynamo.reset()
    counters.clear()
    for flags in ([], ["--compile"]):
        generate.main(["--hf", str(d / "hf"), "--prompt", "find the needle in the haystack 0123 " * 12, "--cache",
                       "specache", "--bits", "1", "--k", "8", "--group", "32", "--residual", "32", "--max-new-tokens",
                       "12", "--json", "--quiet", *flags])
        out[bool(flags)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert out[True] == out[False] and len(out[True]) == 12
    assert counters["stats"]["unique_graphs"] == 1  # (speculative fetch: the decode step only)
    for flags in ([], ["--compile"]):  # QuantSpec's draft, verify and commit steps
        generate.main(["--hf", str(d / "hf"), "--method", "quantspec", "--gamma", "2", "--json", "--quiet",
                       "--max-new-tokens", "8", "--prompt", "the needle " * 20, *flags])
        out[bool(flags)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert out[True] == out[False] and counters["stats"]["unique_graphs"] == 1 + 3
    with pytest.raises(SystemExit, match=r"^error: --compile-prefill is not available with --hf"):
        generate.main(["--hf", str(d / "hf"), "--compile-prefill"])
    from tools import eval as ev
    answers = {}
    for flags in ([], ["--compile"]):
        out = tmp_path / str(bool(flags))
        ev.main(["niah", "--hf", str(d / "hf"), "--methods", "full,specache-1bit-g32-r32", "--lengths", "400",
                 "--depths", "0.5", "--max-new-tokens", "4", "--out", str(out), *flags])
        answers[bool(flags)] = [json.loads(line)["output"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert answers[True] == answers[False] and len(answers[True]) == 2
    assert counters["stats"]["unique_graphs"] == 1 + 3 + 2  # + one graph per method (the full cache, SpeCache)


def test_bench_times_the_adapter():
    """tools/bench.py --hf's rows of the transformers model through hf.py (tools/bench_hf.py): one row per
    cache and mode, the greedy tokens (the full cache: transformers' own), the attention put back."""
    import types

    from tests.test_hf import reference
    from tools import bench_hf
    model, ids = tiny("llama"), prompt()
    a = types.SimpleNamespace(warmup=1, steps=2, compile=False)
    configs = {name: CacheConfig.from_name(name) for name in ("full", "specache-1bit-g32-r32")}
    rows = bench_hf.adapter_rows(a, model, ids[0].tolist(), torch.device("cpu"), configs)
    assert [r["name"] for r in rows] == ["hf.py full eager", "hf.py specache-1bit-g32-r32 eager"]
    assert all(r["step_ms_min"] <= r["step_ms_median"] and r["tok_s"] > 0 for r in rows)
    assert model.config._attn_implementation == "sdpa"
    assert rows[0]["tokens"] == reference(model, ids, new=4)
