"""kernels.py: torch references vs dense fp32 attention, Triton kernels (interpreted on CPU) vs the
references, torch.compile tracing.

TRITON_INTERPRET=1 is set before triton is imported. If another test module imported kernels
first (its @triton.jit kernels are then compiled-mode and cannot run on CPU tensors), the
Triton tests are skipped here and re-run in a fresh interpreter process instead.
"""
import os
import subprocess
import sys
from typing import NamedTuple, Optional

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels  # noqa: E402
import prefetch  # noqa: E402
import quant  # noqa: E402
from config import DEFAULT_ATTN_PATH, check_attn_path  # noqa: E402
from gpu import attention, tiles, topk  # noqa: E402
from quant import Fetched, LowBitKV, Residual  # noqa: E402
from siblings import quantspec, zipcache  # noqa: E402
from siblings.attn_views import ViewKV, attention_views_triton  # noqa: E402
from tests.helpers import planes_where_they_fit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRETED = type(attention._attn_words_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="kernels imported before TRITON_INTERPRET=1 "
                                       "(covered by test_kernels_interpreted_in_fresh_process)")


class Case(NamedTuple):
    q: torch.Tensor
    store: LowBitKV
    residual: Residual
    fetched: Optional[Fetched]
    sm_scale: float
    fp: dict  # the fp32 originals of the quantized keys and values

    def args(self):
        return self.q, self.store, self.residual, self.fetched, self.sm_scale


def triton_attention(c: "Case", **kw):
    """The Triton launch a cache of this case's store runs (a sibling's view: attn_views')."""
    if isinstance(c.store, ViewKV):
        kw.pop("attn_path", None)
        return attention_views_triton(*c.args(), **kw)
    return attention.attention_lowbit_triton(*c.args(), **kw)


def rows(c: Case) -> int:
    """Query rows per kv head (G*T)."""
    return c.q.shape[1] // c.store.k_codes.shape[1] * c.q.shape[2]


