"""The selection in one launch (Algorithm 3's ArgTopK): kernels.select_ref's top-k of the logits the attention
kernel wrote, and what the transfer needs (the ring layout, staged inputs). prefetch.Prefetcher runs it on CUDA.
"""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from gpu.tiles import LOG2E

Tensor = torch.Tensor

# ---- radix selection, 8 bits a round (FlashInfer's top_k, Quest's RAFT select), in one launch ----
# A score p >= 0 has the key bits(p) + 1 (the fp32 bits of a non-negative float order as integers); a position
# that is no candidate has key 0. Keys fit 31 bits, so int32 shifts never sign-extend. Round r histograms digit
# r of the keys whose higher digits are the k-th largest key's; rounds stop as soon as the k-th key's bucket is
# taken whole. Then one scan in position order takes every key above the prefix and the first ties on it.
# Keys rank by (key, then the lower position): a total order, so a kv head's top k lies within the union of its
# position slices' own top k. The launch is a grid of slices, the slice index fastest (a head's slices run side
# by side and its merge starts while later heads' slices still run): each program holds its slice's keys in
# registers and writes its k candidates; the last of a head's programs to finish (a ticket counter) picks the k
# of the live slices' candidates, also from registers. Slices at or past the quantized length only take a ticket.
RADIX = tl.constexpr(256)
MAX_SLICES = 128  # a head's slices: its candidates for the last program are n_slices * k


@triton.jit
def _radix_key(score, ok):
    bits = tl.minimum(score.to(tl.int32, bitcast=True), 0x7F800000)  # (NaN ranks as +inf)
    return tl.where(ok, bits + 1, 0)


@triton.jit
def _bucket(h, need):
    """Histogram h [RADIX] -> (the bucket holding the need-th largest key, how many of that bucket's keys
    are among the need largest, how many keys it holds)."""
    bins = tl.arange(0, RADIX)
    above = tl.sum(h, 0) - tl.cumsum(h, 0)  # keys in higher buckets
    b = tl.max(tl.where((above < need) & (above + h >= need), bins, 0), 0)
    at = bins == b
    return b, need - tl.sum(tl.where(at, above, 0), 0), tl.sum(tl.where(at, h, 0), 0)


@triton.jit
def _kth_prefix(key, inn, K):
    """The radix rounds over a register tile of keys (entries where inn; at least K of them) -> (prefix, shift,
    need): the K largest keys are those whose bits above `shift` exceed prefix, and the first `need` equal to it."""
    prefix, need, count = _bucket(tl.histogram(key >> 24, RADIX, mask=inn), K)
    shift = prefix * 0 + 24
    for r in tl.static_range(1, 4):
        if count > need:  # the k-th key's bucket is not taken whole: its next 8 bits decide
            hist = tl.histogram((key >> (24 - 8 * r)) & 255, RADIX, mask=inn & ((key >> (32 - 8 * r)) == prefix))
            digit, need, count = _bucket(hist, need)
            prefix = (prefix << 8) | digit
            shift = shift * 0 + (24 - 8 * r)
    return prefix, shift, need


@triton.jit
def _take_in_order(key, inn, prefix, shift, need, K):
    """-> (put, slot): the entries of the tile taken (every key above the prefix and the first `need` on it, in
    tile order) and their output slots 0..K-1. One scan counts both (above in the low 16 bits, ties in the high:
    tiles hold fewer than 2^16 entries); the ties taken before an entry are min(ties, need)."""
    above = (((key >> shift) > prefix) & inn).to(tl.int32)
    tie = (((key >> shift) == prefix) & inn).to(tl.int32)
    both = above + (tie << 16)
    before = tl.cumsum(both, 0) - both
    take = (above != 0) | ((tie != 0) & ((before >> 16) < need))
    slot = (before & 0xFFFF) + tl.minimum(before >> 16, need)
    return take & (slot < K), slot  # (exactly K are taken: a guard)


