"""ZipCache mixed precision (zipcache.ZipCache with salient > 0) on a tiny random Llama: exactness
against the uniform caches it must reduce to, the saliency of eq. 8-9 against a dense computation,
one static graph, byte accounting, clear errors."""
import math

import pytest
import torch

from config import CacheConfig
from generate import decode_step, setup_caches
from siblings.zipcache import ZipCache, probe_positions
from tests.helpers import run_generate, tiny_model

PROMPT_LEN, NEW = 100, 40


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt():
    return torch.randint(0, 256, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


def run(model, name, new=NEW, step_fn=decode_step):
    cfg = CacheConfig.from_name(name)
    caches = setup_caches(model, cfg, 1, PROMPT_LEN + new + 2)
    out, _ = run_generate(model, prompt(), new, cfg, step_fn=step_fn)
    return out, caches


@pytest.fixture(scope="module")
def full_tokens(model):
    return run(model, "full")[0]


def test_every_token_salient_is_the_uniform_high_bit_cache(model):
    """salient 100%: every token keeps all bits_hi bits, which is ZipCache's uniform 4-bit cache,
    code for code (value = 2C * s/2 + z = C s + z exactly): the same tokens."""
    for kind in ("kivi", "specache"):
        want, _ = run(model, f"{kind}-4bit-zipcache-g16-r32-k8")  # (k: SpeCache only)
        got, _ = run(model, f"{kind}-2bit-zipcache-s100-hi4-g16-r32-k8")
        assert torch.equal(got, want), kind


@pytest.mark.parametrize("fetch", ["speculative", "sequential", "resync"])
def test_specache_over_mixed_precision_with_every_row_fetched_is_exact(model, full_tokens, fetch):
    out, _ = run(model, f"specache-2bit-zipcache-s40-hi4-g16-r32-k256-{fetch}")
    assert torch.equal(out, full_tokens)


def test_mixed_precision_error_lies_between_the_uniform_widths(model, full_tokens):
    """Layer 0 (its keys do not depend on attention): the stored keys and values are closer to the
    fp ones than 2-bit ZipCache's and farther than 4-bit's."""
    seq = torch.cat([prompt(), full_tokens[:, :-1]], 1)
    errs = {}
    for name in ("full", "kivi-2bit-zipcache-g16-r32", "kivi-2bit-zipcache-s40-hi4-g16-r32", "kivi-4bit-zipcache-g16-r32"):
        caches = setup_caches(model, name, 1, seq.shape[1] + 1)
        with torch.no_grad():
            model(seq, torch.arange(seq.shape[1]), mode="prefill")
        errs[name] = caches[0]
    full = errs.pop("full")
    rel = {}
    for name, c in errs.items():
        nq = int(c.n_quant)
        k, v = c.dequantized(nq)
        rel[name] = float((k - full.k_cache[:, :, :nq]).norm() / full.k_cache[:, :, :nq].norm()
                          + (v - full.v_cache[:, :, :nq]).norm() / full.v_cache[:, :, :nq].norm())
    two, mixed, four = rel.values()
    assert four < mixed < two, rel


# ---- saliency (zipcache.txt eq. 8-9) ---------------------------------------------------------------
def dense_normalized_attention(q, k, q_pos, G):
    """Eq. 8 from the full attention matrix: for each key i, the attention it receives from the query
    rows that can see it, summed over heads and queries, over how many such rows there are."""
    B, H, P, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    s = q.reshape(B, Hkv, G, P, D) @ k[:, :, None].transpose(-1, -2) / math.sqrt(D)  # [B,Hkv,G,P,L]
    sees = torch.arange(L)[None, :] <= q_pos[:, None]  # [P, L]
    a = torch.softmax(s.masked_fill(~sees, -math.inf), -1)
    return a.sum((2, 3)) / (G * sees.sum(0)).clamp(min=1)


def mixed_cache(max_step_tokens=1, name="kivi-2bit-zipcache-s50-hi4-g16-r32"):
    return ZipCache(1, 2, 128, 32, torch.float32, torch.device("cpu"), CacheConfig.from_name(name),
                       max_step_tokens=max_step_tokens)


def test_probe_saliency_is_eq8_and_probes_are_recent_plus_random():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 6, 40, 32, generator=g), torch.randn(1, 2, 40, 32, generator=g)
    c = mixed_cache()
    acc, cnt = c.probe_saliency(q, k, torch.arange(40), probes=torch.arange(40))  # every token a probe
    torch.testing.assert_close(acc / cnt, dense_normalized_attention(q, k, torch.arange(40), 3))
    # the default probes: the last 5% (2 of 40) and 5% random of the rest; eq. 8 over them
    acc, cnt = c.probe_saliency(q, k, torch.arange(40))
    probes = probe_positions(40, seed=0)
    assert len(probes) == 4 and probes[2:].tolist() == [38, 39] and (probes[:2] < 38).all()
    torch.testing.assert_close(acc / cnt, dense_normalized_attention(q[:, :, probes], k, probes, 3))
    assert cnt[0, 0, -1] == 3 and cnt[0, 0, 0] == 3 * 4  # the last token is seen by its own probe rows only


