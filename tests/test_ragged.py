"""Batches of different prompts, left-padded to the longest (cache.setup_caches' row_start): each row's first
real slot, which the model's RoPE, the masks, the quantizer, the kernels and the selection read. The padding
is never attended, selected or fetched and never widens a key group's range; a row decodes as its prompt
alone (exactly, where its padding is a multiple of the residual window, so that the shared key groups and
flushes fall where its own would); one compiled graph whatever the lengths."""
import pytest
import torch

import generate
import kernels
import prefetch
import quant
from config import CacheConfig
from generate import setup_caches
from gpu import attention, topk
from tests.helpers import require_default_checkpoint, tiny_model
from tests.test_kernels import Case, logits_written, make_case, needs_interpreter, planes_where_they_fit, rows

STARTS = [0, 45, 170]  # in a key group (of 32), and past n_quant 160: inside the residual window


def ragged(c: Case, starts) -> Case:
    """The case as a left-padded batch: row_start set, and NaN in what only a padding slot owns (its values'
    scales, its residual rows), so a padding slot that is read shows."""
    s = torch.tensor(starts)
    S, R = c.store.k_codes.shape[2], c.residual.k.shape[2]
    pad = torch.arange(S)[None, :] < s[:, None]  # [B, S]
    v_scale = c.store.v_scale.clone()
    v_scale[pad[:, None, :, None].expand_as(v_scale)] = float("nan")
    k_res, v_res = c.residual.k.clone(), c.residual.v.clone()
    pad_res = (c.store.n_quant + torch.arange(R))[None, :] < s[:, None]  # [B, R]
    k_res[pad_res[:, None, :, None].expand_as(k_res)] = float("nan")
    v_res[pad_res[:, None, :, None].expand_as(v_res)] = float("nan")
    store = c.store._replace(v_scale=v_scale, row_start=s)
    fetched = c.fetched
    if fetched is not None:  # (the selection never picks padding: neither does a case's fetch)
        valid = fetched.valid & (fetched.idx >= s[:, None, None])
        fetched = fetched._replace(valid=valid, idx=torch.where(valid, fetched.idx, 0))
    return c._replace(store=store, residual=c.residual._replace(k=k_res, v=v_res), fetched=fetched)


def dense(c: Case):
    """Per (row, head, token) fp32 softmax over the quantized slots from the row's start (less the fetched
    positions), the valid fetched rows and the residual rows from the row's start, causal."""
    B, H, T, D = c.q.shape
    Hkv, S = c.store.k_codes.shape[1], c.store.k_codes.shape[2]
    G, nq = H // Hkv, int(c.store.n_quant)
    keys, vals = c.store.dequantized()
    replaced = kernels.replaced_mask(c.fetched, S) if c.fetched is not None else torch.zeros(B, Hkv, S, dtype=torch.bool)
    out = torch.zeros(B, H, T, D)
    for b in range(B):
        start = int(c.store.row_start[b])
        for h in range(H):
            j = h // G
            for t in range(T):
                quant_ok = (torch.arange(S) < nq) & (torch.arange(S) >= start) & ~replaced[b, j]
                ks, vs = [keys[b, j, quant_ok]], [vals[b, j, quant_ok]]
                if c.fetched is not None:
                    ks.append(c.fetched.k[b, j, c.fetched.valid[b, j]])
                    vs.append(c.fetched.v[b, j, c.fetched.valid[b, j]])
                n_res = int(c.residual.length) - T + t + 1
                res_ok = (torch.arange(n_res) + nq) >= start
                ks.append(c.residual.k[b, j, :n_res][res_ok])
                vs.append(c.residual.v[b, j, :n_res][res_ok])
                k_all, v_all = torch.cat(ks).float(), torch.cat(vs).float()
                p = torch.softmax(k_all @ c.q[b, h, t].float() * c.sm_scale, 0)
                out[b, h, t] = p @ v_all
    return out