# ---- a small cache with garbage past every valid length -----------------------------------------
def make_case(B=1, Hkv=2, G=3, T=2, D=64, S=256, n_quant=160, R=64, res_len=37, bits=2, gk=32, gv=64,
              fetch=0, hier=False, zip=False, mixed=None, dtype=torch.float32, seed=0) -> Case:
    """n_quant must be a multiple of gk (a cache invariant: whole key groups are quantized). Slots
    >= n_quant get random codes and NaN/inf meta, residual rows >= res_len and invalid fetched rows
    NaN: nothing outside the valid ranges may leak into the result. mixed=(bits_hi, n_ref): ZipCache
    mixed precision with n_ref random salient tokens per key group."""
    assert n_quant % gk == 0 and T <= res_len <= R
    g = torch.Generator().manual_seed(seed)
    H = Hkv * G
    chan = torch.ones(D)
    chan[torch.randperm(D, generator=g)[:3]] = 8.0  # outlier key channels
    k_fp = torch.randn(B, Hkv, S, D, generator=g) * chan
    v_fp = torch.randn(B, Hkv, S, D, generator=g)
    lo = dict(k_codes_lo=None, v_codes_lo=None, v_chan=None)
    if hier:
        k_codes, lo["k_codes_lo"], k_scale, k_zero = quantspec.quantize_hier_keys(k_fp, gk)
        v_codes, lo["v_codes_lo"], v_scale, v_zero = quantspec.quantize_hier_values(v_fp, gv)
        bits = 4
    elif mixed:
        bits_hi, n_ref = mixed
        k_codes, kl, k_scale, k_zero = zipcache.quantize_mixed(k_fp, bits, bits_hi, gk, "tokens")
        lo["v_chan"] = zipcache.channel_scale(v_fp) if zip else None
        v_src = v_fp / lo["v_chan"].float()[..., None, :] if zip else v_fp
        v_codes, vl, v_scale, v_zero = zipcache.quantize_mixed(v_src, bits, bits_hi, gv, "channels")
        lo["k_ref"], lo["v_ref"], ref_map = zipcache.compact_refinement(kl, vl, torch.rand(B, Hkv, S, generator=g), gk,
                                                                     n_ref, bits_hi - bits)
        garbage = torch.randint(0, n_ref + 1, ref_map[:, :, n_quant:].shape, generator=g).to(torch.uint8)
        ref_map[:, :, n_quant:] = torch.where(garbage == n_ref, 255, garbage)
        for x in (lo["k_ref"], lo["v_ref"]):
            x[:, :, n_quant // gk * n_ref:] = torch.randint(0, 256, x[:, :, n_quant // gk * n_ref:].shape, generator=g,
                                                            dtype=torch.uint8)
        lo.update(ref_map=ref_map, ref_bits=bits_hi - bits, n_ref=n_ref)
    else:
        k_codes, k_scale, k_zero = quant.quantize_keys(k_fp, bits, gk)
        if zip:
            lo["v_chan"] = zipcache.channel_scale(v_fp)
            v_codes, v_scale, v_zero = zipcache.quantize_values_zip(v_fp, bits, gv, lo["v_chan"])
        else:
            v_codes, v_scale, v_zero = quant.quantize_values(v_fp, bits, gv)
    for codes in (k_codes, v_codes, lo["k_codes_lo"], lo["v_codes_lo"]):
        if codes is not None:
            codes[:, :, n_quant:] = torch.randint(0, 256, codes[:, :, n_quant:].shape, generator=g, dtype=torch.uint8)
    k_scale[:, :, n_quant // gk:], k_zero[:, :, n_quant // gk:] = float("nan"), float("inf")
    v_scale[:, :, n_quant:], v_zero[:, :, n_quant:] = float("nan"), float("-inf")
    k_res, v_res = torch.randn(B, Hkv, R, D, generator=g), torch.randn(B, Hkv, R, D, generator=g)
    k_res[:, :, res_len:], v_res[:, :, res_len:] = float("nan"), float("nan")
    q = torch.randn(B, H, T, D, generator=g)
    fetched = None
    if fetch:
        idx = torch.stack([torch.randperm(max(n_quant, fetch), generator=g)[:fetch] for _ in range(B * Hkv)])
        idx = idx.reshape(B, Hkv, fetch)
        valid = (torch.rand(B, Hkv, fetch, generator=g) < 0.75) & (idx < n_quant)
        idx = torch.where(valid, idx, 0)
        fk = torch.gather(k_fp, 2, idx[..., None].expand(-1, -1, -1, D)).clone()
        fv = torch.gather(v_fp, 2, idx[..., None].expand(-1, -1, -1, D)).clone()
        fk[~valid], fv[~valid] = float("nan"), float("nan")
        fetched = Fetched(fk, fv, idx, valid)
    if dtype != torch.float32:  # the CUDA dtypes: fp16/bf16 queries, residual and fetched rows
        q, k_res, v_res = q.to(dtype), k_res.to(dtype), v_res.to(dtype)
        if fetched is not None:
            fetched = fetched._replace(k=fetched.k.to(dtype), v=fetched.v.to(dtype))
    store = LowBitKV(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, torch.tensor(n_quant), bits, gk, gv)
    if any(x is not None for x in lo.values()):  # a sibling's codes: read through a view
        store = ViewKV(store, **lo)
    return Case(q, store, Residual(k_res, v_res, torch.tensor(res_len)), fetched, D ** -0.5, dict(k=k_fp, v=v_fp))


def dense_attention(c: Case):
    """Loop-per-(batch, head, token) fp32 attention over everything that is valid."""
    B, H, T, D = c.q.shape
    Hkv, S = c.store.k_codes.shape[1], c.store.k_codes.shape[2]
    keys, vals = c.store.dequantized()
    keep = torch.arange(S) < c.store.n_quant
    replaced = kernels.replaced_mask(c.fetched, S) if c.fetched is not None else None
    out, lse = torch.zeros(B, H, T, D), torch.zeros(B, H, T)
    for b in range(B):
        for h in range(H):
            j = h // (H // Hkv)
            kq = keep & ~replaced[b, j] if replaced is not None else keep
            ks, vs = [keys[b, j][kq]], [vals[b, j][kq]]
            if c.fetched is not None:
                fv = c.fetched.valid[b, j]
                ks.append(c.fetched.k[b, j][fv])
                vs.append(c.fetched.v[b, j][fv])
            for t in range(T):
                n_res = int(c.residual.length) - T + t + 1
                K_all = torch.cat([x.float() for x in ks + [c.residual.k[b, j, :n_res]]])
                V_all = torch.cat([x.float() for x in vs + [c.residual.v[b, j, :n_res]]])
                s = K_all @ c.q[b, h, t].float() * c.sm_scale
                out[b, h, t] = torch.softmax(s, 0) @ V_all
                lse[b, h, t] = torch.logsumexp(s, 0)
    return out, lse


def tol(dtype, fp32=1e-5):
    return dict(atol=fp32, rtol=fp32) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


CASES = {
    "G1-T1-1bit": dict(G=1, T=1, bits=1),
    "G3-T2-2bit": dict(G=3, T=2, bits=2),
    "G4-T4-4bit-full": dict(G=4, T=4, bits=4, n_quant=256, res_len=64),
    "G3-T1-empty": dict(G=3, T=1, n_quant=0, res_len=5),
    "G3-T2-fetch": dict(G=3, T=2, fetch=8),
    "G4-T1-1bit-fetch-zip": dict(G=4, T=1, bits=1, fetch=8, zip=True),
    "G3-T8-hier-fetch": dict(G=3, T=8, hier=True, fetch=8, res_len=50),
    "G1-T2-gk64-gv32": dict(G=1, T=2, gk=64, gv=32, n_quant=128, res_len=64),
    "B2-D48-4bit": dict(B=2, G=3, T=2, D=48, bits=4, gv=16, fetch=4),
    "G3-T2-fp16": dict(G=3, T=2, fetch=8, dtype=torch.float16),
    "G4-T1-bf16": dict(G=4, T=1, fetch=8, dtype=torch.bfloat16),
    "G3-T2-mixed-2/4-zip-fetch": dict(G=3, T=2, bits=2, mixed=(4, 13), zip=True, fetch=8),
    "G1-T1-mixed-1/2": dict(G=1, T=1, bits=1, mixed=(2, 3)),
    "B2-D48-mixed-2/4-bytes": dict(B=2, G=3, T=2, D=48, bits=2, gv=16, mixed=(4, 5), fetch=4),
    "G4-T2-mixed-2/6-fp16": dict(G=4, T=2, bits=2, mixed=(6, 16), fetch=8, dtype=torch.float16),
}


# ---- reference vs dense ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense(case):
    c = make_case(**CASES[case])
    out, lse = kernels.attention_lowbit_ref(*c.args())
    want_out, want_lse = dense_attention(c)
    assert out.shape == c.q.shape and out.dtype == c.q.dtype
    assert lse.shape == c.q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out.to(out.dtype), **tol(out.dtype))
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [1, 2])
def test_all_rows_fetched_is_exact_attention(bits):
    """eq. 1 with every quantized position fetched: exactly fp attention over [original, residual]."""
    B, Hkv, G, T, D, n_quant, res_len = 1, 2, 3, 2, 64, 96, 20
    c = make_case(B=B, Hkv=Hkv, G=G, T=T, D=D, S=128, n_quant=n_quant, res_len=res_len, bits=bits)
    perm = torch.stack([torch.randperm(n_quant) for _ in range(B * Hkv)]).reshape(B, Hkv, n_quant)
    gather = lambda x: torch.gather(x, 2, perm[..., None].expand(-1, -1, -1, D))  # noqa: E731
    fetched = Fetched(gather(c.fp["k"]), gather(c.fp["v"]), perm, torch.ones(B, Hkv, n_quant, dtype=torch.bool))
    out, lse = kernels.attention_lowbit_ref(c.q, c.store, c.residual, fetched, c.sm_scale)
    keys = torch.cat([c.fp["k"][:, :, :n_quant], c.residual.k[:, :, :res_len]], 2).repeat_interleave(G, 1)
    vals = torch.cat([c.fp["v"][:, :, :n_quant], c.residual.v[:, :, :res_len]], 2).repeat_interleave(G, 1)
    causal = torch.arange(n_quant + res_len) < n_quant + res_len - T + 1 + torch.arange(T)[:, None]
    s = (c.q @ keys.transpose(-1, -2) * c.sm_scale).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ vals, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


