"""The GPU checks (`pytest -m cuda`; `make gpu-check` runs them and the speed tables): the Triton
kernels on CUDA against the torch references, end-to-end exactness of every fetch policy and
transfer, CUDA vs CPU tokens, compiled (CUDA graph) == eager with one graph, and the default model
through generate.py --compile. Skipped without a CUDA device.

SPECACHE_CHECK_DEVICE=cpu runs the same checks on CPU (Triton interpreted, small sizes): a test of
the tests for machines without a GPU.
"""
import json
import os

import pytest
import torch

pytestmark = pytest.mark.cuda

DEVICE = os.environ.get("SPECACHE_CHECK_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("no CUDA device here", allow_module_level=True)
if ON_GPU and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    pytest.skip("TRITON_INTERPRET=1 is set: the GPU checks need compiled Triton (make gpu-check unsets it)",
                allow_module_level=True)

import kernels  # noqa: E402
import prefetch  # noqa: E402
from config import CacheConfig  # noqa: E402
from decoding import compiled_step  # noqa: E402
from generate import Decoding, decode_step, setup_caches  # noqa: E402
from gpu import attention, topk, transfer  # noqa: E402
from siblings import attn_views  # noqa: E402
from siblings.attn_views import ViewKV  # noqa: E402
from tests.helpers import DEFAULT_CKPT, run_generate, tiny_model  # noqa: E402
from tests.test_attn_gluon import model_rounding_error  # noqa: E402
from tests.test_kernels import (CASES, assert_same_selection, assert_same_topk, logits_written, make_case, rows, tol,  # noqa: E402
                                triton_attention)

DEV = torch.device(DEVICE)


def on(x, device=DEV, float_dtype=None):
    """A kernels tuple / tensor / None moved to device (dtype kept, or floats cast to float_dtype)."""
    if x is None or isinstance(x, (int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return x.to(device, float_dtype) if float_dtype is not None and x.is_floating_point() else x.to(device)
    if isinstance(x, dict):
        return {k: on(v, device, float_dtype) for k, v in x.items()}
    if type(x) in (tuple, list):
        return type(x)(on(v, device, float_dtype) for v in x)
    return type(x)(*(on(v, device, float_dtype) for v in x))  # a NamedTuple


def op_attention(q, store, residual, fetched, sm_scale):
    """The attention behind its custom op, as the decode step calls it (cache.LowBitCache.attend)."""
    if isinstance(store, ViewKV):
        return attn_views.attention_views(q, store, residual, fetched, sm_scale, use_op=True)
    return kernels.attention_op(q, *kernels.op_inputs(store, residual, fetched), sm_scale, "auto", 0)[:2]


# ---- kernels -------------------------------------------------------------------------------------
# attn_path None: the launcher's default (DEFAULT_ATTN_PATH: Gluon where the launch fits it, else words;
# the custom op as the decode step calls it on a GPU); "planes": the Triton bit-plane path wherever the layout
# allows it.
@pytest.mark.parametrize("attn_path", [None, "planes"])
@pytest.mark.parametrize("case", CASES)
def test_attention_kernel_matches_the_reference(case, attn_path):
    c = make_case(**CASES[case])
    view = isinstance(c.store, ViewKV)  # a sibling's store: its own kernel (attn_views), one path
    if attn_path and (view or not attention.planes_fit(c.store, c.q.shape[-1], rows(c))):
        pytest.skip("the bit-plane path does not take this layout")
    want = kernels.attention_lowbit_ref(*c.args())  # on CPU: the reference path
    if not ON_GPU:
        got = triton_attention(c, attn_path=attn_path)
    elif attn_path is None:  # the custom op, as the decode step calls it
        got = op_attention(on(c.q), on(c.store), on(c.residual), on(c.fetched), c.sm_scale)
    else:
        got = attention.attention_lowbit_triton(*on(c).args(), attn_path=attn_path)
    torch.testing.assert_close(got[0].cpu(), want[0], **tol(want[0].dtype, 1e-5))
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-5 if c.q.dtype == torch.float32 else 2e-2,
                               rtol=1e-5 if c.q.dtype == torch.float32 else 2e-2)


# The Gluon kernel of the plane path's quantized slots (attn_gluon.py): compiled 16-bit launches with
# attn_path="gluon" take it wherever attn_gluon.fits; it cannot run under the interpreter, hence GPU only.
GLUON_CASES = {
    "1bit-bf16-fetch": dict(G=4, T=2, bits=1, gk=64, gv=64, D=128, fetch=8, n_quant=192, dtype=torch.bfloat16),
    "2bit-fp16-fetch": dict(G=4, T=2, bits=2, gk=64, gv=64, D=128, fetch=8, n_quant=192, dtype=torch.float16),
    "4bit-bf16-gv32": dict(G=4, T=1, bits=4, gk=64, gv=32, D=128, n_quant=128, dtype=torch.bfloat16),
    "1bit-fp16-D64-gk32": dict(G=3, T=2, bits=1, gk=32, gv=64, D=64, fetch=8, n_quant=224, S=256, dtype=torch.float16),
    "2bit-bf16-G8-T2": dict(G=8, T=2, bits=2, gk=64, gv=64, D=128, fetch=4, n_quant=192, dtype=torch.bfloat16),
}


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("case", GLUON_CASES)
def test_gluon_plane_kernel_matches_the_reference(case):
    from gpu import attn_gluon
    c = make_case(**GLUON_CASES[case])
    M = c.q.shape[1] // c.store.k_codes.shape[1] * c.q.shape[2]
    assert attn_gluon.fits(c.store, c.q.shape[-1], M, c.q.dtype)
    want = kernels.attention_lowbit_ref(*c.args())
    got = attention.attention_lowbit_triton(*on(c).args(), attn_path="gluon")
    # the 16-bit tolerance plus what the kernel's own rounding (q * scale once to bf16/fp16) moves by
    # design: 0.048 in the bf16 G8-T2 case, which failed the bare tolerance on an H100 (2026-11-26)
    t = tol(want[0].dtype, 1e-5)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=t["atol"] + model_rounding_error(c), rtol=t["rtol"])
    torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-2, rtol=2e-2)


