"""The kernels that move fp16 KV rows between the host store and the device (specache.txt §3.3); prefetch.py
decides when they run (the side stream and its events) and holds their torch references (transfer_rows_ref,
keep_sink_rows, rerank_rows_ref); the selection that picks the rows and stages the transfer's inputs is
gpu/topk.py's one launch.

  transfer_rows  one launch per layer and step, K and V together, on a small persistent grid: write
                 the step's real token (new_k/new_v [B,Hkv,1,D]) to host row new_pos, and gather
                 into each ring slot the host row the slot map names (slot_rows [B,Hkv,k]; a row equal
                 to new_pos comes from new_k/new_v: the same kernel cannot be relied on to have written
                 it to the host first; -1: the slot keeps the row it holds, see prefetch.record_rows).
  record_rows_tile  prefetch.record_rows for one kv head; host_row / write_new_rows: the reads and writes
                 of the host store that re-ranking's kernels share.

On CUDA the host store is pinned and the kernels read it directly over unified virtual addressing (UVA):
the indices never leave the device and nothing syncs.
"""
import torch
import triton
import triton.language as tl

from gpu.tiles import best_row


@triton.jit
def record_rows_tile(fetch_idx, fetch_valid, slots, slot_ok, rows, row_ok, rank, BY_RANK: tl.constexpr):
    """record_rows for one kv head, in Triton: the selected rows [N] (row_ok) into the ring slots at
    offsets `slots` [K] of fetch_idx/fetch_valid (slot_ok: real slots). A selected row the ring holds
    keeps its slot; the missing ones take the free slots in their index order, or BY_RANK in the order
    of `rank` [N] (lower first). Writes fetch_idx/fetch_valid; -> put [K, N]: slot s receives row n."""
    old = tl.load(fetch_idx + slots, mask=slot_ok, other=-1)
    old_ok = tl.load(fetch_valid + slots, mask=slot_ok, other=0) != 0
    same = ((old[:, None] == rows[None, :]) & old_ok[:, None] & row_ok[None, :]).to(tl.int32)  # [slot, row]
    keep = tl.max(same, 1) > 0
    miss = (row_ok & (tl.max(same, 0) == 0)).to(tl.int32)
    free = ((keep == 0) & slot_ok).to(tl.int32)
    if BY_RANK:  # missing rows ranked ahead of each
        order = tl.sum(((miss[None, :] != 0) & (rank[None, :] < rank[:, None])).to(tl.int32), 1)
    else:
        order = tl.cumsum(miss, 0) - miss
    put = (free[:, None] != 0) & (miss[None, :] != 0) & ((tl.cumsum(free, 0) - free)[:, None] == order[None, :])
    got = tl.max(put.to(tl.int32), 1) > 0
    tl.store(fetch_idx + slots, tl.where(keep, old, tl.where(got, tl.sum(tl.where(put, rows[None, :], 0), 1), 0)),
             mask=slot_ok)
    tl.store(fetch_valid + slots, (keep | got).to(tl.int8), mask=slot_ok)
    return put