def test_decode_saliency_accumulates_eq8_and_the_flush_keeps_the_most_salient():
    """Decode 31 tokens after a 1-token prefill (nothing quantized: attention is over the residual
    rows): the sums equal eq. 8 over the real tokens' attention; the 32nd token flushes the block,
    keeping the lower bits of each key group's 8 most salient tokens (s50 of 16)."""
    g = torch.Generator().manual_seed(1)
    n = 32
    q, k, v = torch.randn(1, 6, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g), torch.randn(1, 2, n, 32, generator=g)
    c = mixed_cache()
    c.append_prefill(k[:, :, :1], v[:, :, :1], torch.arange(1), q=q[:, :, :1])
    for t in range(1, n):
        if t == n - 1:
            want = dense_normalized_attention(q[:, :, :t], k[:, :, :t], torch.arange(t), 3)
            torch.testing.assert_close(c.sal_acc[:, :, :t] / c.sal_cnt[:, :, :t], want)
        c(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]), mode="decode")
    assert int(c.n_quant) == 32 and int(c.res_len) == 0
    sal = dense_normalized_attention(q, k, torch.arange(n), 3)
    kept = c.ref_map[:, :, :n] != 255
    top = sal.view(1, 2, 2, 16).topk(8, -1).indices
    assert kept.view(1, 2, 2, 16).sum(-1).eq(8).all() and kept.view(1, 2, 2, 16).gather(-1, top).all()


@pytest.mark.full  # an inductor compile of the ZipCache step (~35 s): CI's make test-full
def test_one_static_graph(model):
    import torch._dynamo
    from torch._dynamo.utils import counters
    name = "specache-2bit-zipcache-s40-hi4-g16-r32-k8"
    eager, _ = run(model, name)
    torch._dynamo.reset()
    counters.clear()
    out, _ = run(model, name, step_fn=torch.compile(decode_step, fullgraph=True))
    assert torch.equal(out, eager)
    assert counters["stats"]["unique_graphs"] == 1  # every step, flushes (and their saliency) included


# ---- bytes and errors --------------------------------------------------------------------------------
def test_byte_accounting_and_average_bits(model):
    """What a step reads: every quantized token's `bits` codes, 40% of them (6 of 16 per key group:
    round(0.4 * 16)) also 2 lower bits, the slot map, the scales, the channel scale and the residual."""
    _, caches = run(model, "kivi-2bit-zipcache-s40-hi4-g16-r32")
    c = caches[0]
    B, H, D = 1, c.k_codes.shape[1], c.k_codes.shape[3] * 4
    nq, nr = int(c.n_quant), int(c.res_len)
    codes = 2 * (nq * D * 2 // 8) + 2 * (nq // 16 * 6 * D * 2 // 8)  # K and V: upper, then refinement rows
    meta = 2 * (nq // 16) * D * 2 + 2 * nq * 1 * 2  # key scale/zero per group and channel; value per token
    want = H * (codes + meta + nq) + H * D * 2 + 2 * H * D * 4 * (nr + 1)  # + map, channel scale, fp32 residual
    assert c.read_bytes(1) == want * B
    avg_bits = 8 * H * codes / (2 * H * nq * D)
    assert avg_bits == pytest.approx(2 + 2 * 6 / 16)


def test_errors_are_clear(model):
    for name, msg in (("kivi-2bit-s40", "--quant zipcache"), ("kivi-2bit-zipcache-s40-hi5", "by 1, 2 or 4"),
                      ("kivi-4bit-zipcache-s40-hi8", "at most 6"), ("kivi-2bit-zipcache-s3-g16", "needs 1 to 254"),
                      ("quantspec-s40", "--quant zipcache")):
        with pytest.raises(ValueError, match=msg):
            CacheConfig.from_name(name)
    assert CacheConfig.from_name("kivi-2bit-zipcache-s40").bits_salient == 4  # the default: bits + 2
    with pytest.raises(ValueError, match="pass q"):
        mixed_cache().append_prefill(torch.zeros(1, 2, 4, 32), torch.zeros(1, 2, 4, 32), torch.arange(4))