GLUON_STARTS = [0, 100, 210]  # a left-padded batch: no padding, a start inside a key group (of 64), one past n_quant


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("case", ["1bit-bf16-fetch", "2bit-fp16-fetch"])
def test_gluon_kernel_attends_from_each_rows_start(case):
    """The Gluon kernel (the CUDA default for 16-bit models) over a left-padded batch of three rows, whatever NaN
    their padding holds: the reference's output and lse, and its selecting logits wherever a row may select."""
    from gpu import attn_gluon
    from tests.test_ragged import ragged
    base = make_case(**{**GLUON_CASES[case], "B": 3})
    c = ragged(base, GLUON_STARTS)
    assert attn_gluon.fits(c.store, c.q.shape[-1], rows(c), c.q.dtype)
    want = kernels.attention_lowbit_ref(*c.args(), select=2)
    got = attention.attention_lowbit_triton(*on(c).args(), attn_path="gluon", select=2)
    assert torch.isfinite(got[0]).all()
    t = tol(want[0].dtype, 1e-5)
    # (the kernel's rounding by design, from the same codes without the padding's NaN)
    torch.testing.assert_close(got[0].cpu(), want[0], atol=t["atol"] + model_rounding_error(base), rtol=t["rtol"])
    torch.testing.assert_close(got[1].cpu(), want[1], atol=2e-2, rtol=2e-2)
    w = logits_written(c)
    real = torch.arange(c.store.k_codes.shape[2])[None, :] >= torch.tensor(GLUON_STARTS)[:, None]  # [B, S]
    for b in range(3):
        sel = w & real[b]
        torch.testing.assert_close(got[2][b][..., sel].cpu(), want[2][b][..., sel], atol=0.1, rtol=2e-2)