# ---- top-k ----------------------------------------------------------------------------------------
class TopkCase(NamedTuple):
    q_row: torch.Tensor
    lse_row: torch.Tensor
    store: LowBitKV
    k: int
    sm_scale: float


def topk_inputs(G=3, n_quant=160, S=256, hier=False, k=16, seed=1, **kw) -> TopkCase:
    c = make_case(G=G, T=1, S=S, n_quant=n_quant, hier=hier, seed=seed, **kw)
    _, lse = kernels.attention_lowbit_ref(*c.args())
    return TopkCase(c.q[:, :, 0], lse[:, :, 0], c.store, k, c.sm_scale)


def dense_topk_scores(t: TopkCase):
    B, H, D = t.q_row.shape
    Hkv, S = t.store.k_codes.shape[1], t.store.k_codes.shape[2]
    keys = t.store.dequantized()[0]
    score = torch.full((B, Hkv, S), -1.0)
    for b in range(B):
        for j in range(Hkv):
            for p in range(int(t.store.n_quant)):
                heads = range(j * (H // Hkv), (j + 1) * (H // Hkv))
                score[b, j, p] = sum(torch.exp(t.sm_scale * t.q_row[b, h] @ keys[b, j, p] - t.lse_row[b, h])
                                     for h in heads)
    return score


@pytest.mark.parametrize("G,n_quant,hier,k", [(1, 128, False, 16), (3, 96, False, 16), (4, 64, True, 16),
                                              (3, 32, False, 64)])
def test_topk_reference_matches_dense(G, n_quant, hier, k):
    t = topk_inputs(G=G, n_quant=n_quant, hier=hier, S=128, k=k)
    score, idx = kernels.topk_lowbit_ref(*t)
    dense = dense_topk_scores(t)
    torch.testing.assert_close(score, dense.topk(k, -1).values, atol=1e-6, rtol=1e-5)
    valid = score >= 0
    assert valid.sum(-1).eq(min(n_quant, k)).all()
    torch.testing.assert_close(torch.gather(dense, 2, idx)[valid], score[valid], atol=1e-6, rtol=1e-5)
    assert (idx[~valid] == 0).all()
    if G == 1:  # one head per kv head: probabilities of a distribution (<= 1 in total)
        assert dense.clamp_min(0).sum(-1).le(1 + 1e-5).all()


@pytest.mark.parametrize("bits,mixed", [(2, (4, 13)), (1, (2, 8))])
def test_topk_mixed_precision_reference_matches_dense(bits, mixed):
    t = topk_inputs(G=3, n_quant=96, S=128, k=16, bits=bits, mixed=mixed)
    score, idx = kernels.topk_lowbit_ref(*t)
    dense = dense_topk_scores(t)
    torch.testing.assert_close(score, dense.topk(16, -1).values, atol=1e-6, rtol=1e-5)


def test_mixed_precision_store_reads_as_the_quantizer_wrote():
    """The compact refinement rows and the slot map read back (kernels' dequantization) as
    zipcache.dequantize_mixed of the unpacked lower codes: salient rows at bits_hi, others at the
    midpoint; with every token salient, exactly eq. 2 at bits_hi."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 64, 32, generator=g)
    sal = torch.rand(1, 2, 64, generator=g)
    for bits, hi, n_ref in ((2, 4, 6), (1, 3, 16), (2, 4, 16)):
        up, low, sc, zr = zipcache.quantize_mixed(x, bits, hi, 16, "tokens")
        k_ref, _, ref_map = zipcache.compact_refinement(low, low, sal, 16, n_ref, hi - bits)
        has = ref_map != 255
        assert has.view(1, 2, 4, 16).sum(-1).eq(n_ref).all()
        top = sal.view(1, 2, 4, 16).topk(n_ref, -1).indices  # the most salient of each group kept
        assert has.view(1, 2, 4, 16).gather(-1, top).all()
        v_meta = torch.ones(1, 2, 64, 1, dtype=sc.dtype)  # (the values are not read here)
        store = ViewKV(LowBitKV(up, sc, zr, up, v_meta, v_meta, torch.tensor(64), bits, 16, 32),
                       k_ref=k_ref, v_ref=k_ref, ref_map=ref_map, ref_bits=hi - bits, n_ref=n_ref)
        want = zipcache.dequantize_mixed(up, low, has, sc, zr, bits, hi, 16, "tokens")
        torch.testing.assert_close(store.dequantized()[0], want, atol=0, rtol=0)
        s_hi = sc.float().repeat_interleave(16, 2)
        err = (want - x).abs()
        assert (err[has] <= s_hi[has] / 2 + 1e-5).all()  # salient: round to nearest at bits_hi
        assert (err[~has] <= 2 ** (hi - bits - 1) * s_hi[~has] + 1e-5).all()  # others: the bin's midpoint
        if n_ref == 16:
            c4, s4, z4 = quant.quantize_codes(x, hi, 16, "tokens")
            torch.testing.assert_close(want, quant.dequantize_codes(c4, s4, z4, 16, "tokens"), atol=0, rtol=0)


def fetched_rows(t: TopkCase, n_fetch=6, seed=3) -> Fetched:
    """fp rows for some quantized positions (some slots unused), as the SpeCache step holds them."""
    B, Hkv, D = t.q_row.shape[0], t.store.k_codes.shape[1], t.q_row.shape[2]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(int(t.store.n_quant), generator=g)[:n_fetch] for _ in range(B * Hkv)])
    valid = torch.rand(B, Hkv, n_fetch, generator=g) < 0.7
    k = torch.randn(B, Hkv, n_fetch, D, generator=g) * 3
    return Fetched(k, torch.zeros_like(k), idx.view(B, Hkv, -1), valid)


def test_topk_fetched_rows_score_exactly():
    """Algorithm 3's ArgTopK uses the attention that saw the fetched fp rows: at a fetched position
    the score is the fp row's probability, elsewhere the low-bit one."""
    t = topk_inputs(G=3, n_quant=96, S=128, k=96)  # k = n_quant: every slot valid
    f = fetched_rows(t)
    score, idx = kernels.topk_lowbit_ref(*t, f)
    dense = dense_topk_scores(t)
    B, Hkv = dense.shape[:2]
    G = t.q_row.shape[1] // Hkv
    for b in range(B):
        for j in range(Hkv):
            for slot in range(f.idx.shape[2]):
                if f.valid[b, j, slot]:
                    dense[b, j, f.idx[b, j, slot]] = sum(
                        torch.exp(t.sm_scale * t.q_row[b, h] @ f.k[b, j, slot] - t.lse_row[b, h]) for h in range(j * G, (j + 1) * G))
    by_position = torch.full_like(dense, -1.0).scatter(2, idx, score)
    valid = torch.arange(dense.shape[2]) < 96
    torch.testing.assert_close(by_position[..., valid], dense[..., valid], atol=1e-6, rtol=1e-5)


def two_row_inputs(seed=4, n_quant=96, S=128):
    c = make_case(G=3, T=2, S=S, n_quant=n_quant, seed=seed)
    _, lse = kernels.attention_lowbit_ref(*c.args())
    return c, lse


def test_topk_of_two_tokens_is_the_best_of_each_and_first_is_excluded():
    """Union selection: a position scores the larger of the two tokens' probabilities; positions
    below `first` (attention sinks, kept in fp16) are never candidates."""
    c, lse = two_row_inputs()
    one = [kernels.topk_lowbit_ref(c.q[:, :, r], lse[:, :, r], c.store, 96, c.sm_scale) for r in (0, 1)]
    by_pos = [torch.full((1, 2, 128), -1.0).scatter(2, i, s) for s, i in one]
    want = torch.maximum(*by_pos)
    score, idx = kernels.topk_lowbit_ref(c.q, lse, c.store, 96, c.sm_scale)
    torch.testing.assert_close(torch.full((1, 2, 128), -1.0).scatter(2, idx, score), want)
    score, idx = kernels.topk_lowbit_ref(c.q, lse, c.store, 16, c.sm_scale, first=32)
    assert (idx >= 32).all()
    torch.testing.assert_close(score, want[..., 32:].topk(16, -1).values)


def test_topk_exact_is_the_reference_on_full_precision_keys():
    """The oracle's exact top-k equals topk_lowbit_ref over an 8-bit-free 'store' of the same keys."""
    t = topk_inputs(G=3, n_quant=96, S=128, k=16)
    keys = t.store.dequantized()[0]
    score, idx = kernels.topk_exact(t.q_row, keys, t.store.n_quant, 16, t.sm_scale)
    logits = torch.einsum("bhgd,bhsd->bhgs", t.q_row.view(1, 2, 3, -1), keys) * t.sm_scale
    logits[..., 96:] = float("-inf")
    want = torch.softmax(logits, -1).sum(2).topk(16, -1)
    torch.testing.assert_close(score, want.values)
    assert torch.equal(idx, want.indices)


def assert_same_topk(got, want, rtol=1e-5):
    """Same scores within rtol, and every position that either side scores clear of the k-th by more
    than the tolerance is picked by the other (near-ties may swap). 16-bit inputs (against an fp32
    reference over the same values): rtol ~2e-2, since the kernel dots exact integer codes against a
    16-bit query. (Comparing the two sides' clear sets for equality failed on an H100: a score just
    above the margin on one side and just below it on the other.)"""
    (gs, gi), (ws, wi) = got, want
    torch.testing.assert_close(gs.sort(-1, descending=True).values, ws, atol=1e-5, rtol=rtol)
    kth = ws[..., -1:]
    for a, b, sa, sb, kk in zip(gi.flatten(0, 1), wi.flatten(0, 1), gs.flatten(0, 1), ws.flatten(0, 1), kth.flatten()):
        sure = lambda i, s: set(i[s > kk * (1 + 2 * rtol) + 1e-5].tolist())  # noqa: E731 (ties aside)
        assert sure(b, sb) <= set(a.tolist()) and sure(a, sa) <= set(b.tolist())
        assert set(a[sa < 0].tolist()) <= {0}


# ---- Triton vs reference (interpreter) ------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_triton_attention_matches_reference(case):
    c = make_case(**CASES[case])
    want = kernels.attention_lowbit_ref(*c.args())
    got = triton_attention(c, attn_path=planes_where_they_fit(c.store, c.q.shape[-1], rows(c)))
    assert got[0].dtype == want[0].dtype and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], **tol(want[0].dtype, 1e-4))
    # 16-bit inputs: the dots take 16-bit operands (tensor cores), so lse is ~1e-3 relative off
    torch.testing.assert_close(got[1], want[1], **(dict(atol=1e-4, rtol=1e-4) if c.q.dtype == torch.float32
                                                   else dict(atol=2e-2, rtol=5e-3)))


