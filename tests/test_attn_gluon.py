"""attn_gluon.py without a GPU: Gluon kernels do not run under the interpreter, so these tests check
the arithmetic the kernel is built on - the lop3 codes (OFF + c * 2^sigma, exact for every code of every
plane) and a torch model of one program's key logits and value sums in the kernel's order of operations
- against kernels.py's references. tests/test_cuda.py runs the kernel itself on a GPU (planes=True)."""
import pytest
import torch

from gpu import attn_gluon
from tests.test_kernels import make_case


def lop3_codes(byte: torch.Tensor, bits: int, j: int, dtype) -> torch.Tensor:
    """What the kernel's _codes makes of code bytes for plane j: ((b >> shift) & mask << sigma) | MAGIC, as dtype."""
    shift, at, _, magic, _ = attn_gluon.plane_constants(bits, dtype)[j]
    w = (byte.to(torch.int32) >> shift) & (((1 << bits) - 1) << at) | magic
    return w.to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_plane_codes_are_exact_for_every_code_and_plane(bits, dtype):
    byte = torch.arange(256, dtype=torch.uint8)  # every code in every plane, with every neighbour
    for j, (_, _, sigma, _, off) in enumerate(attn_gluon.plane_constants(bits, dtype)):
        code = (byte.to(torch.int32) >> (j * bits)) & ((1 << bits) - 1)
        got = lop3_codes(byte, bits, j, dtype).double()
        assert torch.equal(got, off + code.double() * 2.0 ** sigma), (bits, dtype, j)


def plane_columns(D, bits):
    """Plane-major column c -> (natural channel, plane): channel i*PER + j of byte i, plane j."""
    per, W = 8 // bits, D * bits // 8
    c = torch.arange(D)
    return (c % W) * per + c // W, c // W