def llama_case(bits, S):
    """Llama-3.1-8B attention shapes: 8 kv heads of 4 query heads, head_dim 128, bf16, 64 fetched rows."""
    return make_case(B=1, Hkv=8, G=4, T=2, D=128, S=S, n_quant=S - 128, R=66, res_len=40, bits=bits, gk=64, gv=64,
                     fetch=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("attn_path", ["words", "planes", "gluon"])
@pytest.mark.parametrize("bits", [1, 2])
def test_attention_kernel_at_llama8b_shapes(bits, attn_path):
    """Every attention path at Llama-3.1-8B shapes, with the speculative token's logits for the selection."""
    if attn_path == "gluon" and not ON_GPU:
        pytest.skip("Gluon kernels run on a GPU only")
    S = 32768 if ON_GPU else 1024
    c = llama_case(bits, S)
    dc = on(c)
    want = kernels.attention_lowbit_ref(*dc.args(), select=1)  # the reference, on the same device
    got = attention.attention_lowbit_triton(*dc.args(), attn_path=attn_path, select=1)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1], want[1], atol=2e-3, rtol=2e-3)
    w = logits_written(c).to(DEV)
    finite = torch.isfinite(want[2][..., w])
    assert torch.equal(torch.isinf(got[2][..., w]), torch.isinf(want[2][..., w]))
    # logits in log2 units from bf16 keys: about 1 in 10^6 of the 2-bit ones is off by 0.05-0.07 (H200, 2026-11-28)
    torch.testing.assert_close(got[2][..., w][finite], want[2][..., w][finite], atol=0.1, rtol=2e-2)


