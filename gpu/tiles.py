"""Triton building blocks of the decode kernels (gpu/attention.py, gpu/topk.py, and the siblings' attention kernel)
that read low-bit tiles: code tiles unpacked from 32-bit words or bytes (codes_tile), the key scores
and a key group's attention step on them, the bit-plane tiles of the attention kernel's plane path, fetched-row masks,
the online softmax and a program's partial. Their torch counterparts are quant.py's unpacking and kernels.py's
references; the kernels that use them are checked against those (tests/test_kernels.py)."""
import triton
import triton.language as tl

# log2(e): the kernels' scores are in log2 units (exp2); launchers scale by LOG2E.value
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def codes_tile(codes, rows, n_ok, offs_d, D, BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """KIVI's integer codes c of a [BLOCK_N, BLOCK_D] tile of rows `rows` (flat bh*S + n; n_ok: real
    rows), BITS bits each, from int32 words unpacked by shifts (WORDS) or from bytes."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if WORDS:
        PER: tl.constexpr = 32 // BITS
        N_WORDS: tl.constexpr = BLOCK_D // PER
        w = tl.load(codes + rows[:, None] * N_WORDS + tl.arange(0, N_WORDS)[None, :], mask=n_ok[:, None], other=0)
        c = tl.reshape((w[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & MASK, (BLOCK_N, BLOCK_D))
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = rows[:, None] * (D // PER_BYTE) + offs_d[None, :] // PER_BYTE
        ok = n_ok[:, None] & (offs_d < D)[None, :]
        c = (tl.load(codes + byte, mask=ok, other=0).to(tl.int32) >> ((offs_d % PER_BYTE) * BITS)[None, :]) & MASK
    return c


@triton.jit
def key_scores(qt, sk, zk, ck, dt: tl.constexpr, DOT: tl.constexpr):
    """q.k' of the query tile qt [BLOCK_M, BLOCK_D] (fp32, scaled) against a key group's integer codes
    ck [BLOCK_N, BLOCK_D] (codes_tile): the group's per-channel scale sk and zero zk fold
    into the query, q.k' = (q*s_k).c + q.z_k, so the dot runs on exact integer codes."""
    s = tl.dot((qt * sk[None, :]).to(dt), tl.trans(ck.to(dt)), input_precision=DOT)
    return s + tl.sum(qt * zk[None, :], 1)[:, None]


@triton.jit
def word_block(s, keep, cv, m_i, l_i, acc, v_scale, v_zero, rows, n_ok, offs_d, D, dt: tl.constexpr, NGV: tl.constexpr,
               DOT: tl.constexpr, UNITS: tl.constexpr = 1):
    """One key group of the attention on integer codes: the scores s where `keep` (-inf elsewhere) into
    the online softmax, then acc += sum_n p_n v'_n from the value codes cv [BLOCK_N, BLOCK_D], each channel
    group's per-token scale and zero folded into the probabilities, sum_n p_n (c_n s_n + z_n) =
    (p*s).c + sum_n p_n z_n. UNITS divides the stored value scales where the codes count finer steps."""
    s = tl.where(keep[None, :], s, -float("inf"))
    m_i, l_i, acc, p = online_softmax(s, m_i, l_i, acc)
    for j in tl.static_range(NGV):
        sv = tl.load(v_scale + rows * NGV + j, mask=n_ok, other=0.0).to(tl.float32)
        if UNITS != 1:
            sv = sv / UNITS
        zv = tl.load(v_zero + rows * NGV + j, mask=n_ok, other=0.0).to(tl.float32)
        part = tl.dot((p * sv[None, :]).to(dt), cv, input_precision=DOT) + tl.sum(p * zv[None, :], 1)[:, None]
        if NGV == 1:
            acc += part
        else:
            acc += tl.where((offs_d // (D // NGV) == j)[None, :], part, 0.0)
    return m_i, l_i, acc


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax's state before any score: (running max -inf, sum 0, accumulator 0)."""
    return (tl.full([BLOCK_M], -float("inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_D], tl.float32))


@triton.jit
def query_rows(q, bh, offs_m, m_ok, offs_d, d_ok, M, D, qk_scale):
    """The kv head's query rows offs_m (m = g*T + t) as an fp32 tile scaled to log2 units (exp2)."""
    qt = tl.load(q + (bh * M + offs_m[:, None]) * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    return qt.to(tl.float32) * qk_scale


@triton.jit
def fetched_positions(f_idx, f_valid, bh, K, BLOCK_K: tl.constexpr):
    """[BLOCK_K] the positions of the kv head's valid fetched rows, -1 for the others."""
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    fidx = tl.load(f_idx + bh * K + offs_k, mask=k_ok, other=-1)
    return tl.where(tl.load(f_valid + bh * K + offs_k, mask=k_ok, other=0) != 0, fidx, -1)


@triton.jit
def store_partial(out_part, lse_part, part, m_ok, offs_d, d_ok, D, acc, m_i, l_i):
    """A program's (out, lse) partial for its query rows at flat partial rows `part` (scores in log2
    units: the lse is stored in natural log); no row attended: out 0, lse -inf."""
    has = l_i > 0
    tl.store(out_part + part[:, None] * D + offs_d[None, :], acc / tl.where(has, l_i, 1.0)[:, None],
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_part + part, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                                       -float("inf")), mask=m_ok)


@triton.jit
def plane_key_scores(qt, k_codes, k_scale, k_zero, rows, grp, offs_c, offs_d, D, dt: tl.constexpr, BITS: tl.constexpr,
                     BLOCK_D: tl.constexpr, CODES: tl.constexpr, CODE_OFF: tl.constexpr, DOT: tl.constexpr):
    """key_scores on the bit-plane tiles (plane_codes; plain KIVI codes): codes read as CODE_OFF + c,
    whose extra CODE_OFF * sum(q*s_k) is taken off with the zero term (from the same rounded q*s_k
    the dot saw). -> scores [BLOCK_M, len(rows)]."""
    qs = (qt * tl.load(k_scale + grp * D + offs_d).to(tl.float32)[None, :]).to(dt)
    zk = tl.load(k_zero + grp * D + offs_d).to(tl.float32)
    ck = plane_codes(k_codes, rows[None, :], offs_c[:, None], dt, BITS, BLOCK_D, CODES)
    return tl.dot(qs, ck, input_precision=DOT) + tl.sum(qt * zk[None, :] - CODE_OFF * qs.to(tl.float32), 1)[:, None]


@triton.jit
def logits_rows(logits, bh, offs_m, m_ok, T, M, S_L, SEL: tl.constexpr):
    """Where the selection's logits of query rows offs_m go (once per program, outside the loops): the last SEL
    of the step's T tokens select, and query row m = g*T + t is logits row g*SEL + t - (T - SEL) of the kv
    head's (M // T) * SEL rows of S_L positions. -> (row pointers [BLOCK_M], which rows select)."""
    t = offs_m % T
    return logits + (bh * (M // T) * SEL + (offs_m // T) * SEL + t - (T - SEL)) * S_L, m_ok & (t >= T - SEL)


@triton.jit
def store_logits(rows, rows_ok, pos, ok, s):
    """The selecting rows' scores s [BLOCK_M, N] (log2 units) at positions pos [N] where ok (logits_rows)."""
    tl.store(rows[:, None] + pos[None, :], s, mask=rows_ok[:, None] & ok[None, :])


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def fetched_mask(n0, fidx, BLOCK_N: tl.constexpr):
    """[BLOCK_N] bool, True where position n0 + n is held as a fetched fp row: one OR over the fetched
    positions of a BLOCK_N (<= 64) bit word, instead of a [BLOCK_N, K] comparison."""
    rel = fidx - n0
    one = tl.full(rel.shape, 1, tl.int64)
    word = tl.reduce(tl.where((rel >= 0) & (rel < BLOCK_N), one << rel.to(tl.int64), 0), 0, _or)
    return ((word >> tl.arange(0, BLOCK_N).to(tl.int64)) & 1) != 0


@triton.jit
def fetched_hits(offs_n, fidx):
    """[BLOCK_N] int32, 1 where position offs_n is held as a fetched fp row (fidx: positions, -1 = unused)."""
    return tl.max((offs_n[:, None] == fidx[None, :]).to(tl.int32), 1)


@triton.jit
def online_softmax(s, m_i, l_i, acc):
    """Flash-attention update with scores in log2 units: -> (m, l, rescaled acc, p)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None], p


@triton.jit
def _magic_asm(b, shift, mask, magic, dt: tl.constexpr):
    """Four uint8 elements of one bit plane (one 32-bit register: their bytes) -> MAGIC + code each,
    in two registers of dt pairs: shift the plane's codes to the bottom of each byte, mask, and let
    one prmt per two codes put each code byte under the magic exponent byte (0x43: bf16 128.0,
    0x64: fp16 1024.0), so no int->float conversion runs. `shift`/`mask`/`magic` are int32 tensors of
    b's shape (the first of each four is read)."""
    ASM: tl.constexpr = ("{ .reg .b32 t; shr.b32 t, $2, $3; and.b32 t, t, $7; prmt.b32 $0, t, $11, 0x4140; "
                         "prmt.b32 $1, t, $11, 0x4342; }")
    CON: tl.constexpr = "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r"  # 2 outputs; 1 + 4 + 4 + 4 input registers
    if dt == tl.bfloat16:
        return tl.inline_asm_elementwise(ASM, CON, [b, shift, mask, magic], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(ASM, CON, [b, shift, mask, magic], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def plane_codes(codes, rows, cols, dt: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr, CODES: tl.constexpr):
    """Codes of a tile in plane-major channel order: column j*W + i (W = bytes per row) is bit plane j
    of byte i, channel i*PER + j (quant.pack_bits). Each element loads its byte (the PER columns of a
    byte share one load) and shifts its plane out: no reshape or interleave, so the tile needs no
    layout change before its dot. rows/cols/ok broadcast to the tile's shape. CODES 0: the code in dt;
    1: CODE_OFF + code by bit operations (16-bit dt, what 2 computes); 2: the same by inline PTX."""
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = BLOCK_D // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    b = tl.load(codes + rows * W + cols % W)
    shift = tl.broadcast_to((cols // W) * BITS, b.shape)
    if CODES == 2:
        magic = tl.full(b.shape, 0x43 if dt == tl.bfloat16 else 0x64, tl.int32)
        return _magic_asm(b, shift, tl.full(b.shape, MASK * 0x01010101 if BITS < 8 else -1, tl.int32), magic, dt)
    c = (b.to(tl.int32) >> shift) & MASK
    if CODES == 1:
        if dt == tl.bfloat16:
            return (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return c.to(dt)


@triton.jit
def tile_channels(offs_c, BLOCK_D: tl.constexpr, BITS: tl.constexpr, PLANES: tl.constexpr):
    """The channel each tile column holds: its own index, or in plane-major order (PLANES, plane_codes)
    column j*W + i holds channel i*PER + j."""
    if PLANES:
        W: tl.constexpr = BLOCK_D * BITS // 8
        offs_d = (offs_c % W) * (8 // BITS) + offs_c // W
    else:
        offs_d = offs_c
    return offs_d


@triton.jit
def best_row(p, offs_g, g_ok, R: tl.constexpr):
    """p [BLOCK_G, N] probabilities of query rows m = g*R + r -> max_r sum_g p: [N]."""
    best = tl.sum(tl.where((g_ok & (offs_g % R == 0))[:, None], p, 0.0), 0)
    for r in tl.static_range(1, R):
        best = tl.maximum(best, tl.sum(tl.where((g_ok & (offs_g % R == r))[:, None], p, 0.0), 0))
    return best