def square_tile_warps(block: int) -> int:
    """Warps for a program whose work is one [block, block] tile (re-ranking's ranks and record_rows_tile): one
    warp up to 64 x 64 (its fixed work is not repeated per warp), then about 64 elements a thread, at most
    32 warps: ptxas takes minutes on a 512 x 512 tile held by one warp (docs/gpu.md, the compile hang)."""
    return 1 if block <= 64 else min(32, block * block // 2048)


@triton.jit
def _keep_sinks_kernel(k, v, sb, sh, sn, sd, row0_ptr, row_start, ring_k, ring_v, valid, H, N, NB, RING, D,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv,): keep_sink_rows in one launch (a decode step calls it every step; a row's sinks land once)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    rel = tl.load(row_start + bh // H) + offs_n - tl.load(row0_ptr)  # each sink's row of the block
    n_ok = (offs_n < N) & (rel >= 0) & (rel < NB)
    ok = n_ok[:, None] & (offs_d < D)[None, :]
    src = (bh // H) * sb + (bh % H) * sh + rel[:, None] * sn + offs_d[None, :] * sd
    dst = (bh * RING + offs_n)[:, None] * D + offs_d[None, :]
    tl.store(ring_k + dst, tl.load(k + src, mask=ok).to(ring_k.dtype.element_ty), mask=ok)
    tl.store(ring_v + dst, tl.load(v + src, mask=ok).to(ring_v.dtype.element_ty), mask=ok)
    tl.store(valid + bh * RING + offs_n, (offs_n >= 0).to(tl.int8), mask=n_ok)


def keep_sinks_triton(bufs, k, v, row0, n: int, row_start) -> None:
    ring_k, ring_v, valid = bufs
    B, H, RING, D = ring_k.shape
    assert ring_k.is_contiguous() and ring_v.is_contiguous() and valid.is_contiguous() and v.stride() == k.stride()
    _keep_sinks_kernel[(B * H,)](k, v, *k.stride(), row0, row_start, ring_k, ring_v, valid.view(torch.int8), H, n,
                                 k.shape[2], RING, D, BLOCK_N=triton.next_power_of_2(n),
                                 BLOCK_D=triton.next_power_of_2(D), num_warps=1)


# (masks are `offs < limit` with a scalar limit: block & scalar-bool masks break the interpreter)
@triton.jit
def host_row(host, new, bh, i, new_pos, S, D, offs, HAS_NEW: tl.constexpr):
    """Row i of kv head bh of one layer's host store [B*Hkv, S, D] (UVA on CUDA), zeros when out of
    range; the step's token (i == new_pos) from new [B*Hkv, D]: its host row may not be written yet."""
    in_range = (i >= 0) & (i < S)
    row = tl.load(host + (bh * S + i) * D + offs, mask=offs < tl.where(in_range & (i != new_pos), D, 0), other=0.0)
    if HAS_NEW:
        take = offs < tl.where(in_range & (i == new_pos), D, 0)
        row = tl.where(take, tl.load(new + bh * D + offs, mask=take, other=0.0).to(row.dtype), row)
    return row


@triton.jit
def write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs):
    """The step's token new_k/new_v [B*Hkv, D] to host row new_pos of kv head bh (none when out of range)."""
    ok = offs < tl.where((new_pos >= 0) & (new_pos < S), D, 0)
    dst = (bh * S + new_pos) * D + offs
    tl.store(host_k + dst, tl.load(new_k + bh * D + offs, mask=ok, other=0.0).to(host_k.dtype.element_ty), mask=ok)
    tl.store(host_v + dst, tl.load(new_v + bh * D + offs, mask=ok, other=0.0).to(host_v.dtype.element_ty), mask=ok)


TRANSFER_PROGRAMS = 16  # the transfer's persistent grid: at most this many SMs beside the main stream's kernels
TRANSFER_ROWS = 16  # ring slots per tile: 16 whole host rows (4 KiB of K at D 128 in 16 bits), in flight together
TRANSFER_WARPS = 1  # one warp moves a tile's 16 rows: the fewest instructions per row (docs/kernels.md)


@triton.jit
def _transfer_rows_kernel(host_k, host_v, ring_k, ring_v, slot_rows, new_k, new_v, new_pos_ptr, S, K, D, RING, OFF, BH,
                          HAS_ROWS: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          EVEN_D: tl.constexpr = False):
    """Grid (P,), P <= TRANSFER_PROGRAMS: a small persistent grid, so the side stream holds few SMs
    while the main stream computes. Program p gathers the tiles p, p + P, ... of BLOCK_R ring slots
    (of one kv head each): slot j of kv head bh gets K and V host row slot_rows[bh, j] (UVA on CUDA: each row a
    whole, aligned D-vector, so the reads are coalesced), a row equal to the token's position from
    new_k/new_v, nothing for slot_rows -1 (the slot keeps its row). Then it writes the step's token to
    host row new_pos for kv heads p, p + P, ..., and to the ring slot that selected it, if any (one
    search per kv head instead of a per-row choice in the gather loop)."""
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if EVEN_D:  # D == BLOCK_D: rows need no column mask (one predicate per row, none per vector)
        d_ok = offs_d >= 0
    new_pos = -1  # (no row is the token without HAS_NEW)
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    if HAS_ROWS:
        TPH = (K + BLOCK_R - 1) // BLOCK_R  # tiles per kv head: a tile's rows share one kv head (no per-row division)
        for tile in range(p, BH * TPH, n_prog):
            bh = (tile // TPH).to(tl.int64)
            j = (tile - bh * TPH) * BLOCK_R + tl.arange(0, BLOCK_R)
            i = tl.load(slot_rows + bh * K + j, mask=j < K, other=-1).to(tl.int64)
            ok = (j < K) & (i >= 0) & (i < S)
            src = (bh * S + i)[:, None] * D + offs_d[None, :]
            dst = (bh * RING + OFF + j)[:, None] * D + offs_d[None, :]
            m = (ok & (i != new_pos))[:, None] & d_ok[None, :]
            tl.store(ring_k + dst, tl.load(host_k + src, mask=m).to(ring_k.dtype.element_ty), mask=m)
            tl.store(ring_v + dst, tl.load(host_v + src, mask=m).to(ring_v.dtype.element_ty), mask=m)
    if HAS_NEW:
        for bh in range(p, BH, n_prog):
            write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs_d)  # (bh * S + new_pos: int64)
            if HAS_ROWS:  # the ring slot (at most one) that selected the token: its row from new_k/new_v,
                BLOCK_K: tl.constexpr = 4 * BLOCK_R  # whose host row may not be written yet (the loop skipped it)
                for k0 in range(0, K, BLOCK_K):
                    j = k0 + tl.arange(0, BLOCK_K)
                    hit = (j < K) & (tl.load(slot_rows + bh * K + j, mask=j < K, other=-1).to(tl.int64) == new_pos)
                    slot = tl.max(tl.where(hit, j, -1), 0)
                    ok = offs_d < tl.where(slot >= 0, D, 0)
                    dst = (bh * RING + OFF + slot) * D + offs_d
                    tl.store(ring_k + dst, tl.load(new_k + bh * D + offs_d, mask=ok, other=0.0).to(ring_k.dtype.element_ty), mask=ok)
                    tl.store(ring_v + dst, tl.load(new_v + bh * D + offs_d, mask=ok, other=0.0).to(ring_v.dtype.element_ty), mask=ok)


def transfer_rows_triton(host_k, host_v, ring_k, ring_v, slot_rows, new_k, new_v, new_pos, ring_off=0,
                         programs=TRANSFER_PROGRAMS):
    B, Hkv, S, D = host_k.shape
    K = slot_rows.shape[2] if slot_rows is not None else 0
    for t in (host_k, host_v, ring_k, ring_v):
        assert t.is_contiguous()
    any_t = ring_k  # absent inputs: any valid pointer
    grid = (max(1, min(programs, max(triton.cdiv(B * Hkv * K, TRANSFER_ROWS), B * Hkv))),)
    _transfer_rows_kernel[grid](
        host_k, host_v, ring_k, ring_v, slot_rows.contiguous() if slot_rows is not None else any_t,
        new_k.contiguous() if new_k is not None else any_t, new_v.contiguous() if new_v is not None else any_t,
        new_pos if new_pos is not None else any_t, S, K, D, ring_k.shape[2], ring_off, B * Hkv,
        HAS_ROWS=slot_rows is not None, HAS_NEW=new_k is not None, BLOCK_R=TRANSFER_ROWS, BLOCK_D=triton.next_power_of_2(D),
        EVEN_D=D == triton.next_power_of_2(D), num_warps=TRANSFER_WARPS)


# =============================================================================================
# re-ranking: the k best of N*k candidates by their fp keys, read from the host (side stream)
# =============================================================================================
RERANK_WARPS = 1  # one candidate per program: more warps only repeat its fixed cost
# The layout launch ranks a kv head's candidates in one [C, C] tile, which ptxas compiles in minutes above 512
# (docs/gpu.md), so the GPU path stops at 256 (rerank x k; the reference has no limit).
RERANK_MAX_CANDIDATES = 256


@triton.jit
def _rerank_score_kernel(host_k, cand, cand_valid, q, lse, new_k, new_pos_ptr, keys, score, sm_scale, S, C, D, M,
                         R: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, C): program (bh, c) reads candidate c's fp key (UVA on CUDA; the token's own row
    from new_k), keeps it in the device scratch keys [B*Hkv, C, D] and writes its score
    score[bh, c] = max over r of sum over g of exp(sm_scale * q_{g,r} . k_c - lse_{g,r}) (-1: not
    a candidate) for the kv head's M = G*R query rows (row m = g*R + r). One host row per program,
    as in the transfer: the reads are in flight together instead of one kv head's C rows in turn."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_ok, m_ok = offs_d < D, offs_m < M
    i = tl.load(cand + bh * C + c).to(tl.int64)
    ok = tl.load(cand_valid + bh * C + c) != 0
    new_pos = -1
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    # the ring's dtype: what gets scored is what gets fetched
    key = host_row(host_k, new_k, bh, i, new_pos, S, D, offs_d, HAS_NEW).to(keys.dtype.element_ty)
    tl.store(keys + (bh * C + c) * D + offs_d, key, mask=d_ok)
    qm = tl.load(q + (bh * M + offs_m)[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    logits = tl.sum(qm.to(tl.float32) * key.to(tl.float32)[None, :], 1) * sm_scale  # [BLOCK_M]
    p = tl.exp(logits - tl.load(lse + bh * M + offs_m, mask=m_ok, other=float("inf")))
    best = tl.sum(best_row(p[:, None], offs_m, m_ok, R), 0)
    tl.store(score + bh * C + c, tl.where(ok, best, -1.0))


@triton.jit
def _rerank_layout_kernel(cand, score, fetch_idx, fetch_valid, target, C, K, RING, OFF, BLOCK_C: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Grid (B*Hkv,): rank the kv head's C candidates by score (ties to the lower index, so the top-K
    needs no sort) and lay the K best out as record_rows does: a winner the ring already holds keeps
    its slot; the others, best first, take the freed slots. Writes fetch_idx/fetch_valid [.., RING]
    from slot OFF and target[bh, c], the ring slot candidate c's key and value go to (-1: none,
    not a winner or already held)."""
    bh = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    s = tl.load(score + bh * C + offs_c, mask=c_ok, other=-2.0)  # (-2 beats nothing)
    i = tl.load(cand + bh * C + offs_c, mask=c_ok, other=-1)
    ahead = (s[None, :] > s[:, None]) | ((s[None, :] == s[:, None]) & (offs_c[None, :] < offs_c[:, None]))
    rank = tl.sum(ahead.to(tl.int32), 1)
    ok = c_ok & (rank < K) & (s >= 0)  # the real winners
    offs_k = tl.arange(0, BLOCK_K)
    put = record_rows_tile(fetch_idx, fetch_valid, bh * RING + OFF + offs_k, offs_k < K, i, ok, rank, BY_RANK=True)
    to_slot = tl.where(tl.max(put.to(tl.int32), 0) > 0, tl.sum(tl.where(put, offs_k[:, None], 0), 0), -1)
    tl.store(target + bh * C + offs_c, to_slot, mask=c_ok)


@triton.jit
def _rerank_pick_kernel(host_k, host_v, ring_k, ring_v, cand, keys, target, new_k, new_v, new_pos_ptr, S, C, D, RING,
                        OFF, HAS_NEW: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, C + 1): program (bh, c < C) writes candidate c's key (from the scratch) and value
    (from the host over UVA; the token's own row from new_v) to ring slot OFF + target[bh, c] if it
    has one: only the winners the ring lacks move their values over the bus. Program C writes the
    step's token to host row new_pos."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new_pos = -1
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    if c < C:
        slot = tl.load(target + bh * C + c)
        if slot >= 0:
            i = tl.load(cand + bh * C + c).to(tl.int64)
            dst = (bh * RING + OFF + slot) * D + offs_d
            tl.store(ring_k + dst, tl.load(keys + (bh * C + c) * D + offs_d, mask=d_ok), mask=d_ok)
            val = host_row(host_v, new_v, bh, i, new_pos, S, D, offs_d, HAS_NEW)
            tl.store(ring_v + dst, val.to(ring_v.dtype.element_ty), mask=d_ok)
    else:
        if HAS_NEW:  # the token's own row to the host (its candidate copies came from new_k/new_v)
            write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs_d)


def rerank_scratch(B, Hkv, C, D, dtype, device):
    """Device scratch of the re-ranking launches: the candidates' fp keys, their scores and ring slots."""
    if C > RERANK_MAX_CANDIDATES:
        raise ValueError(f"re-ranking {C} candidates a kv head (rerank x k) on the GPU: at most {RERANK_MAX_CANDIDATES} "
                         "(one [C, C] tile ranks them); use a smaller k or rerank")
    return (torch.empty(B, Hkv, C, D, dtype=dtype, device=device),
            torch.empty(B, Hkv, C, dtype=torch.float32, device=device),
            torch.empty(B, Hkv, C, dtype=torch.int32, device=device))


def rerank_rows_triton(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                       sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0, scratch=None):
    """rerank_rows_ref in three launches: one program per candidate (read its key, score it), one
    per kv head (rank, lay out the winners), one per candidate (move a winner the ring lacks).
    scratch: rerank_scratch(...) (the Prefetcher preallocates one, shared by its layers: the side
    stream runs them in turn); allocated here when None."""
    B, Hkv, S, D = host_k.shape
    C, (H, R) = cand.shape[2], q_rows.shape[1:3]
    for t in (host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid):
        assert t.is_contiguous()
    keys, score, target = scratch if scratch is not None else rerank_scratch(B, Hkv, C, D, ring_k.dtype, ring_k.device)
    assert keys.shape == (B, Hkv, C, D) and keys.dtype == ring_k.dtype and score.shape == target.shape == (B, Hkv, C)
    has_new, any_t = new_k is not None, ring_k  # absent inputs: any valid pointer
    new_k, new_v, pos = (new_k.contiguous(), new_v.contiguous(), new_pos) if has_new else (any_t, any_t, any_t)
    cand, M, BLOCK_D = cand.contiguous(), H // Hkv * R, triton.next_power_of_2(D)
    K = min(ring_k.shape[2] - ring_off, C)
    _rerank_score_kernel[(B * Hkv, C)](
        host_k, cand, cand_valid.contiguous().view(torch.int8), q_rows.contiguous(), lse_rows.float().contiguous(),
        new_k, pos, keys, score, float(sm_scale), S, C, D, M, R,
        HAS_NEW=has_new, BLOCK_M=triton.next_power_of_2(M), BLOCK_D=BLOCK_D, num_warps=RERANK_WARPS)
    _rerank_layout_kernel[(B * Hkv,)](cand, score, fetch_idx, fetch_valid.view(torch.int8), target, C, K,
                                      ring_k.shape[2], ring_off, BLOCK_C=triton.next_power_of_2(C),
                                      BLOCK_K=triton.next_power_of_2(K),
                                      num_warps=max(8, square_tile_warps(triton.next_power_of_2(C))))  # ([C, C] ranks)
    _rerank_pick_kernel[(B * Hkv, C + 1)](
        host_k, host_v, ring_k, ring_v, cand, keys, target, new_k, new_v, pos, S, C, D, ring_k.shape[2], ring_off,
        HAS_NEW=has_new, BLOCK_D=BLOCK_D, num_warps=RERANK_WARPS)