@pytest.mark.parametrize("fetch", [0, 16])
def test_the_reference_attends_from_each_rows_start(fetch):
    """kernels.attention_lowbit_ref over a left-padded batch: each row's softmax over its own slots only (a
    start inside a key group, one past n_quant), whatever NaN the padding holds; its selecting logits are
    finite only where a row may select."""
    c = ragged(make_case(B=3, fetch=fetch, seed=2), STARTS)
    out, lse, logits = kernels.attention_lowbit_ref(*c.args(), select=1)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, dense(c), atol=2e-5, rtol=1e-5)
    pos = torch.arange(logits.shape[-1])
    for b, s in enumerate(STARTS):
        assert torch.isinf(logits[b][..., pos < s]).all()


@needs_interpreter
@pytest.mark.parametrize("fetch,bits", [(0, 2), (16, 1), (16, 2)])
def test_the_kernels_attend_from_each_rows_start(fetch, bits):
    """The Triton attention (the word path, and the bit-plane path where it fits) over a left-padded batch:
    the reference's output and lse, and its logits wherever the kernel writes them."""
    c = ragged(make_case(B=3, fetch=fetch, bits=bits, seed=3), STARTS)
    want = kernels.attention_lowbit_ref(*c.args(), select=2)
    for path in {"words", planes_where_they_fit(c.store, c.q.shape[-1], rows(c))}:
        got = attention.attention_lowbit_triton(*c.args(), attn_path=path, select=2)
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
        w = logits_written(c)
        real = torch.arange(c.store.k_codes.shape[2])[None, :] >= torch.tensor(STARTS)[:, None]  # [B, S]
        for b in range(3):
            sel = w & real[b]
            torch.testing.assert_close(got[2][b][..., sel], want[2][b][..., sel], atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("first", [0, 4])
def test_the_selection_never_picks_padding(first):
    """select_triton with row_start equals select_ref with it: no position before a row's start (plus the sinks)
    is a candidate, over several slices; a row that starts past n_quant has none."""
    g = torch.Generator().manual_seed(4)
    B, Hkv, S, k = 3, 2, 1024, 16
    logits = torch.randn(B, Hkv, 2, S, generator=g) * 4
    lse = torch.zeros(B, Hkv * 2, 1)
    starts = torch.tensor([0, 300, 900])
    got = topk.select_triton(logits, lse, torch.tensor(800), k, first, row_start=starts, slice_len=64)
    want = kernels.select_ref(logits, lse, torch.tensor(800), k, first, row_start=starts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for b in range(B):
        assert (got[0][b][got[1][b]] >= int(starts[b]) + first).all()
    assert not got[1][2].any()


@needs_interpreter
def test_rows_that_keep_their_ring():
    """A resync's pre-decoding fetches again only for the rows whose guess was wrong: with keep_rows, the
    launch lays out their ring as prefetch.held_selection + record_rows do (no row moves: slot_rows -1)."""
    g = torch.Generator().manual_seed(5)
    B, Hkv, S, k, off = 3, 2, 512, 8, 4
    lse = torch.zeros(B, Hkv * 2, 1)
    ring = [torch.full((B, Hkv, off + k), -1), torch.zeros(B, Hkv, off + k, dtype=torch.bool)]
    want_ring = [t.clone() for t in ring]
    keep = torch.tensor([False, True, False])
    for step in range(3):
        logits = torch.randn(B, Hkv, 2, S, generator=g) * 3
        keep_now = keep if step else torch.zeros(B, dtype=torch.bool)  # (the first fills every ring)
        idx, valid = kernels.select_ref(logits, lse, torch.tensor(400), k, off)
        idx, valid = prefetch.held_selection(idx, valid, *want_ring, off, keep_now)
        rows = prefetch.record_rows(idx, valid, *want_ring, off)
        slot_rows = torch.empty(B, Hkv, k, dtype=torch.long)
        held = [t.clone() for t in ring]
        topk.select_triton(logits, lse, torch.tensor(400), k, off, record=(*ring, off, slot_rows),
                           keep=(keep_now, ring[0], ring[1], off), slice_len=64)
        assert torch.equal(slot_rows, rows) and torch.equal(ring[0], want_ring[0]) and torch.equal(ring[1], want_ring[1])
        if step:
            assert (slot_rows[1] == -1).all() and torch.equal(ring[1][1], held[1][1])
            assert (slot_rows[0] >= 0).any()


@pytest.mark.parametrize("fit", ["range", "lsq"])
def test_a_group_that_straddles_the_padding_quantizes_its_real_rows_alone(fit):
    """Keys are quantized per channel over a group of 32 positions: with 20 rows of padding (huge values), the
    group's scale and zero are those of its 12 real rows quantized as a group of their own, and the next
    group's are untouched."""
    g = torch.Generator().manual_seed(6)
    k = torch.randn(1, 2, 64, 16, generator=g)
    k[:, :, :20] = 1e4 * torch.randn(1, 2, 20, 16, generator=g)
    codes, scale, zero = quant.quantize_keys(k, 1, 32, fit=fit, pad=torch.tensor([20]))
    _, s_real, z_real = quant.quantize_keys(k[:, :, 20:32], 1, 12, fit=fit)
    torch.testing.assert_close(scale[:, :, :1].float(), s_real.float(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(zero[:, :, :1].float(), z_real.float(), atol=1e-3, rtol=1e-3)
    _, s_next, z_next = quant.quantize_keys(k[:, :, 32:], 1, 32, fit=fit)
    assert torch.equal(scale[:, :, 1:], s_next) and torch.equal(zero[:, :, 1:], z_next)
    real_codes = quant.unpack_bits(codes, 1)[:, :, 20:32]
    assert torch.equal(real_codes, quant.unpack_bits(quant.quantize_keys(k[:, :, 20:32], 1, 12, fit=fit)[0], 1))


# ---- whole generations ------------------------------------------------------------------------------
def left_padded(prompts):
    P = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(P - len(p), dtype=torch.long), p]) for p in prompts])
    return ids, torch.tensor([P - len(p) for p in prompts])