@pytest.mark.parametrize("attn_path", [None, "planes", "gluon"])
@pytest.mark.parametrize("bits,S,dtype", [(2, 256, torch.float32), (1, 256, torch.float32), (1, None, torch.bfloat16)])
def test_fused_selection_matches_the_reference(bits, S, dtype, attn_path):
    """The attention's logits and the one-launch selection (with the ring's record) at up to 32k positions: the
    rows the separate top-k over the codes picks (near-ties aside), exactly the rows select_ref picks from the
    same logits, and the ring layout of prefetch.record_rows."""
    S = S or (32768 if ON_GPU else 1024)
    if attn_path == "gluon" and (not ON_GPU or dtype == torch.float32):
        pytest.skip("Gluon kernels take 16-bit launches on a GPU only")
    c = make_case(B=1, Hkv=8 if S > 256 else 2, G=4, T=1, D=128, S=S, n_quant=S - 64, R=66, res_len=40, bits=bits,
                  gk=64, gv=64, fetch=64, dtype=dtype)
    dc = on(c)
    if attn_path == "planes" and not attention.planes_fit(dc.store, 128, 4):
        pytest.skip("the bit-plane path does not take this layout")
    _, lse, logits = attention.attention_lowbit_triton(*dc.args(), attn_path=attn_path, select=1)
    Hkv = dc.store.k_codes.shape[1]
    ring = [torch.full((1, Hkv, 4 + 64), -1, device=DEV), torch.zeros(1, Hkv, 4 + 64, dtype=torch.bool, device=DEV)]
    want_ring = [t.clone() for t in ring]
    slot_rows = torch.empty(1, Hkv, 64, dtype=torch.long, device=DEV)
    got = topk.select_triton(logits, lse, dc.store.n_quant, 64, 4, record=(*ring, 4, slot_rows))
    want = kernels.select_ref(logits, lse, dc.store.n_quant, 64, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(slot_rows, prefetch.record_rows(*want, *want_ring, 4)) and torch.equal(ring[0], want_ring[0])
    # the reference in fp32 over the same (16-bit) values: a bf16 reference rounds the dequantized keys
    # and the logits to 8 bits, and at 32k positions near-ties around the k-th then swap (seen on an H100)
    c32 = on(c, float_dtype=torch.float32)
    score, pos = kernels.topk_lowbit_ref(c32.q[:, :, 0], lse[:, :, 0].float(), c32.store, S, c32.sm_scale, c32.fetched, 4)
    by_pos = torch.full_like(score, -1.0).scatter_reduce(-1, pos, score, "amax")
    assert_same_selection([x.cpu() for x in got], by_pos.cpu(), 64, rtol=1e-5 if dtype == torch.float32 else 2e-2)


def tied_logits(B, Hkv, G, S, seed):
    """Selection logits whose scores take 6 values (the G query heads of a kv head agree), so the k-th score
    ties with hundreds of positions across every slice."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([-40.0, -12.0, -6.0, -3.0, -1.0, 0.0])
    one = levels[torch.randint(0, 6, (B, Hkv, 1, S), generator=g)]
    return one.expand(B, Hkv, G, S).contiguous()


RACE_SHAPES = [(1, 8, 32768, 64), (4, 8, 32768, 64), (3, 5, 10007, 100), (64, 8, 32768, 64)] if ON_GPU else \
    [(1, 2, 3000, 16), (3, 5, 1001, 20)]
RACE_LAUNCHES = 200 if ON_GPU else 4


@pytest.mark.parametrize("B,Hkv,S,k", RACE_SHAPES)
def test_selection_race_across_launches_and_graph_replays(B, Hkv, S, k):
    """The sliced selection's programs share nothing but each head's ticket counter and candidates. Two inputs
    alternate, whose top-k differ and whose quantized lengths differ (one leaves slices dead, so stale
    candidates of the other would show), with exact ties across slices: RACE_LAUNCHES eager launches, then as
    many replays of one captured CUDA graph; after each, the rows equal select_ref's and those of another
    slice length, the ticket counters are zero and no launch recorded a fault."""
    G = 4
    lse = torch.zeros(B, Hkv * G, 1, device=DEV)
    inputs = [(on(tied_logits(B, Hkv, G, S, seed)), torch.tensor(nq, device=DEV))
              for seed, nq in ((0, S - 70), (1, S // 3 + 5))]
    length = topk.slices(S, k)[0]
    want = []
    for logits, nq in inputs:
        ref = kernels.select_ref(logits, lse, nq, k, first=4)
        other = topk.select_triton(logits, lse, nq, k, first=4, slice_len=max(16, length // 4))
        assert torch.equal(other[0], ref[0]) and torch.equal(other[1], ref[1])
        want.append(ref)
    assert not torch.equal(want[0][0], want[1][0])
    counters = topk.select_counters(B, Hkv, DEV)
    logits_in, nq_in = inputs[0][0].clone(), inputs[0][1].clone()
    out = (torch.empty(B, Hkv, k, dtype=torch.long, device=DEV), torch.empty(B, Hkv, k, dtype=torch.bool, device=DEV))

    def launch():
        topk.select_triton(logits_in, lse, nq_in, k, first=4, out=out, counters=counters)

    def check(i, how):
        idx, ok = want[i % 2]
        assert torch.equal(out[0], idx) and torch.equal(out[1], ok), f"{how} {i}: other rows than select_ref's"
        assert not counters.any(), f"{how} {i}: counters {counters.nonzero().tolist()[:4]} (tickets, faults)"

    for i in range(RACE_LAUNCHES):
        logits_in.copy_(inputs[i % 2][0])
        nq_in.copy_(inputs[i % 2][1])
        launch()
        check(i, "launch")
    if not ON_GPU:
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (the warm-up a capture needs, on a side stream)
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for i in range(RACE_LAUNCHES):
        logits_in.copy_(inputs[i % 2][0])
        nq_in.copy_(inputs[i % 2][1])
        graph.replay()
        torch.cuda.synchronize()
        check(i, "replay")


def write_random_checkpoint(out, n_layers=2, max_seq_len=4096):
    """A converted checkpoint of a small random Llama with a byte-level tokenizer (256 byte tokens, then
    tokenizer.py's Llama-3 specials): generate.py runs it where no real model is on disk."""
    import base64
    from dataclasses import asdict

    from safetensors.torch import save_file

    from model import ModelArgs, Transformer, random_weights
    (out / "tokenizer.model").write_bytes(b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256)))
    args = ModelArgs(name="random-small", dim=512, n_layers=n_layers, n_heads=8, n_kv_heads=2, vocab_size=512,
                     intermediate_size=1024, max_seq_len=max_seq_len, rope_theta=10000.0)
    with torch.device("meta"):
        model = Transformer(args)
    model = random_weights(model, "cpu", torch.float32, seed=0)
    with torch.no_grad():  # larger than random_weights' N(0, 0.02): peaked logits, so greedy tokens are no near-ties
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.06, generator=gen)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    cfg = {**asdict(args), "tokenizer": {"kind": "tiktoken", "file": "tokenizer.model", "bos_id": 256, "eos_ids": [511]}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_generate_compile_preset_fresh_process(tmp_path):
    """`generate.py --compile --preset best` in a fresh process (pre-decoding compiles first, under the resync
    policy: the first compiled call allocates from a CUDA graph's pool) gives the eager run's tokens, over a
    prompt long enough for several selection slices."""
    if not ON_GPU:
        pytest.skip("a compiled step on CUDA (on CPU the compiled path is tests/test_specache.py's)")
    import subprocess
    import sys
    ckpt = write_random_checkpoint(tmp_path)
    prompt = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(70))
    runs = []
    for extra in ([], ["--compile"]):
        cmd = [sys.executable, "generate.py", "--checkpoint", str(ckpt), "--preset", "best", "--prompt", prompt,
               "--dtype", "float32", "--max-new-tokens", "40", "--json", "--quiet", *extra]
        r = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                           text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "0"})
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0]["prompt_tokens"] > 3000 and len(runs[0]["tokens"]) == 40
    assert runs[1]["tokens"] == runs[0]["tokens"]


