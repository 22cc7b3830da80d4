import triton
import triton.language as tl


@triton.jit
def _codes_dt(c, dt: tl.constexpr, MAGIC: tl.constexpr):
    """int32 codes -> dt. MAGIC: OR the code into the mantissa of 128.0 (bf16) / 1024.0 (fp16): 128+c."""
    if MAGIC:
        if dt == tl.bfloat16:
            return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return c.to(dt)


@triton.jit
def _codes_asm(b, shift, mask, magic, dt: tl.constexpr):
    """uint8 bytes (4 consecutive elements = one 32-bit word of one plane) -> 128+c (bf16) / 1024+c (fp16):
    shift, mask, and one prmt per 2 codes that writes each code under the magic exponent byte."""
    ASM: tl.constexpr = "{ .reg .b32 t; shr.b32 t, $2, $3; and.b32 t, t, $7; prmt.b32 $0, t, $11, 0x4140; prmt.b32 $1, t, $11, 0x4342; }"
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r", [b, shift, mask, magic], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r", [b, shift, mask, magic], dtype=tl.float16,
                                         is_pure=True, pack=4)


@triton.jit
def _exp(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, out, qk_scale, S, hi, D, M,
         BITS: tl.constexpr, GROUP_K: tl.constexpr, NGV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
         MAGIC: tl.constexpr, ASM: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    dt: tl.constexpr = q.dtype.element_ty
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = BLOCK_D // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    OFF: tl.constexpr = (128.0 if dt == tl.bfloat16 else 1024.0) if MAGIC else 0.0
    MR: tl.constexpr = BLOCK_M // NGV
    offs_r = tl.arange(0, BLOCK_M)
    m = offs_r % MR
    grp_r = offs_r // MR
    m_ok = m < M
    offs_c = tl.arange(0, BLOCK_D)
    chan = (offs_c % W) * PER + offs_c // W
    byte = offs_c % W
    shift = (offs_c // W) * BITS
    qt = tl.load(q + (bh * M + m[:, None]) * D + chan[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, hi, GROUP_K):
        offs_n = n0 + tl.arange(0, GROUP_K)
        n_ok = offs_n < hi
        rows = bh * S + offs_n
        grp = bh * (S // GROUP_K) + n0 // GROUP_K
        sk = tl.load(k_scale + grp * D + chan).to(tl.float32)
        zk = tl.load(k_zero + grp * D + chan).to(tl.float32)
        qs = (qt * sk[None, :]).to(dt)
        kb = tl.load(k_codes + rows[None, :] * W + byte[:, None], mask=n_ok[None, :], other=0)
        if ASM:
            kc = _codes_asm(kb, tl.broadcast_to(shift[:, None], (BLOCK_D, GROUP_K)), tl.full((BLOCK_D, GROUP_K), MASK * 16843009, tl.int32), tl.full((BLOCK_D, GROUP_K), 67 if dt == tl.bfloat16 else 100, tl.int32), dt)
        else:
            kc = _codes_dt((kb.to(tl.int32) >> shift[:, None]) & MASK, dt, MAGIC)
        s = tl.dot(qs, kc) + tl.sum(qt * zk[None, :] - OFF * qs.to(tl.float32), 1)[:, None]
        s = tl.where(n_ok[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        vb = tl.load(v_codes + rows[:, None] * W + byte[None, :], mask=n_ok[:, None], other=0)
        if ASM:
            vc = _codes_asm(vb, tl.broadcast_to(shift[None, :], (GROUP_K, BLOCK_D)), tl.full((GROUP_K, BLOCK_D), MASK * 16843009, tl.int32), tl.full((GROUP_K, BLOCK_D), 67 if dt == tl.bfloat16 else 100, tl.int32), dt)
        else:
            vc = _codes_dt((vb.to(tl.int32) >> shift[None, :]) & MASK, dt, MAGIC)
        sv = tl.zeros([BLOCK_M, GROUP_K], tl.float32)
        zv = tl.zeros([BLOCK_M, GROUP_K], tl.float32)
        for g in tl.static_range(NGV):
            sv = tl.where((grp_r == g)[:, None], tl.load(v_scale + rows * NGV + g, mask=n_ok, other=0.0).to(tl.float32)[None, :], sv)
            zv = tl.where((grp_r == g)[:, None], tl.load(v_zero + rows * NGV + g, mask=n_ok, other=0.0).to(tl.float32)[None, :], zv)
        ps = (p * sv).to(dt)
        acc += tl.dot(ps, vc) + tl.sum(p * zv - OFF * ps.to(tl.float32), 1)[:, None]
    res = tl.where((grp_r[:, None] == chan[None, :] // (D // NGV)), acc / l_i[:, None], 0.0)
    res = tl.sum(tl.reshape(res, (NGV, MR, BLOCK_D)), 0)
    mm = tl.arange(0, MR)
    tl.store(out + (bh * M + mm[:, None]) * D + ((tl.arange(0, BLOCK_D) % W) * PER + tl.arange(0, BLOCK_D) // W)[None, :],
             res, mask=(mm < M)[:, None])