def tokens(model, cfg, ids, starts, new, steps=generate.Steps()):
    setup_caches(model, cfg, ids.shape[0], ids.shape[1] + new + 2, row_start=starts)
    out, _ = generate.generate(model, ids, generate.Decoding(new), steps)
    return out.tolist()


CACHES = ["full", "kivi-1bit-r64", "kivi-2bit-r64", "specache-1bit", "specache-1bit-best", "specache-2bit-best",
          "specache-1bit-oracle", "specache-1bit-sequential", "specache-1bit-union-sink4", "specache-1bit-lag",
          "specache-1bit-rr2-sink4"]


@pytest.mark.parametrize("cache", CACHES)
def test_each_row_decodes_as_its_prompt_alone(cache):
    """A tiny model, three prompts of 300, 172 and 236 tokens (paddings 0, 128, 64: multiples of the residual
    window, 64): each row's greedy tokens are its prompt's alone, for every fetch policy, the presets, sinks and
    re-ranking (the resync policy's pre-decoding re-fetches only the rows that guessed wrong)."""
    model = tiny_model(max_seq_len=1024)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (300, 172, 236)]
    cfg = CacheConfig.from_name(cache)
    ids, starts = left_padded(prompts)
    batch = tokens(model, cfg, ids, starts, 12)
    alone = [tokens(model, cfg, p[None], None, 12)[0] for p in prompts]
    assert batch == alone


@pytest.mark.parametrize("cache", ["full", "kivi-1bit", "specache-1bit-best"])
def test_rows_do_not_interact_whatever_their_padding(cache):
    """Paddings that are no multiple of the residual window (0, 129, 67): each row decodes as it does alone
    with the same padding (the rows share nothing but the slots), and the fp cache as its prompt unpadded."""
    model = tiny_model(max_seq_len=1024)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (300, 171, 233)]
    cfg = CacheConfig.from_name(cache)
    ids, starts = left_padded(prompts)
    batch = tokens(model, cfg, ids, starts, 12)
    assert batch == [tokens(model, cfg, ids[b:b + 1], starts[b:b + 1], 12)[0] for b in range(3)]
    if cache == "full":
        assert batch == [tokens(model, cfg, p[None], None, 12)[0] for p in prompts]