@triton.jit
def _select_kernel(logits, lse, l_sb, l_sh, l_sr, n_quant_ptr, row_start, cand_key, cand_pos, counters, where, work, sel_idx,
                   sel_ok, S, N_SLICES, K, FIRST, G, Hkv, BH, fetch_idx, fetch_valid, slot_rows, RING, OFF, keep_rows,
                   q, q_sb, q_sh, q_sr, q_sd, s_q, s_lse, new_k, new_v, n_sb, n_sh, n_sd, new_pos, s_k, s_v, s_pos, D,
                   R: tl.constexpr, RS: tl.constexpr, RECORD: tl.constexpr, STAGE_Q: tl.constexpr,
                   HAS_NEW: tl.constexpr, HAS_KEEP: tl.constexpr, SLICE: tl.constexpr, N_CAND: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (N_SLICES, B*Hkv): the k rows of kv head bh that the next step fetches, and what the transfer needs,
    in one launch. Program (s, bh), for a live slice (one that starts below n_quant; slice 0 always): the keys of
    positions [s*SLICE, (s+1)*SLICE) from the logits the attention wrote (score = max_r sum_g 2^(logit - lse),
    select_ref; candidates from FIRST past the row's first real slot, row_start[b]), its K largest in position
    order to cand_key/cand_pos. Every program then takes a ticket; the
    head's last: the K largest of the live slices' candidates, in position order, to sel_idx/sel_ok, and then
    RECORD (the plain transfer): lay them out in the ring as prefetch.record_rows does (a row the ring holds keeps
    its slot; the others take the freed slots in order) into fetch_idx/fetch_valid [.., RING] from slot OFF, and
    give the transfer its host row per ring slot, slot_rows (-1: keep); `where` [BH, S] is its scratch. STAGE_Q
    (re-ranking, whose candidates are sel_idx/sel_ok): the query rows and their lse, RS rows a head from the R
    tokens, into s_q/s_lse. HAS_NEW: the step's token new_k/new_v and new_pos into s_k/s_v/s_pos. The staged
    inputs are what the side stream reads: the step's own tensors are graph temporaries. HAS_KEEP: a batch row
    with keep_rows[b] set selects what its ring's slots [OFF, RING) hold (prefetch.held_selection), so its ring
    stays as it is.
    counters [2, BH]: row 0 the tickets, zero between launches (the last program resets its head's); row 1 counts
    the launches in which a head's tickets were not exactly its N_SLICES (a counter found non-zero or lost)."""
    sl = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // Hkv, bh % Hkv
    hi = tl.minimum(tl.load(n_quant_ptr), S)
    n_live = tl.maximum(tl.cdiv(hi, SLICE), 1)
    heads_cand = bh * N_SLICES * K
    if sl < n_live:
        pos = sl * SLICE + tl.arange(0, SLICE)
        ok = (pos >= FIRST + tl.load(row_start + b)) & (pos < hi)
        row = logits + bh * G * R * S + pos
        best = tl.zeros([SLICE], tl.float32)
        for r in tl.static_range(R):  # the best of the R selecting tokens of the sum over the G query heads
            acc = tl.zeros([SLICE], tl.float32)
            for g in range(G):
                lse_m = tl.load(lse + b * l_sb + (h * G + g) * l_sh + r * l_sr) * LOG2E
                acc += tl.exp2(tl.load(row + (g * R + r) * S, mask=ok, other=-float("inf")) - lse_m)
            best = tl.maximum(best, acc)
        key = _radix_key(best, ok)
        every = pos >= 0  # (every position of the slice is an entry: non-candidates with key 0)
        prefix, shift, need = _kth_prefix(key, every, K)
        put, slot = _take_in_order(key, every, prefix, shift, need, K)
        tl.store(cand_key + heads_cand + sl * K + slot, key, mask=put)
        tl.store(cand_pos + heads_cand + sl * K + slot, pos, mask=put)
    tl.debug_barrier()  # (every thread's candidates stored before the ticket releases them)
    ticket = tl.atomic_add(counters + bh, 1, sem="acq_rel")
    if ticket >= N_SLICES:  # a counter left non-zero by an earlier launch
        tl.atomic_add(counters + BH + bh, 1)
    if ticket == N_SLICES - 1:  # the head's last slice: pick from the live slices' candidates
        tl.debug_barrier()
        i = tl.arange(0, N_CAND)
        inn = i < n_live * K
        ck = tl.load(cand_key + heads_cand + i, mask=inn, other=0, cache_modifier=".cg")
        cp = tl.load(cand_pos + heads_cand + i, mask=inn, other=0, cache_modifier=".cg")
        prefix, shift, need = _kth_prefix(ck, inn, K)
        put, slot = _take_in_order(ck, inn, prefix, shift, need, K)
        tl.store(sel_idx + bh * K + slot, cp.to(tl.int64), mask=put)
        tl.store(sel_ok + bh * K + slot, (ck > 0).to(tl.int8), mask=put)
        if tl.atomic_xchg(counters + bh, 0) != N_SLICES:  # (tickets drawn this launch, before the reset)
            tl.atomic_add(counters + BH + bh, 1)
        offs_k = tl.arange(0, BLOCK_K)
        if HAS_KEEP:
            if tl.load(keep_rows + b) != 0:
                tl.debug_barrier()  # (after the merge's stores to the same entries)
                c_ok = offs_k < K
                held = c_ok & (offs_k < RING - OFF)
                tl.store(sel_idx + bh * K + offs_k, tl.load(fetch_idx + bh * RING + OFF + offs_k, mask=held, other=0),
                         mask=c_ok)
                tl.store(sel_ok + bh * K + offs_k, tl.load(fetch_valid + bh * RING + OFF + offs_k, mask=held, other=0),
                         mask=c_ok)
        if RECORD:
            _record(where + bh * S, work + bh * 2 * BLOCK_K, sel_idx + bh * K, sel_ok + bh * K,
                    fetch_idx + bh * RING + OFF, fetch_valid + bh * RING + OFF, slot_rows + bh * K, offs_k, K, S)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        if STAGE_Q:  # query row m = g*RS + r of the kv head, from selecting token r % R
            offs_m = tl.arange(0, BLOCK_M)
            m_ok = offs_m < G * RS
            head, tok = h * G + offs_m // RS, offs_m % RS % R
            src = (b * q_sb + head * q_sh + tok * q_sr)[:, None] + offs_d[None, :] * q_sd
            md = m_ok[:, None] & d_ok[None, :]
            tl.store(s_q + (bh * G * RS + offs_m)[:, None] * D + offs_d[None, :], tl.load(q + src, mask=md), mask=md)
            tl.store(s_lse + bh * G * RS + offs_m, tl.load(lse + b * l_sb + head * l_sh + tok * l_sr, mask=m_ok),
                     mask=m_ok)
        if HAS_NEW:
            src = b * n_sb + h * n_sh + offs_d * n_sd
            tl.store(s_k + bh * D + offs_d, tl.load(new_k + src, mask=d_ok), mask=d_ok)
            tl.store(s_v + bh * D + offs_d, tl.load(new_v + src, mask=d_ok), mask=d_ok)
            if bh == 0:
                tl.store(s_pos, tl.load(new_pos))


@triton.jit
def _record(where, work, sel_idx, sel_ok, fetch_idx, fetch_valid, slot_rows, offs_k, K, S):
    """prefetch.record_rows for one kv head in O(k): `where` (scratch) maps a position to the ring slot that
    holds it, checked against fetch_idx (entries the map never set hold garbage); `work` [2, BLOCK_K]
    holds which slots keep their row, then the free slots in order."""
    kept, free_list = work, work + offs_k.shape[0]
    k_ok = offs_k < K
    tl.debug_barrier()  # (the selection's stores, read back below by other threads)
    old = tl.load(fetch_idx + offs_k, mask=k_ok, other=-1)
    old_ok = k_ok & (tl.load(fetch_valid + offs_k, mask=k_ok, other=0) != 0) & (old >= 0) & (old < S)
    tl.store(where + old, offs_k, mask=old_ok)
    tl.store(kept + offs_k, offs_k * 0, mask=k_ok)
    tl.debug_barrier()
    pos = tl.load(sel_idx + offs_k, mask=k_ok, other=0)
    ok = k_ok & (tl.load(sel_ok + offs_k, mask=k_ok, other=0) != 0)
    slot = tl.load(where + pos, mask=ok, other=-1)
    ok_slot = ok & (slot >= 0) & (slot < K)
    held = ok_slot & (tl.load(fetch_idx + slot, mask=ok_slot, other=-1) == pos) & \
        (tl.load(fetch_valid + slot, mask=ok_slot, other=0) != 0)
    tl.store(kept + slot, slot * 0 + 1, mask=held)
    tl.debug_barrier()
    free = k_ok & (tl.load(kept + offs_k, mask=k_ok, other=1) == 0)
    free_i = free.to(tl.int32)
    tl.store(free_list + tl.cumsum(free_i, 0) - free_i, offs_k, mask=free)
    tl.store(fetch_idx + offs_k, pos * 0, mask=free)  # a freed slot holds nothing unless a new row lands there
    tl.store(fetch_valid + offs_k, tl.zeros_like(free_i).to(tl.int8), mask=free)
    tl.store(slot_rows + offs_k, pos * 0 - 1, mask=k_ok)
    tl.debug_barrier()
    miss = ok & ~held
    miss_i = miss.to(tl.int32)
    to = tl.load(free_list + tl.cumsum(miss_i, 0) - miss_i, mask=miss, other=0)
    tl.store(fetch_idx + to, pos, mask=miss)
    tl.store(fetch_valid + to, miss_i.to(tl.int8), mask=miss)
    tl.store(slot_rows + to, pos, mask=miss)


def select_counters(batch: int, n_kv_heads: int, device) -> Tensor:
    """The selection's counters [2, batch * n_kv_heads] int32 (_select_kernel: the tickets, zero between
    launches, and the faults), made once by their owner (the Prefetcher, when it is built). Not allocated by
    the launch: a CUDA graph's first call allocates from the graph's pool, whose blocks other temporaries reuse,
    and a ticket counter must keep its zero across replays. Selections sharing them run one at a time (the
    step's stream)."""
    return torch.zeros(2, batch * n_kv_heads, dtype=torch.int32, device=device)


def slices(S: int, k: int, slice_len: Optional[int] = None) -> tuple[int, int]:
    """-> (slice length, slices) of the one-launch selection over S positions. A slice costs its length, the
    merge n_slices * k: both near sqrt(S * k) by default, a power of two, at least 4x the (padded) k (the
    candidates at most a quarter of the positions), at most MAX_SLICES slices."""
    kp = triton.next_power_of_2(k)
    length = slice_len or triton.next_power_of_2(math.isqrt(S * kp - 1) + 1)
    length = max(triton.next_power_of_2(length), 4 * kp, triton.next_power_of_2(triton.cdiv(S, MAX_SLICES)), 16)
    length = min(length, max(4 * kp, triton.next_power_of_2(S)))
    return length, triton.cdiv(S, length)


def select_triton(logits, lse_rows, n_quant, k: int, first: int = 0, out=None, record=None, stage_q=None, token=None,
                  counters=None, slice_len: Optional[int] = None, row_start=None, keep=None):
    """select_ref in one launch (_select_kernel), -> (idx, valid) [B,Hkv,k]; `out`: where to write them
    (re-ranking: its staged candidates). record = (fetch_idx, fetch_valid, off, slot_rows): lay the rows out in
    the ring and give the transfer its host rows (record_rows); stage_q = (q_rows [B,H,R',D], s_q [B,H,RS,D],
    s_lse [B,H,RS]); token = (new_k, new_v, new_pos, s_k, s_v, s_pos). Strided inputs are read in place.
    counters: select_counters' buffer for this batch (None: a fresh one, for a launch no graph replays).
    slice_len: positions a program scans (default: slices'). row_start [B]: each row's first real slot (None: 0).
    keep = (keep_rows [B] bool, fetch_idx, fetch_valid, off): the rows whose ring stays (held_selection)."""
    B, Hkv, GR, S = logits.shape
    H, R = lse_rows.shape[1:]
    G, BH, dev = H // Hkv, B * Hkv, logits.device
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    assert logits.is_contiguous() and GR == G * R
    length, n_slices = slices(S, k, slice_len)
    BLOCK_K = triton.next_power_of_2(k)
    if counters is None:
        counters = select_counters(B, Hkv, dev)
    if row_start is None:
        row_start = torch.zeros(B, dtype=torch.int64, device=dev)
    assert counters.shape == (2, BH) and counters.dtype == torch.int32 and counters.is_contiguous()
    cand_key = torch.empty(BH, n_slices * k, dtype=torch.int32, device=dev)
    cand_pos = torch.empty(BH, n_slices * k, dtype=torch.int32, device=dev)
    idx, ok = out if out is not None else (torch.empty(B, Hkv, k, dtype=torch.long, device=dev),
                                           torch.empty(B, Hkv, k, dtype=torch.bool, device=dev))
    assert idx.is_contiguous() and ok.is_contiguous() and idx.shape == ok.shape == (B, Hkv, k)
    any_t = cand_key  # absent inputs: any valid pointer
    fetch_idx, fetch_valid, off, slot_rows = record if record is not None else (any_t, any_t, 0, any_t)
    keep_rows = any_t
    if keep is not None:
        keep_rows, k_idx, k_valid, k_off = keep
        assert record is None or (k_idx is fetch_idx and k_off == off)
        fetch_idx, fetch_valid, off, keep_rows = k_idx, k_valid, k_off, keep_rows.view(torch.int8)
    where, work = any_t, any_t
    if keep is not None or record is not None:
        assert fetch_idx.is_contiguous() and fetch_valid.is_contiguous()
        fetch_valid = fetch_valid.view(torch.int8)
    if record is not None:
        assert slot_rows.shape == (B, Hkv, k)
        where = torch.empty(BH, S, dtype=torch.int32, device=dev)
        work = torch.empty(BH, 2, BLOCK_K, dtype=torch.int32, device=dev)
    q, s_q, s_lse = stage_q if stage_q is not None else (any_t, any_t, any_t)
    q_strides, RS = (q.stride(), s_q.shape[2]) if stage_q is not None else ((0,) * 4, 1)
    new_k, new_v, new_pos, s_k, s_v, s_pos = token if token is not None else (any_t,) * 6
    new_strides = (new_k.stride(0), new_k.stride(1), new_k.stride(3)) if token is not None else (0,) * 3
    assert token is None or new_v.stride() == new_k.stride()
    D = s_k.shape[-1] if token is not None else s_q.shape[-1] if stage_q is not None else 1
    _select_kernel[(n_slices, BH)](
        logits, lse_rows, *lse_rows.stride(), n_quant, row_start, cand_key, cand_pos, counters, where, work, idx,
        ok.view(torch.int8), S, n_slices, k, first, G, Hkv, BH, fetch_idx, fetch_valid, slot_rows,
        fetch_idx.shape[-1] if record is not None or keep is not None else 0, off, keep_rows,
        q, *q_strides, s_q, s_lse, new_k, new_v, *new_strides, new_pos, s_k, s_v, s_pos, D,
        R=R, RS=RS, RECORD=record is not None, STAGE_Q=stage_q is not None, HAS_NEW=token is not None,
        HAS_KEEP=keep is not None, SLICE=length,
        N_CAND=triton.next_power_of_2(n_slices * k), BLOCK_K=BLOCK_K, BLOCK_M=max(2, triton.next_power_of_2(G * RS)),
        BLOCK_D=triton.next_power_of_2(D), num_warps=select_warps(length))
    return idx, ok


def select_warps(slice_len: int) -> int:
    """Warps of a selection program: about 8 keys a thread in the slice's register tile."""
    return max(4, min(16, slice_len // 256))
