"""Moving fp16 KV between host memory and the device (specache.txt §3.3, Figure 3).

`Prefetcher` owns the host store, host_k/host_v [L, B, Hkv, S, D]: every real token's full-precision
K/V, pinned on CUDA so the device can read it directly. The device end of a fetch belongs to each
layer's SpeCache module: the ring of fetched rows ring_k/ring_v [B, Hkv, k, D] is a module buffer,
so a compiled step sees it as a static input (a CUDA graph replays on fixed addresses).

One transfer per layer and step, `start(layer, bufs, idx, valid, new_k, new_v, new_pos)` (bufs: the
layer's ring and its fetch_idx/fetch_valid, which record idx and valid), one kernel for K and V together:
  - writes the step's real token (new_k/new_v [B,Hkv,1,D]) to host row new_pos (it may be picked
    from the next flush on), and
  - gathers host rows idx [B,Hkv,k] into the ring (a row equal to new_pos is taken from new_k/new_v:
    the same kernel cannot be relied on to have written it to the host first).
`idx=None` only writes the token; `new_k=None` only gathers.

Re-ranking (`rerank` > 1, name part rrN), `start_rerank`: the selecting token's low-bit top-(N*k)
are candidates; two launches per layer on the side stream (`rerank_rows`), one program per
candidate in each (like the transfer's one per row): the first reads a candidate's fp key and
scores it (the score of kernels.rerank_exact), the second ranks it among its kv head's and, if it
is among the k best, writes its key to the ring, its position to the layer's fetch_idx/fetch_valid
and reads its value.
Bus bytes per layer and kv head: N*k keys + k values instead of k keys + k values (N = 2: 1.5x),
all on the side stream; the main stream only stages the candidates and the selecting query rows
and their lse.

On CUDA the transfer runs on a side stream and overlaps the rest of the step:
  main stream: copy idx and the token's K/V into this layer's staging buffers and record idx and
               valid in fetch_idx/fetch_valid (one launch), record consumed[l]
  side stream: wait consumed[l], run the kernel (it reads pinned host memory through unified
               virtual addressing, so the indices never leave the device and nothing syncs),
               record fetched[l].
The side stream reads only memory this module owns (staging, host store) and writes only the
layer's buffers registered with `register_ring` (the ring; with re-ranking also fetch_idx and
fetch_valid), so graph-internal temporaries that a compiled step frees and reuses while the side
stream still runs never cross streams (the side stream's own temporaries come from its own
allocator pool). The custom ops check that they were handed the layer's own buffers, not copies
made by functionalization (which would make the side stream write a temporary).

A CUDA graph must join every stream it forks before its capture ends, so by default
(`join_each_step`) the last layer joins the side stream (`end_step`), and `wait(l)` has nothing to
do. Without graphs (`join_each_step=False`, eager CUDA) the main stream of the next step waits for
`fetched[l]` just before layer l's attention, so the copies also overlap sampling.

On CPU there is no bus: host and device memory are one, a transfer is a synchronous gather, and
the whole decode step stays traceable by torch.compile. `async_ops=True` on CPU runs the CUDA code
path (custom ops, streams and events of `torch.get_device_module`, which tests replace by delayed
fake streams).
"""
import itertools
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

import kernels

Tensor = torch.Tensor
_PREFETCHERS = weakref.WeakValueDictionary()  # id -> Prefetcher: the custom ops find their streams here
_ids = itertools.count()


# =============================================================================================
# the transfer: torch reference (CPU) and Triton kernel (CUDA), one launch for K and V
# =============================================================================================
def transfer_rows_ref(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off=0, values_only=False):
    """host_* [B,Hkv,S,D] (one layer), ring_* [B,Hkv,ring_off + k,D], idx [B,Hkv,k] or None, new_*
    [B,Hkv,1,D] or None, new_pos 0-d. In place: host[.., new_pos] = new; ring[.., ring_off:] = host[.., idx]
    (ring slots before ring_off hold rows kept on the device: attention sinks)."""
    if new_k is not None:
        pos = new_pos.reshape(1).to(host_k.device)
        host_k.index_copy_(2, pos, new_k.to(host_k.device, host_k.dtype))
        host_v.index_copy_(2, pos, new_v.to(host_v.device, host_v.dtype))
    if idx is not None:
        B, Hkv, S, D = host_k.shape
        flat = (idx.to(host_k.device) + torch.arange(B * Hkv, device=host_k.device).reshape(B, Hkv, 1) * S).flatten()
        for host, ring in ((host_v, ring_v),) if values_only else ((host_k, ring_k), (host_v, ring_v)):
            rows = torch.index_select(host.reshape(-1, D), 0, flat).view(B, Hkv, -1, D)
            if ring_off:
                ring[:, :, ring_off:].copy_(rows)
            else:
                ring.copy_(rows)