def model_logits(qg, store, dtype):
    """The kernel's key logits (before the softmax scale) of query rows qg [M, D] over kv head (0, 0)."""
    D, bits, gk = qg.shape[-1], store.bits, store.group_k
    ch, plane = plane_columns(D, bits)
    consts = attn_gluon.plane_constants(bits, dtype)
    sig = torch.tensor([consts[int(p)][2] for p in plane], dtype=torch.float64)
    off = torch.tensor([consts[int(p)][4] for p in plane], dtype=torch.float64)
    W = D * bits // 8
    out = []
    for g in range(store.k_codes.shape[2] // gk):
        byte = store.k_codes[0, 0, g * gk:(g + 1) * gk, :W].long()[:, ch // (8 // bits)]  # [gk, D] per column
        kval = torch.stack([lop3_codes(byte[:, c], bits, int(plane[c]), dtype) for c in range(D)], 1).double()
        qs = (qg[:, ch] * store.k_scale[0, 0, g, ch].float() * (2.0 ** -sig).float()).to(dtype).double()  # one rounding
        zt = qg[:, ch].double() @ store.k_zero[0, 0, g, ch].double() - qs @ off
        out.append(qs @ kval.T + zt[:, None])
    return torch.cat(out, 1)


def model_values(p, store, dtype):
    """The kernel's sum_n p[m, n] v'_n [M, D] (value groups as swapped dots, codes OFF + c * 2^sigma)."""
    bits = store.bits
    D = store.v_codes.shape[-1] * 8 // bits
    per, W = 8 // bits, D * bits // 8
    ngv = D // min(store.group_v, D)
    dg, wg = D // ngv, W // ngv
    consts = attn_gluon.plane_constants(bits, dtype)
    out = torch.zeros(p.shape[0], D, dtype=torch.float64)
    n = p.shape[1]
    for g in range(ngv):
        e = torch.arange(dg)
        ch = g * dg + (e % wg) * per + e // wg
        plane = e // wg
        byte = store.v_codes[0, 0, :n, :W].long()[:, g * wg + e % wg]  # [n, dg]
        vval = torch.stack([lop3_codes(byte[:, i], bits, int(plane[i]), dtype) for i in range(dg)], 1).double()
        sig = torch.tensor([consts[int(x)][2] for x in plane], dtype=torch.float64)
        off = torch.tensor([consts[int(x)][4] for x in plane], dtype=torch.float64)
        ps = (p * store.v_scale[0, 0, :n, g].float()).to(dtype).double()
        acc = vval.T @ ps.T + (2.0 ** sig)[:, None] * (p.double() @ store.v_zero[0, 0, :n, g].double())[None, :] \
            - off[:, None] * ps.sum(1)[None, :]
        out[:, ch] = (acc / (2.0 ** sig)[:, None]).T
    return out


@pytest.mark.parametrize("D,bits,gv", [(128, 1, 64), (128, 2, 64), (128, 4, 32), (64, 1, 64), (64, 2, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_arithmetic_matches_the_references(D, bits, gv, dtype):
    c = make_case(D=D, bits=bits, gk=64, gv=gv, S=128, n_quant=128, dtype=dtype)
    head = {f: getattr(c.store, f)[:, :1] for f in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")}
    c = c._replace(store=c.store._replace(**head))  # kv head 0
    M = 6
    qg = c.q[0, :3].float().reshape(M, D)  # kv head 0's query rows
    # the same products rounded once to the model's dtype, everything else exact: what the kernel computes
    codes = c.store.codes("k")[0, 0].double()  # [S, D] natural order
    gk = c.store.group_k
    rounded = torch.cat([(qg * c.store.k_scale[0, 0, g].float()).to(dtype).double() @ codes[g * gk:(g + 1) * gk].T
                         + (qg.double() @ c.store.k_zero[0, 0, g].double())[:, None] for g in range(128 // gk)], 1)
    got = model_logits(qg, c.store, dtype)
    torch.testing.assert_close(got, rounded, atol=1e-6, rtol=1e-6)
    want = c.store.key_logits(qg[None, None])[0, 0]  # and the fp32 reference, within the dtype's rounding
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=0)
    p = torch.softmax(want, -1)
    vcodes = c.store.codes("v")[0, 0].double()
    ngv, dg = D // min(gv, D), min(gv, D)
    rounded_v = torch.cat([(p * c.store.v_scale[0, 0, :, g].float()).to(dtype).double() @ vcodes[:, g * dg:(g + 1) * dg]
                           + (p.double() @ c.store.v_zero[0, 0, :, g].double())[:, None] for g in range(ngv)], 1)
    torch.testing.assert_close(model_values(p, c.store, dtype), rounded_v, atol=1e-6, rtol=1e-6)


def model_rounding_error(c) -> float:
    """How far the kernel's arithmetic (the models above: q * scale and p * scale each rounded once to
    the 16-bit dtype) moves attention over the quantized slots alone from exact arithmetic, the largest
    over every output element of the case: the part of the kernel's error that is by design."""
    B, Hkv, D, n = c.q.shape[0], c.store.k_codes.shape[1], c.q.shape[-1], int(c.store.n_quant.max())
    G, T = c.q.shape[1] // Hkv, c.q.shape[2]
    worst = 0.0
    for b in range(B):
        for h in range(Hkv):
            st = c.store._replace(**{f: getattr(c.store, f)[b:b + 1, h:h + 1] for f in
                                     ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")})
            qg = c.q[b, h * G:(h + 1) * G].float().reshape(G * T, D)
            keep = torch.arange(st.k_codes.shape[2]) < n
            exact = torch.where(keep, st.key_logits(qg[None, None])[0, 0], float("-inf"))
            p_exact = torch.softmax(exact * c.sm_scale, -1)
            p_model = torch.softmax(model_logits(qg, st, c.q.dtype)[:, :n] * c.sm_scale, -1)
            out = st.value_sum(p_exact[None, None], keep[None, None])[0, 0]
            worst = max(worst, (model_values(p_model.float(), st, c.q.dtype) - out).abs().max().item())
    return worst


def test_the_rounding_error_by_design_is_small_but_not_zero():
    """bf16 with 8x outlier key channels (logits up to ~11 after scaling): the one rounding of q * scale
    moves the output by a few hundredths (tests/test_cuda.py allows the GPU kernel this much more)."""
    c = make_case(G=8, T=2, bits=2, gk=64, gv=64, D=128, fetch=4, n_quant=192, dtype=torch.bfloat16)
    err = model_rounding_error(c)
    assert 0.02 < err < 0.08, err
    c16 = make_case(G=8, T=2, bits=2, gk=64, gv=64, D=128, fetch=4, n_quant=192, dtype=torch.float16)
    assert model_rounding_error(c16) < err / 4  # fp16 keeps 3 more mantissa bits
