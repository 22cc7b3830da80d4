"""The bit-plane attention over the quantized slots, written in Gluon (Triton's language with explicit
layouts) so that no operand goes through shared memory and each warp owns whole key groups.

Its torch reference is kernels.attention_lowbit_ref (key_logits / value_sum); it computes the same
partials as gpu/attention.py's _attn_words_kernel programs split < n_splits, and that module's launcher runs it
in their place where `fits` holds (docs/kernels.md: its static cost, and what is not yet verified).
Gluon does not run under TRITON_INTERPRET=1: there the Triton plane path stands in, and
tests/test_kernels.py checks this kernel's arithmetic with a torch model of it (`plane_constants`).

What is different from the Triton plane path, and why:
  - each warp takes its own key group (a batch dimension of NW warps): P stays in the registers of
    the MMA that made it, the key group's scale and zero are one warp's work, and the warps' partial
    softmax states are combined once, after the loop;
  - code bytes are loaded once per tile in a layout whose reshape is the MMA operand's layout, and
    each bit plane's 16-bit codes are made by one lop3 per two codes: (bytes & plane mask) | MAGIC_j,
    OFF_j + c * 2^sigma_j (the plane's bits stay where they are; `plane_constants` says how);
  - the values' dot is swapped (channels are the MMA's M, query rows its N = 8), one per channel
    group, so a value group's per-token scale folds into that dot's B operand;
  - the keys' zero term and the codes' offset come from two small MMAs (N = 8) instead of reductions.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

GLUON_BITS = (1, 2, 4)


def plane_constants(bits: int, dtype) -> list[tuple[int, int, int, int, float]]:
    """Per bit plane j (the code at bits pos = j*bits of its byte): (shift, at, sigma, MAGIC, OFF) such that
    ((byte >> shift) & (2^bits - 1) << at) | MAGIC, read as dtype, is exactly OFF + code * 2^sigma.
    bf16 (7 mantissa bits): MAGIC 128.0 and the code kept in place (sigma = pos) while it fits the
    mantissa; a 1-bit code at bit 7 sets the exponent's lowest bit, 128 -> 256 = 128 + 128 * 1, also
    exact; wider codes reaching bit 7 are shifted down by one first. fp16 (10 mantissa bits): the
    exponent chosen per plane so that the code's lowest bit is worth 1 (OFF = 2^(10 - pos), sigma 0)."""
    out = []
    for j in range(8 // bits):
        pos = j * bits
        if dtype == torch.bfloat16:
            shift = max(0, pos + bits - 7) if bits > 1 else 0
            out.append((shift, pos - shift, pos - shift, 0x4300, 128.0))
        else:
            out.append((0, pos, 0, (25 - pos) << 10, float(2 ** (10 - pos))))
    return out


def fits(store, D: int, M: int, dtype) -> bool:
    """Whether this kernel takes the layout: plain KIVI codes of 1/2/4 bits in a 16-bit model, D a power of
    two of at least 32 with whole 32-bit code words per row, at most 4 value groups, at most 16 query
    rows per kv head, key groups of 32 or 64 tokens."""
    NGV = D // min(store.group_v, D)
    return (dtype in (torch.float16, torch.bfloat16) and store.bits in GLUON_BITS
            and D & (D - 1) == 0 and D >= 32 and (D * store.bits) % 32 == 0
            and NGV in (1, 2, 4) and M <= 16 and store.group_k in (32, 64))


@gluon.jit
def _idx3(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, L: gl.constexpr):
    """Index tensors [n0,1,1], [1,n1,1], [1,1,n2] of the rank-3 layout L."""
    a = gl.expand_dims(gl.expand_dims(gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, L))), 1), 2)
    b = gl.expand_dims(gl.expand_dims(gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, L))), 0), 2)
    c = gl.expand_dims(gl.expand_dims(gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L))), 0), 1)
    return a, b, c