@needs_interpreter
@pytest.mark.parametrize("case", ["G3-T2-fetch", "G1-T2-gk64-gv32", "G3-T2-fp16"])
def test_triton_attention_word_path_matches_reference(case):
    """The word-unpacking path (the default, and what caches the bit-plane path does not take use) on
    cases the bit-plane path also takes."""
    c = make_case(**CASES[case])
    assert attention.planes_fit(c.store, c.q.shape[-1], rows(c))
    want = kernels.attention_lowbit_ref(*c.args())
    got = triton_attention(c, attn_path="words")
    torch.testing.assert_close(got[0], want[0], **tol(want[0].dtype, 1e-4))


def test_bit_plane_path_takes_plain_codes_only():
    """The plane and Gluon paths take the layouts planes_fit takes, by name: a layout they cannot take is an
    error, not a silent fallback; a sibling's view (QuantSpec's INT8, ZipCache's mixed codes) is not a
    LowBitKV at all and its cache refuses any path but words."""
    d48, many = make_case(**CASES["B2-D48-4bit"]), make_case(G=4, T=8, gv=32)  # D 48; 32 query rows x 2 groups
    for c in (d48, many):
        assert not attention.planes_fit(c.store, c.q.shape[-1], rows(c))
        with pytest.raises(ValueError, match="planes attention path does not take this cache layout"):
            attention.attention_lowbit_triton(*c.args(), attn_path="planes")
    plain = make_case(**CASES["G1-T2-gk64-gv32"])  # two value groups: two row copies of 2 query rows
    assert attention._planes_layout(plain.store, 64, 2, torch.float32) == (2, 16, 0, 0.0)
    assert attention._planes_layout(plain.store, 64, 2, torch.float16)[2:] == (1, 1024.0)  # (interpreted)
    assert not attention.planes_fit(plain.store, 64, 32)  # 64 tile rows
    for case in ("G3-T8-hier-fetch", "G1-T1-mixed-1/2"):
        assert isinstance(make_case(**CASES[case]).store, ViewKV)