@pytest.mark.full  # (make test-full: one of the slowest cases)
def test_one_compiled_graph_for_batches_of_other_lengths():
    """The compiled step (inductor, fullgraph) over two left-padded batches of other lengths at the same padded
    size: one graph (no recompilation for new starts), the eager tokens."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    model = tiny_model(max_seq_len=512)
    g = torch.Generator().manual_seed(9)
    cfg = CacheConfig.from_name("specache-1bit-g32-r32-sink4")
    batches = [left_padded([torch.randint(0, 256, (n,), generator=g) for n in lens]) for lens in ((200, 97, 150),
                                                                                                  (61, 200, 128))]
    eager = [tokens(model, cfg, ids, starts, 10) for ids, starts in batches]
    torch._dynamo.reset()
    counters.clear()
    steps = generate.Steps().compiled(torch.device("cpu"))
    assert [tokens(model, cfg, ids, starts, 10, steps) for ids, starts in batches] == eager
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@needs_interpreter
@pytest.mark.parametrize("fetch,rerank,sinks", [("speculative", 1, 0),
                                                 pytest.param("resync", 2, 4, marks=pytest.mark.full)])  # (make test-full)
def test_the_gpu_path_interpreted_takes_the_rows_starts(fetch, rerank, sinks):
    """The CUDA step's code path (custom ops, the attention and selection kernels, the sinks' launch, the
    transfer or re-ranking, interpreted) over a left-padded batch: the torch reference path's tokens."""
    from tests.helpers import setup
    model = tiny_model()
    g = torch.Generator().manual_seed(10)
    ids, starts = left_padded([torch.randint(0, 256, (n,), generator=g) for n in (90, 41, 66)])
    kw = dict(batch=3, max_seq_len=128, bits=1, group=16, residual=32, k=8, rerank=rerank, sinks=sinks, fetch=fetch)
    cfg = setup(model, "specache", **kw).config
    ref = tokens(model, cfg, ids, starts, 12)
    caches = setup_caches(model, cfg, 3, 128, row_start=starts)
    for c in caches:
        c.custom_ops = True
    p = caches.prefetcher
    p.async_ops, p.triton = True, True
    p._setup_async()
    got, _ = generate.generate(model, ids, generate.Decoding(12))
    assert got.tolist() == ref


def test_siblings_and_baselines_refuse_padding():
    model = tiny_model()
    for name in ("specache-1bit-zipcache", "kivi-2bit-zipcache", "quest-p16-k64", "infllm-p16-k64-r64-sink4-repr4"):
        with pytest.raises(ValueError, match="runs a batch of one prompt length only"):
            setup_caches(model, name, 2, 128, row_start=torch.tensor([0, 5]))
        setup_caches(model, name, 2, 128, row_start=torch.tensor([0, 0]))  # (equal lengths: no padding)
    with pytest.raises(ValueError, match="one start per row"):
        setup_caches(model, "full", 2, 128, row_start=torch.tensor([0, 5, 6]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 128\)"):
        setup_caches(model, "full", 2, 128, row_start=torch.tensor([0, 128]))


# ---- the default model, prompts of about 700, 1,100 and 1,500 tokens -----------------------------
@pytest.mark.full  # (make test-full: the slowest case, three prompts of the real model)
def test_the_default_model_decodes_each_row_as_its_prompt_alone():
    """SmolLM2-135M-Instruct (fp32), three essay prompts of 700, 1,084 and 1,468 tokens (paddings 768, 384, 0:
    multiples of 128, KIVI's residual window, and of SpeCache's 64), the full, KIVI 1-bit, SpeCache 1-bit and
    `--preset best` caches: each row's greedy tokens are its prompt's alone."""
    from model import load_model
    from tokenizer import load_tokenizer
    from tools.tasks import essay_ids
    ckpt = require_default_checkpoint()
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    ids = essay_ids(tok)
    prompts = [torch.tensor(ids[o:o + n]) for o, n in ((0, 700), (3000, 1084), (7000, 1468))]
    batch_ids, starts = left_padded(prompts)
    for cache in ("full", "kivi-1bit", "specache-1bit", "specache-1bit-best"):
        cfg = CacheConfig.from_name(cache)
        batch = tokens(model, cfg, batch_ids, starts, 8)
        assert batch == [tokens(model, cfg, p[None], None, 8)[0] for p in prompts], cache