@gluon.jit
def _nat5(n0: gl.constexpr, n1: gl.constexpr, n2: gl.constexpr, n3: gl.constexpr, n4: gl.constexpr, L: gl.constexpr,
          DH: gl.constexpr, DR: gl.constexpr, DJ: gl.constexpr):
    """int32 offsets (RB*h + r) * PER + j of a rank-5 index space of layout L: h, r, j are dims DH, DR, DJ
    (natural channel of plane j of byte RB*h + r, RB the size of dim DR); the other two dims are broadcast."""
    i0 = gl.arange(0, n0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
    i1 = gl.arange(0, n1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
    i2 = gl.arange(0, n2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
    i3 = gl.arange(0, n3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, L)))))
    i4 = gl.arange(0, n4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L)))))
    e0 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i0, 1), 2), 3), 4)
    e1 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i1, 0), 2), 3), 4)
    e2 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i2, 0), 1), 3), 4)
    e3 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i3, 0), 1), 2), 4)
    e4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(i4, 0), 1), 2), 3)
    idx = (e0, e1, e2, e3, e4)
    per = (n0, n1, n2, n3, n4)[DJ]
    rb = (n0, n1, n2, n3, n4)[DR]
    return ((rb * idx[DH] + idx[DR]) * per + idx[DJ]).to(gl.int32)


@gluon.jit
def _grp(x4, g: gl.constexpr, NGV: gl.constexpr, MMA: gl.constexpr):
    """Group g of the [NW, 1, N, NGV] per-token scales -> [NW, 1, N] fp32 in the MMA result's layout."""
    if NGV == 1:
        x = gl.reshape(x4, [x4.shape[0], 1, x4.shape[2]])
    elif NGV == 2:
        a, b = gl.split(x4)
        x = a if g == 0 else b
    else:
        lo, hi = gl.split(gl.reshape(x4, [x4.shape[0], 1, x4.shape[2], 2, 2]))  # (g = 2 * g1 + g0: split g0)
        a, b = gl.split(lo if g % 2 == 0 else hi)
        x = a if g // 2 == 0 else b
    return gl.convert_layout(x.to(gl.float32), MMA)


@gluon.jit
def _plane_idx(PER: gl.constexpr, L4: gl.constexpr):
    """[1, PER, 1, 1] plane index in the rank-4 layout L4."""
    p = gl.arange(0, PER, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(p, 0), 2), 3)


@gluon.jit
def _consts(plane, BITS: gl.constexpr, BF16: gl.constexpr):
    """plane_constants in Gluon: (shift, at, sigma, MAGIC) int32 and OFF fp32 tensors of plane's shape."""
    pos = plane * BITS
    if BF16:
        if BITS > 1:
            shift = gl.maximum(pos + BITS - 7, 0)
        else:
            shift = pos * 0
        at = pos - shift
        sigma = at
        magic = pos * 0 + 0x4300
        off = (pos * 0).to(gl.float32) + 128.0
    else:
        shift = pos * 0
        at = pos
        sigma = pos * 0
        magic = (25 - pos) << 10
        off = gl.exp2((10 - pos).to(gl.float32))
    return shift, at, sigma, magic, off