def test_the_default_attention_path_is_gluon_where_it_fits_else_words():
    """The default, "auto", takes Gluon only for a compiled 16-bit launch on a GPU that attn_gluon.fits: under the
    interpreter and in fp32 it is the word path (what the CPU tests check); the plane and Gluon paths are taken
    by name, unknown names and Gluon under the interpreter stop."""
    plain = make_case(**CASES["G1-T2-gk64-gv32"])
    assert DEFAULT_ATTN_PATH == "auto" and check_attn_path(None) == "auto"
    M = rows(plain)
    assert attention.launch_path("auto", plain.q, plain.store, M) == "words"
    assert attention.launch_path("auto", plain.q.bfloat16(), plain.store, M) == "words"  # (interpreted)
    assert attention.launch_path("planes", plain.q, plain.store, M) == "planes"
    words = attention.attention_lowbit_triton(*plain.args(), attn_path="words")
    assert all(torch.equal(a, b) for a, b in zip(attention.attention_lowbit_triton(*plain.args()), words))
    with pytest.raises(ValueError, match="unknown attention path 'tiles'"):
        attention.attention_lowbit_triton(*plain.args(), attn_path="tiles")
    with pytest.raises(ValueError, match="Gluon path"):
        attention.attention_lowbit_triton(*plain.args(), attn_path="gluon")
    from config import ATTN_PATHS, CacheConfig
    assert ATTN_PATHS == ("words", "planes", "gluon") and CacheConfig.from_name("specache").attn_path is None
    with pytest.raises(ValueError, match="unknown attention path 'tiles'"):
        CacheConfig.from_name("specache", attn_path="tiles")


