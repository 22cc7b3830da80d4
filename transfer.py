"""The kernels that move fp16 KV rows between the host store and the device (specache.txt §3.3).
prefetch.py decides when they run (the side stream and its events); the selection that picks the rows
and stages the transfer's inputs is topk.py's one launch. A torch reference beside each Triton kernel.

  transfer_rows  one launch per layer and step, K and V together, on a small persistent grid: write
                 the step's real token (new_k/new_v [B,Hkv,1,D]) to host row new_pos, and gather
                 host rows idx [B,Hkv,k] into the layer's ring (a row equal to new_pos comes from
                 new_k/new_v: the same kernel cannot be relied on to have written it to the host
                 first; idx -1: the slot keeps the row it holds, see record_rows).
  record_rows    which ring slot each selected row goes to (a row the ring holds keeps its slot);
                 host_row / write_new_rows: the Triton reads and writes of the host store that
                 re-ranking's kernels (topk.rerank_rows) share.

On CUDA the host store is pinned and the kernels read it directly over unified virtual
addressing (UVA): the indices never leave the device and nothing syncs. On CPU the references
run (host and device memory are one).
"""
import torch
import triton
import triton.language as tl


def record_rows(idx, valid, fetch_idx, fetch_valid, off):
    """Which positions the ring's slots [off, ..) will hold (fetch_idx/fetch_valid [B,Hkv,off+k], which
    say what they hold now) for the selection idx/valid [B,Hkv,k]: a selected row the ring already
    holds keeps its slot; the others take the freed slots in order. -> the host row to copy into
    each slot, -1 for none (consecutive steps' selections overlap: only the new rows cross the bus)."""
    old, old_ok = fetch_idx[:, :, off:], fetch_valid[:, :, off:]
    same = (old[..., :, None] == idx[..., None, :]) & old_ok[..., :, None] & valid[..., None, :]  # [slot, row]
    keep, miss = same.any(-1), valid & ~same.any(-2)
    free = ~keep
    put = free[..., :, None] & miss[..., None, :] & \
        ((free.cumsum(-1) - free.long())[..., :, None] == (miss.cumsum(-1) - miss.long())[..., None, :])
    got = put.any(-1)
    row = torch.where(put, idx[..., None, :], 0).sum(-1)
    fetch_idx[:, :, off:] = torch.where(keep, old, torch.where(got, row, 0))
    fetch_valid[:, :, off:] = keep | got
    return torch.where(got, row, -1)


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
    warp up to 64 x 64 (its fixed work is not repeated per warp; static count, not timed), then about 64
    elements a thread, at most 32 warps. On one warp a 512 x 512 tile is 8,192 elements a thread and ptxas
    ran for over 6 minutes on it (seen on an H100 and in the sm_90 compile here)."""
    return 1 if block <= 64 else min(32, block * block // 2048)


# =============================================================================================
# the transfer: torch reference (CPU) and Triton kernel (CUDA), one launch for K and V
# =============================================================================================
def transfer_rows_ref(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off=0):
    """host_* [B,Hkv,S,D] (one layer), ring_* [B,Hkv,ring_off + k,D], idx [B,Hkv,k] or None, new_*
    [B,Hkv,1,D] or None, new_pos 0-d. In place: host[.., new_pos] = new; ring[.., ring_off:] = host[.., idx]
    where idx >= 0 (-1: the slot keeps its row; ring slots before ring_off hold rows kept on the
    device: attention sinks)."""
    if new_k is not None:
        pos = new_pos.reshape(1).to(host_k.device)
        host_k.index_copy_(2, pos, new_k.to(host_k.device, host_k.dtype))
        host_v.index_copy_(2, pos, new_v.to(host_v.device, host_v.dtype))
    if idx is not None:
        B, Hkv, S, D = host_k.shape
        idx = idx.to(host_k.device)
        flat = (idx.clamp(min=0) + torch.arange(B * Hkv, device=host_k.device).reshape(B, Hkv, 1) * S).flatten()
        for host, ring in ((host_k, ring_k), (host_v, ring_v)):
            rows = torch.index_select(host.reshape(-1, D), 0, flat).view(B, Hkv, -1, D).to(ring.dtype)
            slots = ring[:, :, ring_off:] if ring_off else ring
            slots.copy_(torch.where(idx[..., None] >= 0, rows, slots))


# =============================================================================================
# the attention sinks: their fp rows kept in the ring's first slots once the first block is quantized
# =============================================================================================
def keep_sink_rows(bufs, k, v, first, n: int) -> None:
    """Where `first` (0-d bool: the first block was just quantized), copy the first n rows of
    k, v [B,H,>=n,D] into ring slots [0, n) and mark them valid. bufs: [ring_k, ring_v, fetch_valid]."""
    ring_k, ring_v, valid = bufs
    for ring, x in ((ring_k, k), (ring_v, v)):
        ring[:, :, :n] = torch.where(first, x[:, :, :n].to(ring.dtype), ring[:, :, :n])
    valid[:, :, :n] |= first


@triton.jit
def _keep_sinks_kernel(k, v, sb, sh, sn, sd, first, ring_k, ring_v, valid, H, N, RING, D, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Grid (B*Hkv,): keep_sink_rows in one launch (a decode step calls it every step; `first` holds once)."""
    bh = tl.program_id(0).to(tl.int64)
    if tl.load(first) != 0:
        offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
        ok = (offs_n < N)[:, None] & (offs_d < D)[None, :]
        src = (bh // H) * sb + (bh % H) * sh + offs_n[:, None] * sn + offs_d[None, :] * sd
        dst = (bh * RING + offs_n)[:, None] * D + offs_d[None, :]
        tl.store(ring_k + dst, tl.load(k + src, mask=ok).to(ring_k.dtype.element_ty), mask=ok)
        tl.store(ring_v + dst, tl.load(v + src, mask=ok).to(ring_v.dtype.element_ty), mask=ok)
        tl.store(valid + bh * RING + offs_n, (offs_n >= 0).to(tl.int8), mask=offs_n < N)


def keep_sinks_triton(bufs, k, v, first, n: int) -> None:
    ring_k, ring_v, valid = bufs
    B, H, RING, D = ring_k.shape
    assert ring_k.is_contiguous() and ring_v.is_contiguous() and valid.is_contiguous() and v.stride() == k.stride()
    _keep_sinks_kernel[(B * H,)](k, v, *k.stride(), first.view(torch.uint8), ring_k, ring_v, valid.view(torch.int8), H, n, RING, D,
                                 BLOCK_N=triton.next_power_of_2(n), BLOCK_D=triton.next_power_of_2(D), num_warps=1)


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
TRANSFER_WARPS = 1  # one warp moves a tile's 16 rows (fewest instructions per row, docs/kernels.md; not timed)


@triton.jit
def _transfer_rows_kernel(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos_ptr, S, K, D, RING, OFF, BH,
                          HAS_IDX: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                          EVEN_D: tl.constexpr = False):
    """Grid (P,), P <= TRANSFER_PROGRAMS: a small persistent grid, so the side stream holds few SMs
    while the main stream computes. Program p gathers the tiles p, p + P, ... of BLOCK_R ring slots
    (of one kv head each): slot j of kv head bh gets K and V host row idx[bh, j] (UVA on CUDA: each row a
    whole, aligned D-vector, so the reads are coalesced), a row equal to the token's position from
    new_k/new_v, nothing for idx -1 (the slot keeps its row). Then it writes the step's token to
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
    if HAS_IDX:
        TPH = (K + BLOCK_R - 1) // BLOCK_R  # tiles per kv head: a tile's rows share one kv head (no per-row division)
        for tile in range(p, BH * TPH, n_prog):
            bh = (tile // TPH).to(tl.int64)
            j = (tile - bh * TPH) * BLOCK_R + tl.arange(0, BLOCK_R)
            i = tl.load(idx + bh * K + j, mask=j < K, other=-1).to(tl.int64)
            ok = (j < K) & (i >= 0) & (i < S)
            src = (bh * S + i)[:, None] * D + offs_d[None, :]
            dst = (bh * RING + OFF + j)[:, None] * D + offs_d[None, :]
            m = (ok & (i != new_pos))[:, None] & d_ok[None, :]
            tl.store(ring_k + dst, tl.load(host_k + src, mask=m).to(ring_k.dtype.element_ty), mask=m)
            tl.store(ring_v + dst, tl.load(host_v + src, mask=m).to(ring_v.dtype.element_ty), mask=m)
    if HAS_NEW:
        for bh in range(p, BH, n_prog):
            write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs_d)  # (bh * S + new_pos: int64)
            if HAS_IDX:  # the ring slot (at most one) that selected the token: its row from new_k/new_v,
                BLOCK_K: tl.constexpr = 4 * BLOCK_R  # whose host row may not be written yet (the loop skipped it)
                for k0 in range(0, K, BLOCK_K):
                    j = k0 + tl.arange(0, BLOCK_K)
                    hit = (j < K) & (tl.load(idx + bh * K + j, mask=j < K, other=-1).to(tl.int64) == new_pos)
                    slot = tl.max(tl.where(hit, j, -1), 0)
                    ok = offs_d < tl.where(slot >= 0, D, 0)
                    dst = (bh * RING + OFF + slot) * D + offs_d
                    tl.store(ring_k + dst, tl.load(new_k + bh * D + offs_d, mask=ok, other=0.0).to(ring_k.dtype.element_ty), mask=ok)
                    tl.store(ring_v + dst, tl.load(new_v + bh * D + offs_d, mask=ok, other=0.0).to(ring_v.dtype.element_ty), mask=ok)


def transfer_rows_triton(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off=0,
                         programs=TRANSFER_PROGRAMS):
    B, Hkv, S, D = host_k.shape
    K = idx.shape[2] if idx is not None else 0
    for t in (host_k, host_v, ring_k, ring_v):
        assert t.is_contiguous()
    any_t = ring_k  # absent inputs: any valid pointer
    grid = (max(1, min(programs, max(triton.cdiv(B * Hkv * K, TRANSFER_ROWS), B * Hkv))),)
    _transfer_rows_kernel[grid](
        host_k, host_v, ring_k, ring_v, idx.contiguous() if idx is not None else any_t,
        new_k.contiguous() if new_k is not None else any_t, new_v.contiguous() if new_v is not None else any_t,
        new_pos if new_pos is not None else any_t, S, K, D, ring_k.shape[2], ring_off, B * Hkv,
        HAS_IDX=idx is not None, HAS_NEW=new_k is not None, BLOCK_R=TRANSFER_ROWS, BLOCK_D=triton.next_power_of_2(D),
        EVEN_D=D == triton.next_power_of_2(D), num_warps=TRANSFER_WARPS)


def transfer_rows(host_k, host_v, ring_k, ring_v, idx, new_k=None, new_v=None, new_pos=None, ring_off=0):
    """The transfer on the current stream: the Triton kernel when the ring is on CUDA, else the reference."""
    if ring_k.is_cuda:
        transfer_rows_triton(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off)
    else:
        transfer_rows_ref(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off)
