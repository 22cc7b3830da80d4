"""quant.py: bit packing, KIVI eq. 2 / improved 1-bit eq. 3, ZipCache eq. 6, QuantSpec hierarchical INT8."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import quant
from siblings import quantspec, zipcache

META = [torch.float16, torch.bfloat16, torch.float32]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def keys_like_smollm2(B=1, H=3, T=128, D=64, seed=0):
    """Key statistics with a few heavy outlier channels (large |mean| and spread), as seen in
    SmolLM2/LLaMA keys; values have milder outlier channels."""
    g = seeded(seed)
    scale = torch.ones(D)
    scale[torch.randperm(D, generator=g)[:4]] = 20.0
    offset = torch.zeros(D)
    offset[torch.randperm(D, generator=g)[:4]] = 8.0
    return torch.randn(B, H, T, D, generator=g) * scale + offset


def expand_meta(meta, group, along, T, D):
    """[.., T//g, D] or [.., T, D//g] -> per element [.., T, D]."""
    return meta.float().repeat_interleave(group, dim=2 if along == "keys" else 3)


def roundtrip(x, bits, group, along, **kw):
    if along == "keys":
        c, s, z = quant.quantize_keys(x, bits, group, **kw)
        return c, s, z, quant.dequantize_keys(c, s, z, bits, group)
    c, s, z = quant.quantize_values(x, bits, group, **kw)
    return c, s, z, quant.dequantize_values(c, s, z, bits, group)


def tolerance(x, meta_dtype):
    """Rounding of the stored scale/zero to meta_dtype can push a group end a few ulps outside
    the representable range; bound that by a few ulps of the data magnitude."""
    return 4 * torch.finfo(meta_dtype).eps * x.abs().amax() + 1e-6


# ---- packing ---------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([1, 2, 4, 8]), lead=st.lists(st.integers(1, 4), max_size=3),
       n_bytes=st.integers(1, 17), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip(bits, lead, n_bytes, seed):
    n = n_bytes * 8 // bits
    codes = torch.randint(0, 2**bits, (*lead, n), generator=seeded(seed), dtype=torch.uint8)
    packed = quant.pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (*lead, n_bytes)
    assert torch.equal(quant.unpack_bits(packed, bits), codes)


def test_pack_layout_little_end_first():
    assert quant.pack_bits(torch.tensor([1, 0, 0, 0], dtype=torch.uint8), 2).item() == 0b00000001
    assert quant.pack_bits(torch.tensor([0, 3, 0, 0], dtype=torch.uint8), 2).item() == 0b00001100
    assert quant.pack_bits(torch.tensor([0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).item() == 0b10000000
    assert quant.pack_bits(torch.tensor([0x3, 0xA], dtype=torch.uint8), 4).item() == 0xA3


def test_pack_rejects_ragged():
    with pytest.raises(ValueError):
        quant.pack_bits(torch.zeros(3, dtype=torch.uint8), 2)


# ---- error bounds ----------------------------------------------------------------------------------
@pytest.mark.parametrize("meta_dtype", META)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("along", ["keys", "values"])
@pytest.mark.parametrize("data", ["randn", "smollm2"])
def test_error_bound_half_step(bits, along, meta_dtype, data):
    x = torch.randn(2, 3, 64, 64, generator=seeded(bits)) if data == "randn" else keys_like_smollm2()
    group = 32
    codes, s, z, xr = roundtrip(x, bits, group, along, meta_dtype=meta_dtype)
    assert codes.shape == (*x.shape[:3], x.shape[3] * bits // 8) and codes.dtype == torch.uint8
    meta_shape = (*x.shape[:2], x.shape[2] // group, x.shape[3]) if along == "keys" else (*x.shape[:3], 2)
    assert s.shape == z.shape == meta_shape and s.dtype == z.dtype == meta_dtype
    bound = expand_meta(s, group, along, *x.shape[2:]) / 2 + tolerance(x, meta_dtype)
    assert ((x - xr).abs() <= bound).all()


def test_improved_one_bit_is_half_range_midpoint():
    """eq. 3: x in [min, mid) -> (3min+max)/4, x in [mid, max] -> (min+3max)/4."""
    x = torch.randn(1, 2, 64, 32, generator=seeded(1))
    _, _, _, xr = roundtrip(x, 1, 32, "keys", meta_dtype=torch.float32)
    xg = x.reshape(1, 2, 2, 32, 32)
    lo, hi = xg.amin(3, keepdim=True), xg.amax(3, keepdim=True)
    mid = (lo + hi) / 2
    want = torch.where(xg >= mid, (lo + 3 * hi) / 4, (3 * lo + hi) / 4).reshape(x.shape)
    near_mid = ((xg - mid).abs() < 1e-5 * (hi - lo)).reshape(x.shape)  # fp ties may go either way
    assert torch.allclose(xr[~near_mid], want[~near_mid], atol=1e-6)


def test_kivi_one_bit_hits_min_and_max():
    """eq. 2 at 1 bit (the Table 5 ablation): every value becomes its group's min or max."""
    x = torch.randn(1, 1, 4, 64, generator=seeded(2))
    _, _, _, xr = roundtrip(x, 1, 64, "values", one_bit="kivi", meta_dtype=torch.float32)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    assert (torch.isclose(xr, lo.expand_as(xr)) | torch.isclose(xr, hi.expand_as(xr))).all()
    with pytest.raises(ValueError):
        quant.quantize_values(x, 1, 64, one_bit="nope")


@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("along", ["keys", "values"])
@pytest.mark.parametrize("data", ["randn", "smollm2"])
def test_lsq_fit_never_worse_than_range_per_group(bits, along, meta_dtype, data):
    """The refit starts from eq. 2/3 and each Lloyd step lowers the squared error: every group ends
    at or below its min/max error (up to the 16-bit rounding of zero/scale), and well below overall."""
    x = torch.randn(2, 3, 64, 64, generator=seeded(bits + 10)) if data == "randn" else keys_like_smollm2()
    group, dims = 32, (3,) if along == "keys" else (5,)
    per_group = lambda xr: ((x - xr) ** 2).reshape(*x.shape[:2], -1, 32, 2, 32).sum(dims)  # noqa: E731
    err = {fit: per_group(roundtrip(x, bits, group, along, meta_dtype=meta_dtype, fit=fit)[3]) for fit in quant.FITS}
    slack = 1e-5 if meta_dtype == torch.float32 else 2e-3
    assert (err["lsq"] <= err["range"] * (1 + slack) + 1e-6).all()
    assert err["lsq"].sum() < {1: 0.9, 2: 0.8, 4: 0.95}[bits] * err["range"].sum()


def test_lsq_one_bit_is_two_means():
    """At 1 bit the refit is Lloyd's 2-means per group: its levels are the means of the values coded
    0 and 1, and its error is within 3% of the best split of each sorted group (brute force)."""
    x = torch.randn(1, 2, 256, 32, generator=seeded(5))
    codes, s, z, xr = roundtrip(x, 1, 32, "keys", meta_dtype=torch.float32, fit="lsq")
    c = quant.unpack_bits(codes, 1).float().reshape(1, 2, 8, 32, 32)
    xg = x.reshape(1, 2, 8, 32, 32)
    xs = xg.transpose(-1, -2).sort(-1).values  # [.., channel, sorted tokens]
    best = torch.stack([sum(((p - p.mean(-1, keepdim=True)) ** 2).sum(-1) for p in (xs[..., :i], xs[..., i:]))
                        for i in range(1, 32)]).amin(0)
    got = ((x - xr) ** 2).reshape(1, 2, 8, 32, 32).sum(3)
    assert got.sum() <= 1.03 * best.sum() and (got >= best - 1e-4).all()
    # a fixed point of 2-means after 20 iterations: each level is the mean of its values
    lo, hi = xg.amin(3, keepdim=True), xg.amax(3, keepdim=True)
    codes20, s20, z20 = quant._lsq_refit(xg, 3, lo, hi, c, s.unsqueeze(3), z.unsqueeze(3), 1, torch.float32, iters=20)
    for code, level in ((0, z20), (1, z20 + s20)):
        mask = codes20 == code
        mean = (xg * mask).sum(3, keepdim=True) / mask.sum(3, keepdim=True).clamp_min(1)
        has = mask.any(3, keepdim=True)
        torch.testing.assert_close(level[has], mean[has], atol=1e-5, rtol=1e-5)


def test_lsq_one_bit_outlier_group():
    """Why eq. 3 loses at 1 bit: one outlier in a group puts both of its levels at a quarter of the
    range from the ends, far from all 31 other values. 2-means gives the outlier a level of its own
    and the bulk its mean."""
    x = torch.linspace(-1, 1, 32).reshape(1, 1, 32, 1).repeat(1, 1, 1, 8)
    x[0, 0, 7] = 40.0
    _, _, _, range_r = roundtrip(x, 1, 32, "keys", meta_dtype=torch.float32)
    _, _, _, lsq_r = roundtrip(x, 1, 32, "keys", meta_dtype=torch.float32, fit="lsq")
    rest = torch.arange(32) != 7
    assert (x - range_r)[0, 0, rest].abs().min() > 8  # every bulk value lands on (3 min + max) / 4 = 9.25
    assert (x - lsq_r)[0, 0, rest].abs().max() < 1.05 and (x - lsq_r)[0, 0, 7].abs().max() < 1e-4
    with pytest.raises(ValueError, match="fit must be one of"):
        quant.quantize_keys(x, 2, 32, fit="mse")


def test_lsq_keep_range_groups():
    """keep_range picks, per key group, eq. 2/3's codes and zero/scale over the refit's."""
    x = keys_like_smollm2(T=96)
    keep = torch.tensor([True, False, True])
    out = quant.quantize_keys(x, 2, 32, fit="lsq", keep_range=keep)
    ref = {fit: quant.quantize_keys(x, 2, 32, fit=fit) for fit in quant.FITS}
    for g in range(3):
        want = ref["range" if keep[g] else "lsq"]
        rows = slice(32 * g, 32 * (g + 1))
        assert torch.equal(out[0][:, :, rows], want[0][:, :, rows])
        assert torch.equal(out[1][:, :, g], want[1][:, :, g]) and torch.equal(out[2][:, :, g], want[2][:, :, g])
    assert not torch.equal(ref["range"][1], ref["lsq"][1])


def test_channelwise_keys_beat_tokenwise_on_outlier_channels():
    """Why KIVI quantizes keys per channel: outlier channels blow up per-token groups."""
    k = keys_like_smollm2()
    _, _, _, per_channel = roundtrip(k, 2, 32, "keys")
    _, _, _, per_token = roundtrip(k, 2, 64, "values")
    assert (k - per_channel).pow(2).mean() < 0.5 * (k - per_token).pow(2).mean()


@pytest.mark.parametrize("meta_dtype", META)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("along", ["keys", "values"])
@pytest.mark.parametrize("fit", ["range", "lsq"])
def test_degenerate_groups_never_nan(bits, along, meta_dtype, fit):
    x = torch.zeros(1, 2, 32, 32)
    x[0, 0, :, :] = 1.5  # constant groups
    x[0, 1, 0, 0], x[0, 1, 1, 1], x[0, 1, 2, 2], x[0, 1, 3, 3] = float("inf"), float("-inf"), float("nan"), 1e30
    kw = dict(meta_dtype=meta_dtype, fit=fit)
    outs = [roundtrip(x, bits, 32, along, **kw), roundtrip(torch.zeros(1, 1, 32, 32), bits, 32, along, **kw)]
    for _, s, z, xr in outs:
        assert torch.isfinite(xr).all() and torch.isfinite(s.float()).all() and torch.isfinite(z.float()).all()
    assert torch.equal(outs[1][3], torch.zeros(1, 1, 32, 32))  # zeros are exact
    assert torch.allclose(outs[0][3][0, 0], torch.full((32, 32), 1.5))  # constants are exact


def test_group_validation_and_value_group_clamp():
    with pytest.raises(ValueError, match="multiple of the token group"):
        quant.quantize_keys(torch.randn(1, 1, 40, 16), 2, 32)
    with pytest.raises(ValueError, match="multiple of the channel group"):
        quant.quantize_values(torch.randn(1, 1, 4, 48), 2, 32)
    v = torch.randn(1, 1, 4, 16)
    c, s, z = quant.quantize_values(v, 2, 128)  # group > D: one group per token
    assert s.shape == (1, 1, 4, 1)
    assert torch.equal(quant.dequantize_values(c, s, z, 2, 128), quant.dequantize_values(c, s, z, 2, 16))


# ---- ZipCache (eq. 6) ------------------------------------------------------------------------------
def test_zip_channel_scale_and_bound():
    v = keys_like_smollm2(seed=3)
    v[..., 5] = 0  # an all-zero channel must not divide by zero
    c = zipcache.channel_scale(v)
    assert c.shape == (1, 3, 64) and torch.isfinite(c.float()).all() and (c.float() > 0).all()
    want = v.abs().amax(2).sqrt()
    assert torch.allclose(c.float(), torch.where(want > 0, want, 1.0), rtol=1e-3)
    codes, s, z = zipcache.quantize_values_zip(v, 2, 64, c)
    vr = zipcache.dequantize_values_zip(codes, s, z, 2, 64, c)
    assert torch.isfinite(vr).all()
    # tokenwise bound in the normalized space, scaled back per channel
    v_norm = v / c.float()[..., None, :]
    bound = (s.float() / 2 + tolerance(v_norm, torch.float16)) * c.float()[..., None, :]
    assert ((v - vr).abs() <= bound).all()
    # channel normalization helps tokenwise quantization on outlier channels
    _, _, _, plain = roundtrip(v, 2, 64, "values")
    assert (v - vr).pow(2).mean() < (v - plain).pow(2).mean()


# ---- QuantSpec hierarchical INT8 = INT4 upper + INT4 lower -----------------------------------------
@pytest.mark.parametrize("along", ["keys", "values"])
def test_hierarchical_views(along):
    x = keys_like_smollm2(seed=4)
    group = 32
    qfn = quantspec.quantize_hier_keys if along == "keys" else quantspec.quantize_hier_values
    dqfn = quantspec.dequantize_hier_keys if along == "keys" else quantspec.dequantize_hier_values
    hi, lo, s4, z = qfn(x, group, meta_dtype=torch.float32)
    assert hi.shape == lo.shape == (*x.shape[:3], x.shape[3] // 2)
    # the 4-bit view is plain 4-bit asymmetric RTN with the same scale/zero
    c4, s4_ref, z_ref, x4_ref = roundtrip(x, 4, group, along, meta_dtype=torch.float32)
    assert torch.equal(hi, c4) and torch.equal(s4, s4_ref) and torch.equal(z, z_ref)
    x4 = dqfn(hi, lo, s4, z, group, view_bits=4)
    assert torch.equal(x4, x4_ref)
    x8 = dqfn(hi, lo, s4, z, group, view_bits=8)
    s8 = expand_meta(s4, group, along, *x.shape[2:]) / 16
    err8 = (x - x8).abs()
    lower = quant.unpack_bits(lo, 4).int() - 8
    clipped = lower == 7  # L = round(e / s8) can reach +8, stored clipped at 7
    assert (err8[~clipped] <= s8[~clipped] / 2 + 1e-5).all()
    assert (err8 <= s8 + 1e-5).all()
    assert err8.pow(2).mean() < (x - x4).pow(2).mean() / 100


# ---- accounting ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group", [(1, 32), (2, 64), (4, 32)])
@pytest.mark.parametrize("meta_dtype", [torch.float16, torch.float32])
def test_quantized_bytes_matches_buffers(bits, group, meta_dtype):
    T, D = 128, 64
    x = torch.randn(1, 1, T, D)
    for kind, fn in (("key", quant.quantize_keys), ("value", quant.quantize_values)):
        nbytes = sum(t.nbytes for t in fn(x, bits, group, meta_dtype=meta_dtype))
        assert quant.quantized_bytes(kind, bits, group, D, meta_dtype) * T == nbytes
    hier = sum(t.nbytes for t in quantspec.quantize_hier_keys(x, group, meta_dtype=meta_dtype))
    assert quant.quantized_bytes("key", 8, group, D, meta_dtype) * T == hier


def test_quantizers_trace_without_graph_breaks():
    """The cache quantizes inside its compiled decode step."""
    def step(k, v):
        kc, ks, kz = quant.quantize_keys(k, 2, 32)
        vc, vs, vz = quant.quantize_values(v, 1, 32)
        return quant.dequantize_keys(kc, ks, kz, 2, 32), quant.dequantize_values(vc, vs, vz, 1, 32)

    k, v = keys_like_smollm2(T=64), torch.randn(1, 3, 64, 64)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(k, v)
    for a, b in zip(got, step(k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [1, 2])
def test_compiled_least_squares_fit_stores_what_eager_stores(bits):
    """The fit picks codes against the 16-bit zero and scale it stores. Inductor drops a fused 16-bit
    round trip unless told to emulate eager's casts (decoding.compiled_step does): without that, a third
    of these groups got another zero, and the compiled preset's tokens left eager's."""
    from decoding import compiled_step
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 128, 64, generator=g) * 2 + torch.randn(1, 3, 1, 64, generator=g)

    def fit(x):
        return quant.quantize_codes(x, bits, 16, "tokens", fit="lsq")
    torch._dynamo.reset()
    got = compiled_step(torch.device("cpu"), fit)(x)
    for a, b in zip(got, fit(x)):
        assert torch.equal(a, b)