@pytest.mark.parametrize("with_new", [True, False])
def test_transfer_from_pinned_host_memory_is_exact(with_new):
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(2, 8, 4096, 128, generator=g).to(torch.bfloat16) for _ in range(2)]
    if ON_GPU:
        host = [h.pin_memory() for h in host]
    idx = torch.randint(0, 4096, (2, 8, 64), generator=g)
    idx[0, 0, 0] = 77
    new = [torch.randn(2, 8, 1, 128, generator=g).to(torch.bfloat16) for _ in range(2)] if with_new else [None, None]
    pos = torch.tensor(77) if with_new else None
    want_host = [h.clone() for h in host]
    want_ring = [torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16) for _ in range(2)]
    prefetch.transfer_rows_ref(*want_host, *want_ring, idx, *new, pos)
    ring = [torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    transfer.transfer_rows_triton(*host, *ring, on(idx), *on(tuple(new)), on(pos))
    if ON_GPU:
        torch.cuda.synchronize()
    for a, b in zip(ring + host, want_ring + want_host):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("R", [1, 2])
def test_rerank_from_pinned_host_memory_keeps_the_best_candidates(R):
    """Re-ranking's two launches at Llama-3.1-8B shapes (bf16; 8 kv heads of 4 query heads, R
    selecting tokens; 128 candidates for 64 slots after 4 sinks) reading pinned host memory: the
    reference's picks (near-ties may swap), each slot holding the key and value of the position it
    records (the token's from new_k/new_v), the token written to the host."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, G, S, D, C, K, off = 1, 8, 4, 4096, 128, 128, 64, 4
    host = [torch.randn(B, Hkv, S, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    cand = torch.stack([torch.randperm(S, generator=g)[:C] for _ in range(B * Hkv)]).view(B, Hkv, C)
    cand[0, 0, 3] = 77
    valid = torch.ones(B, Hkv, C, dtype=torch.bool)
    valid[0, 1, 40:], cand[0, 1, 40:] = False, 0  # 40 valid candidates for 64 slots
    q = torch.randn(B, Hkv * G, R, D, generator=g).to(torch.bfloat16)
    lse = torch.rand(B, Hkv * G, R, generator=g) + 3
    new = [torch.randn(B, Hkv, 1, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    new[0][0, 0, 0] = q[0, 0, 0]  # the token's candidate scores high: its copy must come from new_k/new_v
    pos, sm = torch.tensor(77), D ** -0.5
    keys = host[0].gather(2, cand[..., None].expand(-1, -1, -1, D))
    keys[0, 0, 3] = new[0][0, 0, 0]
    score = torch.where(valid, kernels.fp_row_scores(q, lse, keys, sm), -1.0)  # every candidate's exact score
    want = score.topk(K, dim=-1)
    fetch = [torch.zeros(B, Hkv, off + K, D, dtype=torch.bfloat16, device=DEV) for _ in range(2)] + \
            [torch.full((B, Hkv, off + K), -1, device=DEV), torch.zeros(B, Hkv, off + K, dtype=torch.bool, device=DEV)]
    pinned = [h.pin_memory() for h in host] if ON_GPU else [h.clone() for h in host]
    transfer.rerank_rows_triton(
        *pinned, *fetch, on(cand), on(valid), on(q), on(lse), sm, *on(tuple(new)), on(pos), ring_off=off)
    if ON_GPU:
        torch.cuda.synchronize()
    ring_k, ring_v, idx, ok = (t[:, :, off:].cpu() for t in fetch)
    assert torch.equal(pinned[0][:, :, 77], new[0][:, :, 0]) and torch.equal(pinned[1][:, :, 77], new[1][:, :, 0])
    # (candidate of each picked position: positions are distinct within a kv head)
    which = (idx[..., :, None] == cand[..., None, :]).float().argmax(-1)
    got_score = score.gather(-1, which)
    no_pick = lambda s, i: torch.where(s >= 0, i, 0)  # noqa: E731 (invalid candidates: index 0, as in topk_lowbit)
    assert_same_topk((got_score, no_pick(got_score, which)), (want.values, no_pick(*want)), rtol=1e-4)
    assert torch.equal(ok, got_score >= 0) and int(ok.sum()) == B * Hkv * K - 24
    for h, ring in zip(host, (ring_k, ring_v)):
        rows = h.gather(2, idx[..., None].expand(-1, -1, -1, D))
        rows[idx == 77] = (new[0] if ring is ring_k else new[1])[0, 0, 0]
        assert torch.equal(ring[ok], rows[ok])
    assert (idx == 77).sum() == 1


# ---- end to end: tiny random model ---------------------------------------------------------------
def run_tiny(cache: str, device, dtype=torch.float32, new=24, step_fn=decode_step, seed=3, logits=None):
    model = tiny_model().to(device=device, dtype=dtype)
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(seed)).to(device)
    cfg = CacheConfig.from_name(cache)
    setup_caches(model, cfg, 1, 150 + new + 2)

    def keep(step, lg, token, fed):
        if logits is not None:
            logits.append(lg.float().cpu())
    out, _ = run_generate(model, prompt, new, cfg, step_fn=step_fn, on_step=keep)
    return out.cpu()


EVERY_ROW = "-1bit-g16-r32-k512"


@pytest.mark.parametrize("policy", ["speculative", "sequential", "oracle"])
@pytest.mark.parametrize("impl", ["uva", "staged"])
def test_every_row_fetched_equals_the_full_cache_fp32(policy, impl):
    cfg = CacheConfig.from_name("specache" + EVERY_ROW, fetch=policy, fetch_impl=impl)
    assert torch.equal(run_tiny_cfg(cfg), run_tiny("full", DEV))


def run_tiny_cfg(cfg, device=DEV, dtype=torch.float32, new=24):
    model = tiny_model().to(device=device, dtype=dtype)
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(3)).to(device)
    setup_caches(model, cfg, 1, 150 + new + 2)
    return run_generate(model, prompt, new, cfg)[0].cpu()


def test_every_row_fetched_matches_the_full_cache_bf16_logits():
    """bf16 token sequences are chaotic (near-ties flip): compare the logits of the same fed tokens."""
    full, spec = [], []
    ref = run_tiny("full", DEV, torch.bfloat16, logits=full)
    run_tiny_teacher("specache" + EVERY_ROW, ref, spec)
    for a, b in zip(full, spec):
        torch.testing.assert_close(b, a, atol=0.15, rtol=0.05)


def run_tiny_teacher(cache, tokens, logits, dtype=torch.bfloat16):
    """The cache fed the given tokens (teacher forcing) -> logits of each real row."""
    model = tiny_model().to(device=DEV, dtype=dtype)
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(3)).to(DEV)
    cfg = CacheConfig.from_name(cache)
    setup_caches(model, cfg, 1, 150 + tokens.shape[1] + 2)

    def force(step, lg, token, fed):
        logits.append(lg.float().cpu())
        return tokens[:, step].to(DEV) if step < tokens.shape[1] else None
    run_generate(model, prompt, tokens.shape[1], cfg, on_step=force)


@pytest.mark.parametrize("name", ["specache-1bit-g16-r32-k8", "specache-2bit-zipcache-g16-r32-k8-s40-hi4",
                                  "specache-1bit-rr2-g16-r32-k8"])
def test_cuda_fp32_tokens_equal_the_cpu_reference_path(name):
    """SpeCache with 8 fetched rows (real misses, real selections), over KIVI 1-bit and over ZipCache
    mixed precision: same tokens on both paths."""
    assert torch.equal(run_tiny(name, DEV), run_tiny(name, torch.device("cpu")))


@pytest.mark.parametrize("cache", ["full", "kivi-1bit-g16-r32", "specache-1bit-g16-r32-k8",
                                   "kivi-2bit-zipcache-g16-r32-s40-hi4", "specache-1bit-rr2-g16-r32-k8",
                                   "specache-1bit-lsq-resync-g16-r32-k8-sink4",  # sinks: the H100 found a bug
                                   "specache-1bit-lsq-resync-rr2-g16-r32-k8-sink4"])  # the best preset's parts
def test_compiled_step_equals_eager_with_one_graph(cache):
    import torch._dynamo
    from torch._dynamo.utils import counters
    eager = run_tiny(cache, DEV)
    torch._dynamo.reset()
    counters.clear()
    compiled = run_tiny(cache, DEV, step_fn=compiled_step(DEV, decode_step))
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1
    if ON_GPU:  # a CUDA graph really was captured: nothing made inductor skip it
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("family,cache", [("llama", "specache-1bit-best"), ("gemma3", "kivi-1bit-g32-r32")])
def test_hf_adapter_compiled_step_equals_eager_with_one_graph(family, cache):
    """A transformers model through hf.py (hf_generate(compile=True)): the compiled step (a CUDA graph;
    the preset's pre-decoding too) gives the eager tokens, one graph per step function, none skipped."""
    from integrations import hf
    try:
        hf.check_transformers()
    except hf.HFError as e:  # (the GPU machine's image had 5.17 on 2026-11-28)
        pytest.skip(str(e))
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tests.test_hf import adapter, prompt, tiny, tiny_gemma3
    model, ids = (tiny("llama") if family == "llama" else tiny_gemma3()).to(DEV), prompt().to(DEV)
    eager = adapter(model, ids, cache)
    torch._dynamo.reset()
    counters.clear()
    assert adapter(model, ids, cache, compile=True) == eager
    assert counters["stats"]["unique_graphs"] == (2 if CacheConfig.from_name(cache).policy.resync else 1)
    if ON_GPU:
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


# ---- the default model through the CLI -------------------------------------------------------------
@pytest.mark.parametrize("cache", ["full", "kivi", "specache", "best"])  # best: `--preset best`
def test_default_model_generate_compile(cache, capsys):
    if not (DEFAULT_CKPT / "config.json").exists():
        pytest.skip(f"default model not converted at {DEFAULT_CKPT} (python convert_hf.py smollm2 --out ...)")
    if not ON_GPU:
        pytest.skip("the compiled 30-layer model is a GPU check (on CPU: tests/test_default_model.py, slow)")
    import torch._dynamo

    from generate import main
    torch._dynamo.reset()
    main(["--checkpoint", str(DEFAULT_CKPT), "--prompt", "What is the capital of France?", "--chat", "--compile",
          *(["--preset", "best"] if cache == "best" else ["--cache", cache]),
          "--max-new-tokens", "24", "--json", "--quiet"])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["tokens"] and "Paris" in r["text"], r["text"]


# ---- QuantSpec ------------------------------------------------------------------------------------
def test_int4_linear_runs_the_aten_kernel_and_matches_the_reference():
    from siblings import quantspec
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).to(DEV)
    lin = quantspec.Int4Linear(w, 32)
    assert lin.packed is not None, "the ATen int4 kernel refused the weights: the draft would run the slow reference"
    x = torch.randn(4, 512, generator=g).to(DEV)
    got, want = lin(x).float().cpu(), lin.reference(x).float().cpu()
    assert (got - want).norm() / want.norm() < 1e-2  # bf16 activations in the kernel


def test_quantspec_compiled_rounds_equal_target_decoding():
    """Greedy QuantSpec with compiled draft/verify/commit steps (CUDA graphs) gives the target's own
    tokens (gamma 0, eager), over many rounds with rollbacks and INT8 flushes."""
    import torch._dynamo

    from siblings import quantspec
    model = tiny_model(n_layers=2, max_seq_len=512).to(DEV)
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(5)).to(DEV)
    draft = quantspec.make_draft(model, 32)

    def run(gamma, steps=quantspec.Steps()):
        quantspec.setup_caches(model, CacheConfig.from_name("quantspec-g16"), 1, 260, gamma=max(gamma, 1))
        quantspec.share_caches(draft, model)
        return quantspec.generate_quantspec(model, draft, prompt, gamma, Decoding(90), steps)[0].cpu()

    eager = run(0)
    torch._dynamo.reset()
    assert torch.equal(run(3, quantspec.Steps().compiled(DEV)), eager)