def test_kernels_import_without_gluon():
    """attn_gluon is imported where the Gluon path runs: a Triton lacking Gluon's names breaks that path only."""
    code = ("import sys, kernels, cache, prefetch, gpu.attention, gpu.topk, gpu.transfer; "
            "assert 'gpu.attn_gluon' not in sys.modules; "
            "assert 'triton.experimental.gluon' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "TRITON_INTERPRET": "1"})


@triton.jit
def _plane_codes_probe(codes, out, N: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr,
                       DT: tl.constexpr, CODES: tl.constexpr):
    rows = tl.arange(0, N)
    cols = tl.arange(0, BLOCK_D)
    dt = tl.float32 if DT == 0 else tl.float16 if DT == 1 else tl.bfloat16
    c = tiles.plane_codes(codes, rows[:, None], cols[None, :], dt, BITS, BLOCK_D, CODES)
    tl.store(out + rows[:, None] * BLOCK_D + cols[None, :], c.to(tl.float32))


@needs_interpreter
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dt,codes,off", [(0, 0, 0), (1, 1, 1024), (2, 1, 128)])
def test_plane_codes_are_the_packed_codes_in_plane_major_order(bits, dt, codes, off):
    """Column j*W + i of a row is channel i*(8/bits) + j; 16-bit tiles read MAGIC + code exactly."""
    if dt == 2 and bits == 8:
        pytest.skip("bf16 holds 128 + c exactly only for c < 128: 8-bit bf16 converts (CODES 0)")
    g = torch.Generator().manual_seed(bits)
    N, D = 4, 64
    c = torch.randint(0, 2 ** bits, (N, D), generator=g, dtype=torch.uint8)
    out = torch.empty(N, D)
    _plane_codes_probe[(1,)](quant.pack_bits(c, bits), out, N=N, BITS=bits, BLOCK_D=D, DT=dt, CODES=codes)
    per = 8 // bits
    order = torch.arange(D).view(D // per, per).t().flatten()  # column j*W + i <- channel i*per + j
    assert torch.equal(out, c[:, order].float() + off)


@needs_interpreter
@pytest.mark.parametrize("n_splits", [1, 3, 8])
def test_triton_attention_split_counts(n_splits):
    """Flash-decoding splits (some empty past n_quant) combine to the same result."""
    c = make_case(G=3, T=2, fetch=8, n_quant=96)
    want = kernels.attention_lowbit_ref(*c.args())
    got = triton_attention(c, n_splits=n_splits, attn_path=planes_where_they_fit(c.store, 64, 6))
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


# ---- the selection's logits, written by the attention, and the one-launch top-k over them -------------
def logits_written(c: Case):
    """[S] bool: the positions whose logits the attention writes (quantized slots and residual rows)."""
    S = c.store.k_codes.shape[2]
    return torch.arange(S) < min(S, int(c.store.n_quant) + int(c.residual.length))


@needs_interpreter
@pytest.mark.parametrize("case,select", [("G3-T2-2bit", 1), ("G3-T2-fetch", 2), ("G4-T1-1bit-fetch-zip", 1),
                                         ("G3-T8-hier-fetch", 1), ("G3-T2-mixed-2/4-zip-fetch", 2),
                                         ("B2-D48-4bit", 2), ("G3-T2-fp16", 1), ("G4-T1-bf16", 1)])
def test_triton_attention_writes_the_reference_logits(case, select):
    """With `select`, every attention path (words, planes, the views of QuantSpec and ZipCache, bytes) writes
    the last `select` tokens' logits: a quantized slot's low-bit score, a fetched row's exact score at its
    position, residual row r's at n_quant + r (-inf where causality hides it), as the reference; split over
    programs. The output and lse are those of the attention without `select`."""
    c = make_case(**CASES[case])
    want_out, want_lse, want = kernels.attention_lowbit_ref(*c.args(), select=select)
    path = planes_where_they_fit(c.store, c.q.shape[-1], rows(c))
    out, lse, got = triton_attention(c, attn_path=path, select=select, n_splits=3)
    plain = triton_attention(c, attn_path=path, n_splits=3)
    assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])
    B, Hkv = c.store.k_codes.shape[:2]
    assert got.shape == want.shape == (B, Hkv, c.q.shape[1] // Hkv * select, c.store.k_codes.shape[2])
    w = logits_written(c)
    assert torch.equal(torch.isinf(got[..., w]), torch.isinf(want[..., w]))
    finite = torch.isfinite(want[..., w])
    rel = 1e-5 if c.q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[..., w][finite], want[..., w][finite], atol=rel * 10, rtol=rel)