# (masks are `offs < limit` with a scalar limit: block & scalar-bool masks break the interpreter)
@triton.jit
def _host_row(host, new, bh, i, new_pos, S, D, offs, HAS_NEW: tl.constexpr):
    """Row i of kv head bh of one layer's host store [B*Hkv, S, D] (UVA on CUDA), zeros when out of
    range; the step's token (i == new_pos) from new [B*Hkv, D]: its host row may not be written yet."""
    in_range = (i >= 0) & (i < S)
    row = tl.load(host + (bh * S + i) * D + offs, mask=offs < tl.where(in_range & (i != new_pos), D, 0), other=0.0)
    if HAS_NEW:
        take = offs < tl.where(in_range & (i == new_pos), D, 0)
        row = tl.where(take, tl.load(new + bh * D + offs, mask=take, other=0.0).to(row.dtype), row)
    return row


@triton.jit
def _write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs):
    """The step's token new_k/new_v [B*Hkv, D] to host row new_pos of kv head bh (none when out of range)."""
    ok = offs < tl.where((new_pos >= 0) & (new_pos < S), D, 0)
    dst = (bh * S + new_pos) * D + offs
    tl.store(host_k + dst, tl.load(new_k + bh * D + offs, mask=ok, other=0.0).to(host_k.dtype.element_ty), mask=ok)
    tl.store(host_v + dst, tl.load(new_v + bh * D + offs, mask=ok, other=0.0).to(host_v.dtype.element_ty), mask=ok)


@triton.jit
def _transfer_rows_kernel(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos_ptr, S, K, D, RING, OFF,
                          HAS_IDX: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, K + 1). Program j < K gathers row idx[bh, j] of K and V into ring slot OFF + j
    (of RING); program K writes the new token's row to the host. Host pointers are UVA on CUDA."""
    bh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    new_pos = -1  # (no row is the token without HAS_NEW)
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    if j < K:
        if HAS_IDX:
            i = tl.load(idx + bh * K + j).to(tl.int64)
            ok = offs < tl.where((i >= 0) & (i < S), D, 0)
            dst = (bh * RING + OFF + j) * D + offs
            kx = _host_row(host_k, new_k, bh, i, new_pos, S, D, offs, HAS_NEW)
            vx = _host_row(host_v, new_v, bh, i, new_pos, S, D, offs, HAS_NEW)
            tl.store(ring_k + dst, kx.to(ring_k.dtype.element_ty), mask=ok)
            tl.store(ring_v + dst, vx.to(ring_v.dtype.element_ty), mask=ok)
    else:
        if HAS_NEW:
            _write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs)


def transfer_rows_triton(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off=0):
    B, Hkv, S, D = host_k.shape
    K = idx.shape[2] if idx is not None else 0
    for t in (host_k, host_v, ring_k, ring_v):
        assert t.is_contiguous()
    any_t = ring_k  # absent inputs: any valid pointer
    _transfer_rows_kernel[(B * Hkv, K + 1)](
        host_k, host_v, ring_k, ring_v, idx.contiguous() if idx is not None else any_t,
        new_k.contiguous() if new_k is not None else any_t, new_v.contiguous() if new_v is not None else any_t,
        new_pos if new_pos is not None else any_t, S, K, D, ring_k.shape[2], ring_off,
        HAS_IDX=idx is not None, HAS_NEW=new_k is not None, BLOCK_D=triton.next_power_of_2(D))


def transfer_rows(host_k, host_v, ring_k, ring_v, idx, new_k=None, new_v=None, new_pos=None, ring_off=0):
    """The transfer on the current stream: the Triton kernel when the ring is on CUDA, else the reference."""
    if ring_k.is_cuda:
        transfer_rows_triton(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off)
    else:
        transfer_rows_ref(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off)


