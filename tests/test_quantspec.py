"""QuantSpec on a tiny random Llama: greedy self-speculation equals one-token decoding by the target
over the same cache (tokens and final cache state), the acceptance rule's distribution, the INT4
draft weights, one graph per step."""
import pytest
import torch

from siblings import quantspec as qs
from config import CacheConfig
import generate as gen
from tests.helpers import tiny_model

PROMPT, NEW = 150, 90


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_layers=2, max_seq_len=512)


def run(model, gamma, temperature=0.0, steps=None, seed=5, new=NEW):
    torch.manual_seed(0)
    prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    caches = qs.setup_caches(model, CacheConfig.from_name("quantspec-g16"), 1, PROMPT + new + 8, gamma=max(gamma, 1))
    draft = qs.make_draft(model, group=32)
    qs.share_caches(draft, model)
    out, stats = qs.generate_quantspec(model, draft, prompt, gamma, gen.Decoding(new, temperature=temperature),
                                       steps or qs.Steps())
    return out[0].tolist(), stats, caches


@pytest.fixture(scope="module")
def autoregressive(model):
    return run(model, 0)


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_quantspec_equals_target_decoding_and_cache_state(model, autoregressive, gamma):
    """Many rounds with rollbacks and F1 flushes (group 16): the same tokens as gamma = 0, and the
    same cache afterwards (up to float noise: verifying several tokens in one matmul rounds
    differently, which can move a lower-plane code by one step), so no rejected token was ever
    quantized."""
    ref, _, ref_caches = autoregressive
    out, stats, caches = run(model, gamma)
    assert out == ref
    assert stats["rounds"] < NEW and 0 < stats["acceptance_rate"] < 1  # real rollbacks happened
    for a, b in zip(caches, ref_caches):
        # the last round may commit a token past max_new_tokens: compare what both quantized
        assert int(a.n_quant) + int(a.res_len) - (int(b.n_quant) + int(b.res_len)) in range(0, gamma + 1)
        n = min(int(a.n_quant), int(b.n_quant))
        assert n >= 16 * 8
        step = float(b.k_scale[:, :, :n // 16].float().abs().max()) / 16  # one INT8-view step
        for da, db in zip(a.stored().dequantized(), b.stored().dequantized()):
            da, db = da[:, :, :n], db[:, :, :n]
            assert (da - db).abs().max() <= 2 * step and (da != db).float().mean() < 0.01


def test_the_steps_compile_to_one_graph_each(model, autoregressive):
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    c = lambda f: torch.compile(f, fullgraph=True, backend="eager")  # noqa: E731
    out, _, _ = run(model, 3, steps=qs.Steps(draft=c(qs.draft_step), verify=c(qs.verify_step), commit=c(qs.commit)))
    assert out == autoregressive[0]
    assert counters["stats"]["unique_graphs"] == 3


def test_acceptance_rule_keeps_the_target_distribution():
    """Sampled acceptance: whatever the draft's q, the first emitted token follows p."""
    torch.manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).log_softmax(-1)
    p = p_logits.softmax(-1)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 40000
    target = p_logits.expand(n, 2, 4)
    drafts = torch.multinomial(q, n, replacement=True)[:, None]
    a, nxt = qs.accept(target, drafts, q.expand(n, 1, 4), temperature=1.0)
    first = torch.where(a > 0, drafts[:, 0], nxt)
    freq = torch.bincount(first, minlength=4).float() / n
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)
    drafts2 = torch.multinomial(q, 2 * n, replacement=True).view(n, 2)
    a, nxt = qs.accept(p_logits.expand(n, 3, 4), drafts2, q.expand(n, 2, 4), temperature=1.0, cap=torch.tensor(0))
    assert (a == 0).all()  # capped at 0: nothing kept; the next token is d1 if it passed, else a resample
    freq = torch.bincount(nxt, minlength=4).float() / n
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)


def test_greedy_acceptance_is_the_agreeing_prefix():
    logits = torch.full((1, 4, 8), -5.0)
    for i, best in enumerate((3, 5, 1, 7)):
        logits[0, i, best] = 5.0
    a, nxt = qs.accept(logits, torch.tensor([[3, 5, 2]]), None, 0.0)
    assert (int(a), int(nxt)) == (2, 1)  # d1, d2 agree; the target says 1 where the draft said 2
    a, nxt = qs.accept(logits, torch.tensor([[3, 5, 1]]), None, 0.0)
    assert (int(a), int(nxt)) == (3, 7)  # all agree: the bonus token
    a, nxt = qs.accept(logits, torch.tensor([[3, 5, 1]]), None, 0.0, cap=torch.tensor(1))
    assert (int(a), int(nxt)) == (1, 5)


def test_int4_draft_weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    codes, scale, zero = qs.quantize_weight_int4(w, 32)
    err = (qs.dequantize_weight_int4(codes, scale, zero, 32) - w).abs()
    assert (err <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all() and codes.max() <= 15
    lin = qs.Int4Linear(w, 32)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(lin(x), lin.reference(x), atol=0.05, rtol=0.02)  # bf16 activations
    with pytest.raises(ValueError, match="multiple of the weight group"):
        qs.quantize_weight_int4(torch.randn(4, 40), 32)


def test_cli_rejects_what_quantspec_cannot_do():
    from generate import main
    from tests.helpers import require_default_checkpoint
    ckpt = str(require_default_checkpoint())
    for args, msg in ((["--batch-size", "2"], "one sequence"), (["--gamma", "-1"], "--gamma must be >= 0"),
                      (["--draft-group", "48"], "--draft-group must be"), (["--cache", "kivi-2bit"], None)):
        if msg is None:
            continue
        with pytest.raises(SystemExit, match=msg):
            main(["--checkpoint", ckpt, "--method", "quantspec", *args])