@gluon.jit
def _codes(w, shift, mask, magic, dt: gl.constexpr):
    """16-bit words (zero-extended code bytes), per element shift/mask/MAGIC -> dt codes OFF + c * 2^sigma:
    ((w >> shift) & mask) | MAGIC, one lop3 per two codes (the shift is 0 in all but one plane, if any)."""
    ASM: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, $2; lop3.b32 $0, t, $4, $5, 0xea; }"
    CON: gl.constexpr = "=r,r,r,r,r,r"  # out pair; w pair, two shifts (32-bit), mask pair, MAGIC pair
    if dt == gl.bfloat16:
        return gl.inline_asm_elementwise(ASM, CON, [w, shift, mask, magic], dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise(ASM, CON, [w, shift, mask, magic], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _value_group(acc, p, ps_scale, zv, alpha_t, vbytes, V4: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr,
                 MMA: gl.constexpr, vshift, vmask, vmagic, voff_t, vpow_t, NW: gl.constexpr, PER: gl.constexpr,
                 WG: gl.constexpr, DG: gl.constexpr, N: gl.constexpr, dt: gl.constexpr):
    """One value channel group: acc^T[e, m] (rows: the group's channels in plane order) of
    2^sigma_e * sum_n p[m, n] (s_n c_ne + z_n), kept as sum_n ps (OFF_e + 2^sigma_e c) + 2^sigma_e p.z - OFF_e sum ps."""
    ps = (p * ps_scale).to(dt)  # [NW, M, N]
    zp = gl.convert_layout(gl.permute(gl.expand_dims(gl.sum(p * zv, 2), 2), [0, 2, 1]), MMA)  # [NW, 1, M]
    po = gl.convert_layout(gl.permute(gl.expand_dims(gl.sum(ps.to(gl.float32), 2), 2), [0, 2, 1]), MMA)
    w = gl.convert_layout(gl.reshape(gl.expand_dims(vbytes, 1) + gl.full([NW, PER, WG, N], 0, gl.int16, V4), [NW, DG, N]),
                          LA, assert_trivial=True)
    vc = _codes(w, vshift, vmask, vmagic, dt)
    return mma_v2(vc, gl.convert_layout(gl.permute(ps, [0, 2, 1]), LB), acc * alpha_t + (vpow_t * zp - voff_t * po))


@gluon.jit
def attn_planes_gluon(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, n_quant_ptr, row_start, f_idx, f_valid,
                       out_part, lse_part, logits, qk_scale, S, D, T, M, K, Hkv, SPLIT_LEN, NS,
                       BITS: gl.constexpr, GROUP_K: gl.constexpr, NGV: gl.constexpr, HAS_FETCH: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_K: gl.constexpr,
                       NW: gl.constexpr, SEL: gl.constexpr = 0):
    """Grid (B*Hkv, n_splits): program `split` attends to quantized slots [split*SPLIT_LEN, +SPLIT_LEN) below
    n_quant (SPLIT_LEN a multiple of NW*GROUP_K), warp w to key groups w, w + NW, ...; writes the
    (out, lse) partial `split` of the kv head's M query rows (of NS partials per kv head); SEL > 0: the last SEL
    tokens' scores of the quantized slots to `logits` (as tiles.store_logits, straight from the MMA's registers).
    row_start [B]: each row's first real slot (left padding: skipped by whole steps of NW groups, masked within)."""
    bh = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    dt: gl.constexpr = q.dtype.element_ty
    BF16: gl.constexpr = dt == gl.bfloat16
    N: gl.constexpr = GROUP_K
    PER: gl.constexpr = 8 // BITS
    W: gl.constexpr = BLOCK_D // PER
    DG: gl.constexpr = BLOCK_D // NGV
    WG: gl.constexpr = W // NGV
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    SL: gl.constexpr = gl.SliceLayout(2, MMA)
    # code tiles: bytes [NW, bytes, N] broadcast over the planes [NW, PER, bytes, N], whose reshape is the operand
    K4: gl.constexpr = gl.reshape(gl.full([NW, BLOCK_D, N], 0, gl.int16, LB), [NW, PER, W, N]).type.layout
    V4: gl.constexpr = gl.reshape(gl.full([NW, DG, N], 0, gl.int16, LA), [NW, PER, WG, N]).type.layout
    kw, kb, kn = _idx3(NW, W, N, gl.SliceLayout(1, K4))
    k_off = (kn * W + kb).to(gl.int32)
    vw, vb, vn = _idx3(NW, WG, N, gl.SliceLayout(1, V4))
    v_off = (vn * W + vb).to(gl.int32)
    kshift, kat, _, kmagic, _ = _consts(_plane_idx(PER, K4), BITS, BF16)
    z4 = gl.full([NW, PER, W, N], 0, gl.int32, K4)
    kshift = gl.convert_layout(gl.reshape(z4 + kshift, [NW, BLOCK_D, N]), LB, assert_trivial=True)
    kmask = gl.convert_layout(gl.reshape((z4 + ((1 << BITS) - 1 << kat)).to(gl.int16), [NW, BLOCK_D, N]), LB, assert_trivial=True)
    kmagic = gl.convert_layout(gl.reshape((z4 + kmagic).to(gl.int16), [NW, BLOCK_D, N]), LB, assert_trivial=True)
    vshift, vat, _, vmagic, _ = _consts(_plane_idx(PER, V4), BITS, BF16)
    z4 = gl.full([NW, PER, WG, N], 0, gl.int32, V4)
    vshift = gl.convert_layout(gl.reshape(z4 + vshift, [NW, DG, N]), LA, assert_trivial=True)
    vmask = gl.convert_layout(gl.reshape((z4 + ((1 << BITS) - 1 << vat)).to(gl.int16), [NW, DG, N]), LA, assert_trivial=True)
    vmagic = gl.convert_layout(gl.reshape((z4 + vmagic).to(gl.int16), [NW, DG, N]), LA, assert_trivial=True)
    # the query (plane-order columns), loaded once; the key scale is divided by 2^sigma of its column's plane
    aw, am, ac = _idx3(NW, BLOCK_M, BLOCK_D, LA)
    cha = ((ac % W) * PER + ac // W).to(gl.int32)
    qt = gl.load(q + (bh * M + am) * D + cha + aw * 0, mask=(am < M) & (aw >= 0), other=0.0)
    _, _, asig, _, _ = _consts(ac // W, BITS, BF16)
    sscale = gl.exp2(-asig.to(gl.float32))
    # key scale/zero: a thread's 4 code bytes' PER planes are PER consecutive channels (i*PER + j) for each of
    # the W/16 16-byte tiles: loaded as [NW, ., NH, 16, PER] vectors and reshaped to the operand layouts
    RB: gl.constexpr = 16 if W >= 16 else W  # bytes per 16-column slice (W < 16: a slice spans 16 / W planes)
    NH: gl.constexpr = W // RB
    SA: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, PER], [1, 8, 1, 4, 1], [NW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    SB: gl.constexpr = gl.BlockedLayout([1, 1, 2, PER, 1], [1, 1, 4, 1, 8], [NW, 1, 1, 1, 1], [3, 2, 1, 4, 0])
    sa_off = _nat5(NW, 1, NH, RB, PER, SA, 2, 3, 4)
    sb_off = _nat5(NW, NH, RB, PER, 1, SB, 1, 2, 3)
    zw, zc, z8 = _idx3(NW, BLOCK_D, 8, LB)
    _, _, _, _, zoff = _consts(zc // W + z8 * 0 + zw * 0, BITS, BF16)
    negoff = gl.where(z8 == 0, -zoff, 0.0).to(dt)  # [NW, D, 8]: -OFF of each column's plane, in column 0
    sw, sm, sn = _idx3(NW, BLOCK_M, N, MMA)
    # [NW, 1, N, NGV]: lanes and warps as the MMA's [NW, M, N] result, a token pair's NGV scales in registers
    VS: gl.constexpr = gl.BlockedLayout([1, 1, 2, NGV], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
    vsw = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, VS)))), 1), 2), 3)
    vsn = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, VS)))), 0), 1), 3)
    vsg = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, NGV, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, VS)))), 0), 1), 2)
    vs_off = (vsn * NGV + vsg).to(gl.int32)  # [1, 1, N, NGV]
    _, oe, _ = _idx3(NW, DG, BLOCK_M, MMA)
    _, _, osig, _, ooff = _consts(oe // WG, BITS, BF16)
    vpow = gl.exp2(osig.to(gl.float32))  # [1, DG, 1]
    if HAS_FETCH:  # fetched positions, for each warp's bit word of its group
        FL: gl.constexpr = gl.BlockedLayout([1, BLOCK_K // 32], [1, 32], [NW, 1], [1, 0])
        fk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, FL))
        fok = fk < K
        fidx = gl.load(f_idx + bh * K + fk, mask=fok, other=-1)
        fidx = gl.expand_dims(gl.where(gl.load(f_valid + bh * K + fk, mask=fok, other=0) != 0, fidx, -1), 0)  # [1, BLOCK_K]
        fw = gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, FL)), 1)  # [NW, 1]
    if SEL > 0:  # the kv head's logits, each query row's row in them (tiles.logits_rows) and which rows select
        lbase = logits + bh * (M // T) * SEL * S
        st = sm % T
        lrows = ((sm // T) * SEL + st - (T - SEL)) * S  # [1, BLOCK_M, 1] int32 (a pointer each would cost registers)
        lrows_ok = (sm < M) & (st >= T - SEL)
    lo = split * SPLIT_LEN
    hi = gl.minimum(gl.minimum(lo + SPLIT_LEN, gl.load(n_quant_ptr).to(gl.int32)), S)
    start = gl.load(row_start + bh // Hkv).to(gl.int32)
    lo += gl.maximum(start - lo, 0) // (NW * N) * (NW * N)
    m_i = gl.full([NW, BLOCK_M], -float("inf"), gl.float32, SL)
    l_i = gl.zeros([NW, BLOCK_M], gl.float32, SL)
    acc0 = gl.zeros([NW, DG, BLOCK_M], gl.float32, MMA)
    acc1 = gl.zeros([NW, DG, BLOCK_M], gl.float32, MMA)
    acc2 = gl.zeros([NW, DG, BLOCK_M], gl.float32, MMA)
    acc3 = gl.zeros([NW, DG, BLOCK_M], gl.float32, MMA)
    last = S // N - 1
    for n0 in range(lo, hi, NW * N):
        # warp w: key group n0 / N + w (its addresses clamped to the cache; tokens >= hi get no weight)
        grp = n0 // N
        kg = (bh * (S // N) + gl.minimum(grp + gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, SA))))), last)) * D
        kg = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(kg, 1), 2), 3), 4)
        sk = gl.convert_layout(gl.reshape(gl.permute(gl.load(k_scale + kg + sa_off), [0, 1, 4, 2, 3]), [NW, 1, BLOCK_D]), LA)
        if BF16:  # (the scales are stored in fp16: q * s_k exact in fp32, then one rounding)
            qs = (qt.to(gl.float32) * (sk.to(gl.float32) * sscale)).to(dt)
        else:  # fp16 x fp16: one rounding of the exact product, as above
            qs = qt * (sk * sscale.to(gl.float16))
        zg = (bh * (S // N) + gl.minimum(grp + gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, SB))))), last)) * D
        zg = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(zg, 1), 2), 3), 4)
        zk = gl.convert_layout(gl.reshape(gl.permute(gl.load(k_zero + zg + sb_off), [0, 3, 1, 2, 4]), [NW, BLOCK_D, 1]), LB)
        # B columns: z's dt part, (bf16) the rest of the fp16 zero (exact), zeros: q.z exactly in fp32
        z_hi = zk.to(dt)
        zb = gl.where(z8 == 0, z_hi + gl.zeros([NW, BLOCK_D, 8], dt, LB), gl.zeros([NW, BLOCK_D, 8], dt, LB))
        if BF16:
            zb = gl.where(z8 == 1, (zk.to(gl.float32) - z_hi.to(gl.float32)).to(dt), zb)
        zt = gl.sum(mma_v2(qt, zb, mma_v2(qs, negoff, gl.zeros([NW, BLOCK_M, 8], gl.float32, MMA))), 2)  # q.z - sum OFF q s
        krow = (bh * S + gl.minimum(n0 + kw * N, S - N)) * W  # [NW, 1, 1]: each warp's group, inside the cache
        kbytes = gl.load(k_codes + krow + k_off).to(gl.int16)
        kw16 = gl.convert_layout(gl.reshape(gl.expand_dims(kbytes, 1) + gl.full([NW, PER, W, N], 0, gl.int16, K4),
                                            [NW, BLOCK_D, N]), LB, assert_trivial=True)
        s = mma_v2(qs, _codes(kw16, kshift, kmask, kmagic, dt), gl.zeros([NW, BLOCK_M, N], gl.float32, MMA))
        s = (s + gl.expand_dims(zt, 2)) * qk_scale
        tok = n0 + sw * N + sn
        keep = (tok < hi) & (tok >= start)
        if HAS_FETCH:  # eq. 1: a fetched fp row replaces its quantized copy (one 64-bit word per warp)
            rel = fidx - (n0 + fw * N)
            hit = gl.where((rel >= 0) & (rel < N), gl.full(rel.shape, 1, gl.int64, FL) << rel.to(gl.int64), 0)
            word = gl.reduce(hit, 1, _or)  # [NW]
            word = gl.expand_dims(gl.expand_dims(gl.convert_layout(word, gl.SliceLayout(1, SL)), 1), 2)  # [NW, 1, 1]
            keep = keep & (((word >> sn.to(gl.int64)) & 1) == 0)
        if SEL > 0:  # the selecting rows' scores, for the selection after this attention (gpu/topk.py)
            gl.store(lbase + (lrows + tok), s, mask=keep & lrows_ok)
        s = gl.where(keep, s, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        l_i = l_i * alpha + gl.sum(p, 2)
        m_i = m_new
        alpha_t = gl.convert_layout(gl.permute(gl.expand_dims(alpha, 2), [0, 2, 1]), MMA)  # [NW, 1, M]
        # the values' per-token scales and zeros: all NGV groups of a thread's token pairs in one vector load each
        srow = (bh * S + gl.minimum(n0 + vsw * N, S - N)) * NGV  # [NW, 1, 1, 1]: each warp's group, inside the cache
        tok_ok = (n0 + vsw * N + vsn < hi) & (vsg >= 0)  # (garbage past n_quant may be NaN: never read)
        sv4 = gl.load(v_scale + srow + vs_off, mask=tok_ok, other=0.0)
        zv4 = gl.load(v_zero + srow + vs_off, mask=tok_ok, other=0.0)
        vbase = v_codes + (bh * S + gl.minimum(n0 + vw * N, S - N)) * W + v_off
        acc0 = _value_group(acc0, p, _grp(sv4, 0, NGV, MMA), _grp(zv4, 0, NGV, MMA), alpha_t,
                            gl.load(vbase).to(gl.int16), V4, LA, LB, MMA, vshift, vmask, vmagic, ooff, vpow, NW, PER, WG, DG, N, dt)
        if NGV > 1:
            acc1 = _value_group(acc1, p, _grp(sv4, 1, NGV, MMA), _grp(zv4, 1, NGV, MMA), alpha_t,
                                gl.load(vbase + WG).to(gl.int16), V4, LA, LB, MMA, vshift, vmask, vmagic, ooff, vpow, NW, PER, WG, DG, N, dt)
        if NGV > 2:
            acc2 = _value_group(acc2, p, _grp(sv4, 2, NGV, MMA), _grp(zv4, 2, NGV, MMA), alpha_t,
                                gl.load(vbase + 2 * WG).to(gl.int16), V4, LA, LB, MMA, vshift, vmask, vmagic, ooff, vpow, NW, PER, WG, DG, N, dt)
            acc3 = _value_group(acc3, p, _grp(sv4, 3, NGV, MMA), _grp(zv4, 3, NGV, MMA), alpha_t,
                                gl.load(vbase + 3 * WG).to(gl.int16), V4, LA, LB, MMA, vshift, vmask, vmagic, ooff, vpow, NW, PER, WG, DG, N, dt)
    # the warps' partial softmax states -> one partial (after the loop: reductions over warps)
    m_all = gl.max(m_i, 0)  # [M]
    m_safe = gl.where(m_all == -float("inf"), 0.0, m_all)
    wscale = gl.exp2(m_i - gl.expand_dims(m_safe, 0))  # [NW, M]
    l_all = gl.sum(l_i * wscale, 0)
    has = l_all > 0
    wscale_t = gl.convert_layout(gl.permute(gl.expand_dims(wscale, 2), [0, 2, 1]), MMA)  # [NW, 1, M]
    O2: gl.constexpr = gl.SliceLayout(0, MMA)  # [DG, M] after the sum over warps
    l_t = gl.expand_dims(gl.convert_layout(gl.where(has, l_all, 1.0), gl.SliceLayout(0, O2)), 0)  # [1, M]
    oe2 = gl.expand_dims(gl.arange(0, DG, layout=gl.SliceLayout(1, O2)), 1)  # [DG, 1]
    om2 = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, O2)), 0)  # [1, M]
    oc = (oe2 % WG) * PER + oe2 // WG  # channel within its group of each plane-order row
    o_ok = (om2 < M) & (oe2 >= 0)
    part = bh * NS + split
    for g in gl.static_range(NGV):
        if g == 0:
            a = acc0
        elif g == 1:
            a = acc1
        elif g == 2:
            a = acc2
        else:
            a = acc3
        res = gl.sum(a * (wscale_t / vpow), 0) / l_t  # [DG, M]
        ch = g * DG + oc
        gl.store(out_part + (part * M + om2) * D + ch, res, mask=o_ok)
    lse = gl.where(has, (m_all + gl.log2(gl.where(has, l_all, 1.0))) * 0.6931471805599453, -float("inf"))
    mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, SL))
    gl.store(lse_part + part * M + mm, lse, mask=mm < M)


@gluon.jit
def _or(a, b):
    return a | b


WARPS = 2  # each warp its own key group: more warps add groups in flight, not registers per thread