def assert_same_selection(got, want_scores, k, rtol=1e-5):
    """got (idx, valid) in position order against the reference's score of every position [B,Hkv,S] (-1: no
    candidate): as many valid rows, and every position scored clear of the k-th by more than the tolerance
    on the one side is picked on the other (near-ties may swap)."""
    idx, valid = got
    assert torch.equal(idx, idx.sort(-1).values)  # position order
    for i, v, sc in zip(idx.flatten(0, 1), valid.flatten(0, 1), want_scores.flatten(0, 1)):
        kth = sc.topk(k).values[-1]
        assert int(v.sum()) == int((sc >= 0).sum().clamp(max=k))
        chosen = set(i[v].tolist())
        assert set(((sc >= 0) & (sc > kth * (1 + 2 * rtol) + 1e-6)).nonzero().flatten().tolist()) <= chosen
        assert all(float(sc[p]) >= float(kth) * (1 - 2 * rtol) - 1e-6 for p in chosen)


@needs_interpreter
@pytest.mark.parametrize("G,T,n_quant,kw,k,first", [(1, 1, 160, {}, 16, 0), (3, 1, 96, dict(fetch=6), 16, 0),
                                                     (4, 1, 256, dict(hier=True, fetch=6), 32, 0), (3, 1, 32, {}, 64, 0),
                                                     (3, 2, 96, dict(fetch=6), 16, 32),
                                                     (3, 1, 96, dict(bits=1, mixed=(2, 8), fetch=6), 16, 0),
                                                     (3, 2, 96, dict(fetch=6, dtype=torch.float16), 16, 4)])
def test_fused_selection_equals_the_separate_topk(G, T, n_quant, kw, k, first):
    """The attention's logits and one top-k launch pick what the top-k scored from the codes again picked
    (topk_lowbit_ref, the separate pass this replaces: fetched rows scored exactly, the best of T selecting
    tokens, nothing below `first`), ties aside; and exactly what select_ref picks from the same logits."""
    c = make_case(G=G, T=T, S=256, n_quant=n_quant, seed=1, **kw)
    path = planes_where_they_fit(c.store, c.q.shape[-1], rows(c))
    _, lse, logits = triton_attention(c, attn_path=path, select=T)
    got = topk.select_triton(logits, lse, c.store.n_quant, k, first, slice_len=64)
    ref = kernels.select_ref(logits, lse, c.store.n_quant, k, first)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    S = c.store.k_codes.shape[2]
    score, pos = kernels.topk_lowbit_ref(c.q.float(), lse, c.store, S, c.sm_scale, c.fetched, first)
    by_pos = torch.full_like(score, -1.0).scatter_reduce(-1, pos, score, "amax")  # (non-candidates: -1 at 0)
    assert_same_selection(got, by_pos, k, rtol=1e-5 if c.q.dtype == torch.float32 else 2e-2)