# =============================================================================================
# re-ranking's transfer: torch reference and Triton kernels (two launches per layer, side stream)
# =============================================================================================
def rerank_rows_ref(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                    sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0):
    """Of the candidate host rows cand [B,Hkv,C] (cand_valid: real ones), keep the K = ring slots - ring_off
    whose fp keys score best for the query rows q_rows [B,H,R,D] (lse_rows [B,H,R]; the score of
    kernels.rerank_exact); write their keys and values to ring slots [ring_off, ...) in descending
    score, their positions and validity (score >= 0) to fetch_idx/fetch_valid, and the real token
    (new_*) to host row new_pos, whose candidate copy is taken from new_k/new_v."""
    C = cand.shape[2]
    keys = host_k.gather(2, cand[..., None].expand(*cand.shape, host_k.shape[-1]))
    if new_k is not None:
        keys = torch.where((cand == new_pos)[..., None], new_k.to(keys.dtype), keys)
    score, pick = kernels.rerank_exact(q_rows, lse_rows, keys, cand_valid, min(ring_k.shape[2] - ring_off, C), sm_scale)
    idx = cand.gather(-1, pick)
    fetch_idx[:, :, ring_off:] = idx
    fetch_valid[:, :, ring_off:] = score >= 0
    ring_k[:, :, ring_off:] = keys.gather(2, pick[..., None].expand(-1, -1, -1, keys.shape[-1])).to(ring_k.dtype)
    transfer_rows_ref(host_k, host_v, ring_k, ring_v, idx, new_k, new_v, new_pos, ring_off, values_only=True)


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
    key = _host_row(host_k, new_k, bh, i, new_pos, S, D, offs_d, HAS_NEW).to(keys.dtype.element_ty)
    tl.store(keys + (bh * C + c) * D + offs_d, key, mask=d_ok)
    qm = tl.load(q + (bh * M + offs_m)[:, None] * D + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    logits = tl.sum(qm.to(tl.float32) * key.to(tl.float32)[None, :], 1) * sm_scale  # [BLOCK_M]
    p = tl.exp(logits - tl.load(lse + bh * M + offs_m, mask=m_ok, other=float("inf")))
    best = tl.sum(tl.where((offs_m % R) == 0, p, 0.0), 0)
    for r in tl.static_range(1, R):
        best = tl.maximum(best, tl.sum(tl.where((offs_m % R) == r, p, 0.0), 0))
    tl.store(score + bh * C + c, tl.where(ok, best, -1.0))


@triton.jit
def _rerank_pick_kernel(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, keys, score, new_k, new_v,
                        new_pos_ptr, S, C, K, D, RING, OFF, HAS_NEW: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, C + 1): program (bh, c < C) ranks candidate c among its kv head's C scores (the
    number of candidates that beat it, ties to the lower index), so the top-K needs no sort; if its
    rank is below K it writes ring slot OFF + rank: the key from the scratch, the value from the
    host (UVA; the token's own row from new_v), its position and validity (score >= 0). Only the K
    winners' values cross the bus. Program C writes the step's token to host row new_pos."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    new_pos = -1
    if HAS_NEW:
        new_pos = tl.load(new_pos_ptr).to(tl.int64)
    if c < C:
        offs_c = tl.arange(0, BLOCK_C)
        mine = tl.load(score + bh * C + c)
        others = tl.load(score + bh * C + offs_c, mask=offs_c < C, other=-2.0)  # (-2 beats nothing)
        rank = tl.sum(((others > mine) | ((others == mine) & (offs_c < c))).to(tl.int32), 0)
        if rank < K:
            i = tl.load(cand + bh * C + c).to(tl.int64)
            slot = bh * RING + OFF + rank
            tl.store(fetch_idx + slot, i)
            tl.store(fetch_valid + slot, (mine >= 0).to(tl.int8))
            dst = slot * D + offs_d
            tl.store(ring_k + dst, tl.load(keys + (bh * C + c) * D + offs_d, mask=d_ok), mask=d_ok)
            val = _host_row(host_v, new_v, bh, i, new_pos, S, D, offs_d, HAS_NEW)
            tl.store(ring_v + dst, val.to(ring_v.dtype.element_ty), mask=d_ok)
    else:
        if HAS_NEW:  # the token's own row to the host (its candidate copies came from new_k/new_v)
            _write_new_rows(host_k, host_v, new_k, new_v, bh, new_pos, S, D, offs_d)


def rerank_scratch(B, Hkv, C, D, dtype, device):
    """Device scratch of the two re-ranking launches: the candidates' fp keys and their scores."""
    return (torch.empty(B, Hkv, C, D, dtype=dtype, device=device),
            torch.empty(B, Hkv, C, dtype=torch.float32, device=device))


def rerank_rows_triton(host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid, cand, cand_valid, q_rows, lse_rows,
                       sm_scale, new_k=None, new_v=None, new_pos=None, ring_off=0, scratch=None):
    """rerank_rows_ref in two launches with one program per candidate (score, then rank and pick).
    scratch: rerank_scratch(...) (the Prefetcher preallocates one, shared by its layers: the side
    stream runs them in turn); allocated here when None."""
    B, Hkv, S, D = host_k.shape
    C, (H, R) = cand.shape[2], q_rows.shape[1:3]
    for t in (host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid):
        assert t.is_contiguous()
    keys, score = scratch if scratch is not None else rerank_scratch(B, Hkv, C, D, ring_k.dtype, ring_k.device)
    assert keys.shape == (B, Hkv, C, D) and keys.dtype == ring_k.dtype and score.shape == (B, Hkv, C)
    has_new, any_t = new_k is not None, ring_k  # absent inputs: any valid pointer
    new_k, new_v, pos = (new_k.contiguous(), new_v.contiguous(), new_pos) if has_new else (any_t, any_t, any_t)
    cand, M, BLOCK_D = cand.contiguous(), H // Hkv * R, triton.next_power_of_2(D)
    _rerank_score_kernel[(B * Hkv, C)](
        host_k, cand, cand_valid.contiguous().view(torch.int8), q_rows.contiguous(), lse_rows.float().contiguous(),
        new_k, pos, keys, score, float(sm_scale), S, C, D, M, R,
        HAS_NEW=has_new, BLOCK_M=triton.next_power_of_2(M), BLOCK_D=BLOCK_D)
    _rerank_pick_kernel[(B * Hkv, C + 1)](
        host_k, host_v, ring_k, ring_v, fetch_idx, fetch_valid.view(torch.int8), cand, keys, score, new_k, new_v, pos,
        S, C, min(ring_k.shape[2] - ring_off, C), D, ring_k.shape[2], ring_off,
        HAS_NEW=has_new, BLOCK_C=triton.next_power_of_2(C), BLOCK_D=BLOCK_D)


def rerank_rows(*args, scratch=None, **kw):
    """The re-ranking transfer on the current stream: the Triton kernels when the ring is on CUDA, else the reference."""
    if args[2].is_cuda:
        rerank_rows_triton(*args, scratch=scratch, **kw)
    else:
        rerank_rows_ref(*args, **kw)


@triton.jit
def _stage_kernel(idx, new_k, new_v, new_pos, s_idx, s_k, s_v, s_pos, K, D, H, n_sb, n_sh, n_sd,
                  valid, rec_idx, rec_valid, RING, OFF,
                  cand, cand_valid, q, lse, s_cand, s_cand_valid, s_q, s_lse, C, M, q_sb, q_sh, q_sr, q_sd,
                  l_sb, l_sh, l_sr, HAS_IDX: tl.constexpr, HAS_NEW: tl.constexpr, HAS_RECORD: tl.constexpr,
                  HAS_RERANK: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr):
    """Grid (B*Hkv,): copy one layer's transfer inputs into the prefetcher's staging buffers, one
    launch on the main stream instead of up to eight copies. new_k/new_v [B,Hkv,1,D] and the query
    rows q [B,Hq,R,D] / lse [B,Hq,R] are read through their strides (slices of the step's tensors:
    no .contiguous() copies); kv head bh's query rows are heads bh*G .. bh*G+G-1, row m = g*R + r.
    HAS_RECORD: also record idx and valid in the cache's fetch_idx/fetch_valid [.., RING] from slot OFF."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if HAS_IDX:
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        i = tl.load(idx + bh * K + offs_k, mask=k_ok)
        tl.store(s_idx + bh * K + offs_k, i, mask=k_ok)
        if HAS_RECORD:
            tl.store(rec_idx + bh * RING + OFF + offs_k, i, mask=k_ok)
            tl.store(rec_valid + bh * RING + OFF + offs_k, tl.load(valid + bh * K + offs_k, mask=k_ok), mask=k_ok)
    if HAS_NEW:
        src = b * n_sb + h * n_sh + offs_d * n_sd
        tl.store(s_k + bh * D + offs_d, tl.load(new_k + src, mask=d_ok), mask=d_ok)
        tl.store(s_v + bh * D + offs_d, tl.load(new_v + src, mask=d_ok), mask=d_ok)
        if bh == 0:
            tl.store(s_pos, tl.load(new_pos))
    if HAS_RERANK:
        offs_c = tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        tl.store(s_cand + bh * C + offs_c, tl.load(cand + bh * C + offs_c, mask=c_ok), mask=c_ok)
        tl.store(s_cand_valid + bh * C + offs_c, tl.load(cand_valid + bh * C + offs_c, mask=c_ok), mask=c_ok)
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        head, r = h * (M // R) + offs_m // R, offs_m % R
        q_src = (b * q_sb + head * q_sh + r * q_sr)[:, None] + offs_d[None, :] * q_sd
        md = m_ok[:, None] & d_ok[None, :]
        tl.store(s_q + (bh * M + offs_m)[:, None] * D + offs_d[None, :], tl.load(q + q_src, mask=md), mask=md)
        tl.store(s_lse + bh * M + offs_m, tl.load(lse + b * l_sb + head * l_sh + r * l_sr, mask=m_ok), mask=m_ok)


def record_rows(idx, valid, fetch_idx, fetch_valid, off):
    """Which positions the ring's slots [off, ..) will hold: fetch_idx/fetch_valid [B,Hkv,off+k]."""
    fetch_idx[:, :, off:] = idx
    fetch_valid[:, :, off:] = valid


def stage_triton(idx, new_k, new_v, new_pos, s_idx, s_k, s_v, s_pos, rerank=None, s_rerank=None, record=None):
    B, H, K = s_idx.shape
    D = s_k.shape[-1]
    any_t = s_idx
    if record is not None:
        valid, fetch_idx, fetch_valid, off = record
        assert idx is not None and fetch_idx.is_contiguous() and fetch_valid.is_contiguous()
        rec = (valid.contiguous().view(torch.int8), fetch_idx, fetch_valid.view(torch.int8), fetch_idx.shape[2], off)
    else:
        rec = (any_t,) * 3 + (0, 0)
    if rerank is not None:
        cand, cand_valid, q, lse = rerank
        s_cand, s_cand_valid, s_q, s_lse = s_rerank
        C, (R, M) = cand.shape[2], (q.shape[2], q.shape[1] // H * q.shape[2])
        assert cand.is_contiguous() and cand_valid.is_contiguous() and q.dtype == s_q.dtype and lse.dtype == s_lse.dtype
        rr = (cand, cand_valid.view(torch.int8), q, lse, s_cand, s_cand_valid.view(torch.int8), s_q, s_lse, C, M,
              *q.stride(), *lse.stride())
    else:
        R, C, M = 1, 1, 1
        rr = (any_t,) * 8 + (1, 1) + (0,) * 7
    n_strides = (new_k.stride(0), new_k.stride(1), new_k.stride(3)) if new_k is not None else (0, 0, 0)
    assert new_k is None or new_v.stride() == new_k.stride()
    _stage_kernel[(B * H,)](idx.contiguous() if idx is not None else any_t,
                            new_k if new_k is not None else any_t, new_v if new_v is not None else any_t,
                            new_pos if new_pos is not None else any_t, s_idx, s_k, s_v, s_pos, K, D, H, *n_strides,
                            *rec, *rr, HAS_IDX=idx is not None, HAS_NEW=new_k is not None,
                            HAS_RECORD=record is not None, HAS_RERANK=rerank is not None, R=R,
                            BLOCK_K=triton.next_power_of_2(K), BLOCK_D=triton.next_power_of_2(D),
                            BLOCK_C=triton.next_power_of_2(C), BLOCK_M=triton.next_power_of_2(M))


def stage(idx, new_k, new_v, new_pos, s_idx, s_k, s_v, s_pos, rerank=None, s_rerank=None, record=None):
    """s_* = the transfer's inputs (staging buffers of one layer), on the current stream; with
    re-ranking also rerank = (candidates, their validity, query rows, lse) into s_rerank; with
    record = (valid, fetch_idx, fetch_valid, off), idx and valid into the cache's fetch_idx/fetch_valid."""
    if s_idx.is_cuda:
        return stage_triton(idx, new_k, new_v, new_pos, s_idx, s_k, s_v, s_pos, rerank, s_rerank, record)
    if record is not None:
        record_rows(idx, *record)
    if idx is not None:
        s_idx.copy_(idx)
    if new_k is not None:
        s_k.copy_(new_k)
        s_v.copy_(new_v)
        s_pos.copy_(new_pos.reshape(()))
    for dst, src in zip(s_rerank or (), rerank or ()):
        dst.copy_(src)


# =============================================================================================
# custom ops: what a compiled step calls on the async path (opaque to torch.compile)
# =============================================================================================
# They "mutate" each layer's registered buffers (the ring, fetch_idx, fetch_valid), which the
# transfer writes; that orders them against the attention that reads those buffers inside one
# fullgraph step; join mutates every layer's, so no fetch can be scheduled after it.
@torch.library.custom_op("specache::fetch_start", mutates_args=("bufs",))
def _fetch_start_op(bufs: list[Tensor], idx: Optional[Tensor], valid: Optional[Tensor], new_k: Optional[Tensor],
                    new_v: Optional[Tensor], new_pos: Optional[Tensor], pid: int, layer: int) -> None:
    _PREFETCHERS[pid]._start_async(layer, bufs, idx, valid, new_k, new_v, new_pos)


@_fetch_start_op.register_fake
def _(bufs, idx, valid, new_k, new_v, new_pos, pid, layer):
    return None


@torch.library.custom_op("specache::rerank_start", mutates_args=("bufs",))
def _rerank_start_op(bufs: list[Tensor], cand: Tensor, cand_valid: Tensor, q_rows: Tensor, lse_rows: Tensor,
                     new_k: Optional[Tensor], new_v: Optional[Tensor], new_pos: Optional[Tensor], sm_scale: float,
                     pid: int, layer: int) -> None:
    _PREFETCHERS[pid]._start_rerank_async(layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k, new_v,
                                          new_pos)


@_rerank_start_op.register_fake
def _(bufs, cand, cand_valid, q_rows, lse_rows, new_k, new_v, new_pos, sm_scale, pid, layer):
    return None


@torch.library.custom_op("specache::fetch_wait", mutates_args=("bufs",))
def _fetch_wait_op(bufs: list[Tensor], pid: int, layer: int) -> None:
    _PREFETCHERS[pid]._wait_async(layer)


@_fetch_wait_op.register_fake
def _(bufs, pid, layer):
    return None


@torch.library.custom_op("specache::fetch_join", mutates_args=("bufs",))
def _fetch_join_op(bufs: list[Tensor], pid: int) -> None:
    _PREFETCHERS[pid]._join_async()


@_fetch_join_op.register_fake
def _(bufs, pid):
    return None


def keep_sink_rows(bufs: list[Tensor], k: Tensor, v: Tensor, first: Tensor, n: int) -> None:
    """Where `first` (0-d bool: the first block was just quantized), copy the first n rows of
    k, v [B,H,>=n,D] into ring slots [0, n) and mark them valid. bufs: [ring_k, ring_v, fetch_valid]."""
    ring_k, ring_v, valid = bufs
    for ring, x in ((ring_k, k), (ring_v, v)):
        ring[:, :, :n] = torch.where(first, x[:, :, :n].to(ring.dtype), ring[:, :, :n])
    valid[:, :, :n] |= first


# A graph that wrote the ring itself would hand the transfer ops a functionalized copy of it
# (seen on an H100 with sink4: the ring check fired), so on the async path this write is an op too.
@torch.library.custom_op("specache::keep_sinks", mutates_args=("bufs",))
def _keep_sinks_op(bufs: list[Tensor], k: Tensor, v: Tensor, first: Tensor, n: int) -> None:
    keep_sink_rows(bufs, k, v, first, n)


@_keep_sinks_op.register_fake
def _(bufs, k, v, first, n):
    return None


# =============================================================================================
# the prefetcher
# =============================================================================================
class Prefetcher:
    def __init__(self, n_layers, batch, n_kv_heads, max_seq_len, head_dim, k, dtype, device, impl="uva",
                 join_each_step=True, async_ops=None, key_rows=None, select_rows=None):
        if impl not in ("uva", "staged"):
            raise ValueError(f"unknown fetch impl {impl!r} (uva, staged)")
        device = torch.device(device)
        self.device, self.impl, self.k, self.join_each_step = device, impl, k, join_each_step
        self.key_rows = k if key_rows is None else key_rows  # keys read per layer and kv head (re-ranking: N*k candidates)
        self.select_rows = select_rows  # re-ranking: (query heads, tokens) of the selecting query, staged per layer
        self.n_layers = n_layers
        self.on_cuda = device.type == "cuda"
        self.async_ops = self.on_cuda if async_ops is None else async_ops
        shape = (n_layers, batch, n_kv_heads, max_seq_len, head_dim)
        host = dict(dtype=dtype, device="cpu", pin_memory=True) if self.on_cuda else dict(dtype=dtype, device=device)
        self.host_k, self.host_v = torch.zeros(shape, **host), torch.zeros(shape, **host)
        self.rings = [None] * n_layers  # [ring_k, ring_v, ...]: what the side stream writes, per layer
        self.ring_off = 0
        self.rerank_scratch = None  # re-ranking's device scratch (CUDA), one for all layers: they run in turn
        if self.on_cuda and select_rows is not None:
            self.rerank_scratch = rerank_scratch(batch, n_kv_heads, self.key_rows, head_dim, dtype, device)
        self.pid = next(_ids)
        _PREFETCHERS[self.pid] = self
        if self.async_ops:
            self._setup_async()

    def _setup_async(self):
        """Side stream, events and the staging buffers the side stream reads."""
        L, B, H, _, D = self.host_k.shape
        dt, dev = self.host_k.dtype, self.device
        self.stage_idx = torch.zeros(L, B, H, self.k, dtype=torch.int64, device=dev)
        self.stage_k = torch.zeros(L, B, H, 1, D, dtype=dt, device=dev)
        self.stage_v = torch.zeros(L, B, H, 1, D, dtype=dt, device=dev)
        self.stage_pos = torch.zeros(L, dtype=torch.int64, device=dev)
        if self.select_rows is not None:  # re-ranking on the side stream: the candidates and who scores them
            Hq, R = self.select_rows
            self.stage_cand = torch.zeros(L, B, H, self.key_rows, dtype=torch.int64, device=dev)
            self.stage_cand_valid = torch.zeros(L, B, H, self.key_rows, dtype=torch.bool, device=dev)
            self.stage_q = torch.zeros(L, B, Hq, R, D, dtype=dt, device=dev)
            self.stage_lse = torch.zeros(L, B, Hq, R, dtype=torch.float32, device=dev)
        self.dm = torch.get_device_module(dev.type)
        self.side = self.dm.Stream(device=dev) if self.on_cuda else self.dm.Stream()
        self.consumed = [self.dm.Event() for _ in range(L)]
        self.fetched = [self.dm.Event() for _ in range(L)]
        if self.impl == "staged" and self.on_cuda:
            self.staging_k = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)
            self.staging_v = torch.zeros(B, H, self.k, D, dtype=dt, pin_memory=True)

    def register_ring(self, layer, ring_k, ring_v, off=0, index_bufs=()):
        """The layer's ring: slots [off, off + k) receive the fetched rows (before off: rows the
        cache keeps on the device itself, attention sinks). index_bufs = (fetch_idx, fetch_valid):
        which positions the slots hold, recorded by the transfer (re-ranking: by the side stream)."""
        self.rings[layer] = [ring_k, ring_v, *index_bufs]
        self.ring_off = off

    # ---- accounting ----------------------------------------------------------------------------
    def host_bytes_per_layer(self) -> int:
        return (self.host_k.nbytes + self.host_v.nbytes) // self.host_k.shape[0]

    def bytes_per_step(self) -> int:
        """Bytes moved host -> device by one decode step, every layer and kv head: k rows of K and V
        (re-ranking: key_rows candidate keys and k values)."""
        return sum(bufs[0][:, :, :1].nbytes * (self.key_rows + self.k) for bufs in self.rings if bufs is not None)

    # ---- prefill: Algorithm 1's offload (eager) --------------------------------------------------
    def offload(self, layer, k, v, input_pos):
        """Copy a prefill chunk's fp K/V [B,Hkv,T,D] to host positions input_pos (contiguous)."""
        p0, T = int(input_pos[0]), k.shape[2]
        self.host_k[layer, :, :, p0:p0 + T].copy_(k, non_blocking=self.on_cuda)
        self.host_v[layer, :, :, p0:p0 + T].copy_(v, non_blocking=self.on_cuda)

    def host_prefix(self, layer, p0):
        """fp K/V of positions [0, p0) on the device, for a later prefill chunk's exact attention."""
        return (self.host_k[layer, :, :, :p0].to(self.device, non_blocking=True),
                self.host_v[layer, :, :, :p0].to(self.device, non_blocking=True))

    def host_keys(self, layer):
        """All host keys of a layer on the device (oracle fetch and the fetch probe only)."""
        return self.host_k[layer].to(self.device, non_blocking=True)

    def host_values(self, layer):
        return self.host_v[layer].to(self.device, non_blocking=True)

    # ---- decode ----------------------------------------------------------------------------------
    def start(self, layer, bufs, idx=None, valid=None, new_k=None, new_v=None, new_pos=None):
        """Write the real token's K/V [B,Hkv,1,D] to host row new_pos (a 0-d device tensor) and fetch
        host rows idx [B,Hkv,k] into the ring, asynchronously on the async path. bufs: the layer's
        registered [ring_k, ring_v] or [ring_k, ring_v, fetch_idx, fetch_valid]; with the latter, idx
        and valid (real rows) are recorded there (record_rows; on the async path by the main stream's
        staging launch, so the compiled step has no copy kernels of its own for them)."""
        if self.async_ops:
            torch.ops.specache.fetch_start(bufs, idx, valid, new_k, new_v, new_pos, self.pid, layer)
        else:
            record = self._record(bufs, idx, valid)
            if record is not None:
                record_rows(idx, *record)
            self._transfer(layer, bufs[0], bufs[1], idx, new_k, new_v, new_pos)

    def _record(self, bufs, idx, valid):
        """record_rows' arguments after idx, or None when there is nothing to record."""
        return (valid, *bufs[2:], self.ring_off) if idx is not None and len(bufs) > 2 else None

    def start_rerank(self, layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k=None, new_v=None,
                     new_pos=None):
        """`start` for re-ranking: of the candidate rows cand [B,Hkv,N*k] (cand_valid: real ones),
        fetch the k whose fp keys score best for the selecting query rows q_rows [B,H,R,D] (lse_rows
        [B,H,R]: their softmax normalizers), and record them in the layer's fetch_idx/fetch_valid.
        bufs: the layer's registered [ring_k, ring_v, fetch_idx, fetch_valid]."""
        if self.async_ops:
            torch.ops.specache.rerank_start(bufs, cand, cand_valid, q_rows, lse_rows, new_k, new_v, new_pos,
                                            float(sm_scale), self.pid, layer)
        else:
            self._rerank(layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k, new_v, new_pos)

    def wait(self, layer, bufs, now=False):
        """The main stream waits for this layer's fetch only (bufs: what it writes, see register_ring):
        on the async path without step joins, or always with `now` (a fetch the same step needs)."""
        if self.async_ops and (now or not self.join_each_step):
            torch.ops.specache.fetch_wait(bufs, self.pid, layer)

    def keep_sinks(self, bufs, k, v, first, n):
        """The attention sinks' fp rows into the ring's first n slots (keep_sink_rows)."""
        if self.async_ops:
            torch.ops.specache.keep_sinks(bufs, k, v, first, n)
        else:
            keep_sink_rows(bufs, k, v, first, n)

    def end_step(self):
        """Called by the last layer: join the side stream (see the module docstring)."""
        if self.async_ops and self.join_each_step:
            torch.ops.specache.fetch_join([t for bufs in self.rings for t in bufs], self.pid)

    def _append_host(self, layer, k, v, pos):
        # CPU, compiled: index_put_ on the whole store, not on the view host_k[layer]: a mutated
        # view of a graph input makes functionalization copy the entire base every step.
        B, H = k.shape[:2]
        index = (torch.tensor(layer, device=k.device), torch.arange(B, device=k.device)[:, None],
                 torch.arange(H, device=k.device)[None, :], pos.reshape(()))
        self.host_k.index_put_(index, k[:, :, 0])
        self.host_v.index_put_(index, v[:, :, 0])

    def _rerank(self, layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k, new_v, new_pos):
        """Re-ranking and its transfer, on the current stream (the side stream on the async path)."""
        if not self.on_cuda and new_k is not None:  # (the Triton kernel writes the token itself)
            self._append_host(layer, new_k, new_v, new_pos)
            new_k = new_v = new_pos = None
        rerank_rows(self.host_k[layer], self.host_v[layer], *bufs, cand, cand_valid, q_rows, lse_rows, sm_scale,
                    new_k, new_v, new_pos, self.ring_off, scratch=self.rerank_scratch)

    def _transfer(self, layer, ring_k, ring_v, idx, new_k, new_v, new_pos):
        """The transfer itself, on the current stream (re-ranking's, `_rerank`, reads over UVA with
        either impl)."""
        if not self.on_cuda:
            if new_k is not None:
                self._append_host(layer, new_k, new_v, new_pos)
            if idx is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, idx, None, None, None,
                                  self.ring_off)
        elif self.impl == "uva":
            transfer_rows(self.host_k[layer], self.host_v[layer], ring_k, ring_v, idx, new_k, new_v, new_pos,
                          self.ring_off)
        else:  # staged: indices to the host (one sync: eager only), gather, one non_blocking copy
            if new_k is not None:
                transfer_rows_ref(self.host_k[layer], self.host_v[layer], ring_k, ring_v, None, new_k, new_v, new_pos)
            if idx is not None:
                idx_host = idx.to("cpu")
                pairs = ((self.host_k, self.staging_k, ring_k), (self.host_v, self.staging_v, ring_v))
                for host, staging, ring in pairs:
                    torch.gather(host[layer], 2, idx_host[..., None].expand_as(staging), out=staging)
                    ring[:, :, self.ring_off:].copy_(staging, non_blocking=True)

    # ---- the async path (run by the custom ops) ----------------------------------------------------
    def _check_ring(self, layer, bufs):
        mine = self.rings[layer]
        if mine is None or [t.data_ptr() for t in bufs] != [t.data_ptr() for t in mine[:len(bufs)]]:
            raise RuntimeError(f"fetch for layer {layer} was handed a copy of its ring, not the ring buffer itself "
                               "(a compiled graph must pass module buffers through unchanged): the side stream "
                               "would write memory the graph frees")

    def _main(self):
        return self.dm.current_stream(self.device) if self.on_cuda else self.dm.current_stream()

    def _run_side(self, layer, work):
        """work() on the side stream, after the main stream's staging (consumed[layer])."""
        self.consumed[layer].record(self._main())
        self.side.wait_event(self.consumed[layer])  # the layer's buffers are free, staging is written
        with self.dm.stream(self.side):
            work()
            self.fetched[layer].record(self.side)

    def _staged(self, layer, idx, new_k, new_v, new_pos, rerank=None, record=None):
        # Stage the inputs on the main stream: they may be temporaries the graph reuses right after.
        s_rerank = (self.stage_cand[layer], self.stage_cand_valid[layer], self.stage_q[layer],
                    self.stage_lse[layer]) if rerank is not None else None
        if idx is not None or new_k is not None or rerank is not None:
            stage(idx, new_k, new_v, new_pos, self.stage_idx[layer], self.stage_k[layer], self.stage_v[layer],
                  self.stage_pos[layer], rerank, s_rerank, record)
        s_idx = self.stage_idx[layer] if idx is not None else None
        s_new = (self.stage_k[layer], self.stage_v[layer], self.stage_pos[layer]) if new_k is not None \
            else (None, None, None)
        return s_idx, s_new, s_rerank

    def _start_async(self, layer, bufs, idx, valid, new_k, new_v, new_pos):
        self._check_ring(layer, bufs)
        s_idx, s_new, _ = self._staged(layer, idx, new_k, new_v, new_pos, record=self._record(bufs, idx, valid))
        self._run_side(layer, lambda: self._transfer(layer, bufs[0], bufs[1], s_idx, *s_new))

    def _start_rerank_async(self, layer, bufs, cand, cand_valid, q_rows, lse_rows, sm_scale, new_k, new_v, new_pos):
        self._check_ring(layer, bufs)
        _, s_new, staged = self._staged(layer, None, new_k, new_v, new_pos, (cand, cand_valid, q_rows, lse_rows))
        self._run_side(layer, lambda: self._rerank(layer, bufs, *staged, sm_scale, *s_new))

    def _wait_async(self, layer):
        self._main().wait_event(self.fetched[layer])

    def _join_async(self):
        self._main().wait_stream(self.side)