@needs_interpreter
def test_triton_custom_ops_opcheck():
    """Schema, fake (meta) kernels and the real launch agree (run on CPU through the interpreter), with and
    without the selection's logits."""
    c = make_case(G=3, T=2, S=128, n_quant=64, fetch=4)
    tensors, ints, optional = kernels.op_inputs(c.store, c.residual, c.fetched)
    got = kernels.attention_op(c.q, list(tensors), list(ints), list(optional), c.sm_scale, "words")
    torch.testing.assert_close(got[:2], kernels.attention_lowbit_ref(*c.args()), atol=1e-4, rtol=1e-4)
    tests = ("test_schema", "test_faketensor")
    for select in (0, 2):
        torch.library.opcheck(kernels.attention_op, (c.q, list(tensors), list(ints), list(optional),
                                                             c.sm_scale, "words", select), test_utils=tests)


@needs_interpreter
def test_views_custom_op_opcheck():
    """The siblings' op (attn_views): schema, fake kernel and the real launch agree with the reference, for
    ZipCache's mixed codes with fetched rows and QuantSpec's INT8 view, with and without the logits."""
    from siblings import attn_views
    for kw in (dict(bits=2, mixed=(4, 13), zip=True, fetch=8), dict(hier=True, fetch=4)):
        c = make_case(G=3, T=2, S=128, n_quant=64, **kw)
        tensors, ints, optional = kernels.op_inputs(c.store.kv, c.residual, c.fetched)
        s = c.store
        args = (c.q, list(tensors), list(ints), list(optional), [s.k_codes_lo, s.v_codes_lo, s.v_chan, s.k_ref, s.v_ref,
                s.ref_map], [s.ref_bits, s.n_ref], c.sm_scale)
        got = attn_views._attention_views_op(*args)
        torch.testing.assert_close(got[:2], kernels.attention_lowbit_ref(*c.args()), atol=1e-4, rtol=1e-4)
        for select in (0, 2):
            torch.library.opcheck(attn_views._attention_views_op, (*args, select),
                                  test_utils=("test_schema", "test_faketensor"))


@needs_interpreter
def test_triton_attention_op_fake_has_the_real_strides():
    """torch.compile trusts the fake (meta) kernel's strides: with q a transposed view (as the model
    passes it) the fake must return the contiguous tensor the real op returns (H100 finding:
    assert_size_stride failed in the compiled SpeCache step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    c = make_case(G=3, T=2, S=128, n_quant=64)
    q = c.q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B,T,H,D] memory
    assert not q.is_contiguous()
    tensors, ints, optional = kernels.op_inputs(c.store, c.residual, c.fetched)
    real = kernels.attention_op(q, list(tensors), list(ints), list(optional), c.sm_scale, "words")
    with FakeTensorMode() as mode:
        fake_in = [mode.from_tensor(x) for x in tensors]
        fake = kernels.attention_op(mode.from_tensor(q), fake_in, list(ints), list(optional), c.sm_scale,
                                            "words")
    for r, f in zip(real, fake):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


@pytest.mark.skipif(INTERPRETED, reason="the Triton tests ran in this process")
def test_kernels_interpreted_in_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton",
                        os.path.abspath(__file__)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# ---- torch.compile (CPU path: the references inline) ----------------------------------------------
def decode_step(c: Case, k: int):
    out, lse, logits = kernels.attention_lowbit_ref(*c.args(), select=1)
    idx, valid = kernels.select_ref(logits, lse[:, :, -1:], c.store.n_quant, k)
    ring_k, ring_v = (torch.empty(*idx.shape, c.residual.k.shape[3]) for _ in range(2))
    prefetch.transfer_rows_ref(c.residual.k, c.residual.v, ring_k, ring_v, torch.remainder(idx, c.residual.length), None, None, None)
    return out, lse, valid, idx, ring_k


def _compile_inputs():
    return make_case(G=3, T=2, S=128, n_quant=64, R=32, res_len=9, fetch=4)


def test_compile_fullgraph_no_graph_breaks():
    c = _compile_inputs()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda c: decode_step(c, 8), fullgraph=True, backend="eager")
    got, want = compiled(c), decode_step(c, 8)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # a new n_quant / residual length is data, not a new graph
    compiled(c._replace(store=c.store._replace(n_quant=torch.tensor(96)),
                        residual=c.residual._replace(length=torch.tensor(12))))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_inductor_compile_matches_eager():
    """One real (small) inductor compile of the fused CPU path, ~15 s cold."""
    c = _compile_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda c: decode_step(c, 8), fullgraph=True)
    got, want = compiled(c), decode_step(c, 8)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3].sort(-1).values, want[3].sort(-1).values)
    torch.testing.assert_close(got[4].sum(2), want[4].sum(2))
