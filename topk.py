"""Which quantized positions' fp16 rows to fetch (SpeCache §3.3, Algorithm 3's ArgTopK).

  select_ref / select_triton  the k positions with the largest attention probability under the selecting
                token(s), from the logits the attention kernel wrote while it attended (kernels.py: the
                quantized slots' low-bit scores, the fetched rows' exact ones, the residual's): the
                probability summed over the query heads that share a kv head (GQA: one fetch per kv head
                serves them all), the best of the selecting tokens. The Triton kernel is one launch per
                layer: the radix selection, and what the transfer needs (the ring layout, staged inputs).
  topk_lowbit_ref  the same top-k scored from the stored codes (tests and tools/probe.py).
  topk_exact    the top-k from full-precision keys (the oracle fetch, hit rates).

A torch reference beside each Triton kernel; prefetch.Prefetcher runs them (CUDA: Triton; CPU: the references).
"""
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from lowbit import Fetched, LowBitKV, as_rows, fp_row_scores, row_scores
from tiles import LOG2E, best_row

Tensor = torch.Tensor


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def _exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched: Fetched):
    """Algorithm 3 takes ArgTopK of the attention that already used the fetched fp rows: their
    positions get exact scores, so a row that matters keeps its place whatever its low-bit copy
    scores. Invalid fetch slots write back the scratch slot's own value (position S-1 >= n_quant)."""
    S = prob.shape[2]
    exact = fp_row_scores(q_rows, lse_rows, fetched.k, sm_scale)
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return prob.scatter(-1, safe, torch.where(fetched.valid, exact, prob.gather(-1, safe)))


def topk_lowbit_ref(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None,
                    first: int = 0):
    """score[p] = sum over the G query heads of kv head j of exp(sm_scale * q_g . k'_p - lse_g): the
    attention probability kv row p would get, summed over the heads that share it (one fetch per
    kv head serves all G heads); with several query tokens ([B,H,R,D]) the best of them. With
    `fetched`, fetched positions score with their fp rows. Positions below `first` (rows kept in fp
    anyway) or >= n_quant score -1 with index 0. Sorted descending."""
    q_rows, lse_rows = as_rows(q_row, lse_row)
    B, H, R, D = q_rows.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    G = H // Hkv
    prob = row_scores(store.key_logits(q_rows.float().reshape(B, Hkv, G * R, D) * sm_scale), lse_rows, G, R)
    if fetched is not None:
        prob = _exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched)
    pos = torch.arange(S, device=q_row.device)
    valid = (pos >= first) & (pos < store.n_quant)
    score, idx = torch.where(valid, prob, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


def topk_exact(q_row, keys, n_quant, k, sm_scale, first: int = 0):
    """Top-k of quantized positions [first, n_quant) by exact fp attention of q_row [B,H,D] (or
    [B,H,R,D]: the best of R tokens) against full-precision keys [B,Hkv,S,D]: each query head's
    softmax over the quantized positions, summed over the kv head's query heads (the reduction of
    topk_lowbit). The oracle fetch and the fetch probe use it."""
    q_rows = q_row[:, :, None] if q_row.dim() == 3 else q_row
    B, H, R, D = q_rows.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    G = H // Hkv
    qg = q_rows.float().reshape(B, Hkv, G * R, D)
    scores = (qg @ keys.float().transpose(-1, -2)) * sm_scale
    pos = torch.arange(S, device=q_row.device)
    valid = (pos >= first) & (pos < n_quant)
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).view(B, Hkv, G, R, S).sum(2).amax(2)  # [B,Hkv,S]
    score, idx = torch.where(valid, probs, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


# =============================================================================================
# the selection: the top-k of the scores the attention pass wrote (Algorithm 3's ArgTopK)
# =============================================================================================
class Selection(NamedTuple):
    """What a layer's fetch picks its rows by (Prefetcher.start): the selecting tokens' logits that the
    attention kernel wrote while it attended (kernels.attention_lowbit(select=R): quantized slots scored
    by their low-bit keys, fetched positions by their fp rows, the residual at n_quant + r), so no kernel
    reads the key codes a second time."""
    logits: Tensor  # [B,Hkv,G*R,S] fp32, log2 units; row g*R + r: query head g of the kv head, selecting token r
    lse: Tensor  # [B,H,R] the selecting tokens' logsumexp (natural log)
    n_quant: Tensor  # 0-d: the candidates are positions [first, n_quant)
    k: int  # rows to pick (re-ranking: its N*k candidates)
    first: int = 0  # positions below it are kept in fp16 anyway (attention sinks)
    rerank: Optional[tuple] = None  # re-ranking: (q_rows [B,H,R,D], lse, sm_scale) score the candidates' fp keys


class Picked(NamedTuple):
    """Rows chosen already (the oracle's exact top-k, or re-ranking's candidates): positions idx [B,Hkv,k]
    where valid."""
    idx: Tensor
    valid: Tensor
    rerank: Optional[tuple] = None  # re-ranking: (q_rows [B,H,R,D], lse_rows [B,H,R], sm_scale)


def selection_scores(logits, lse_rows):
    """logits [B,Hkv,G*R,S] (log2 units) and lse_rows [B,H,R] -> score [B,Hkv,S]: the attention probability
    summed over the kv head's G query heads (one fetch per kv head serves them all), the best of the R tokens."""
    B, Hkv, GR, S = logits.shape
    R = lse_rows.shape[-1]
    p = torch.exp2(logits - lse_rows.float().reshape(B, Hkv, GR, 1) * LOG2E.value)
    return p.view(B, Hkv, GR // R, R, S).sum(2).amax(2)


def select_ref(logits, lse_rows, n_quant, k: int, first: int = 0):
    """-> (idx, valid) [B,Hkv,k]: the k positions of [first, n_quant) with the largest selection_scores, in
    position order; of several positions with the k-th score the lowest get in (as the kernel decides:
    deterministic). With fewer than k candidates the other slots are invalid (the lowest other positions)."""
    score = selection_scores(logits, lse_rows)
    B, Hkv, S = score.shape
    pos = torch.arange(S, device=score.device)
    score = torch.where((pos >= first) & (pos < n_quant), score, -1.0)
    kth = score.topk(k, -1).values[..., -1:]
    above, tie = score > kth, score == kth
    take = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    slot = torch.where(take, take.cumsum(-1) - 1, k)  # (slot k: a bin for the positions not taken)
    idx = torch.zeros(B, Hkv, k + 1, dtype=torch.long, device=score.device).scatter(-1, slot, pos.expand(B, Hkv, S))
    idx = idx[..., :k]
    return idx, score.gather(-1, idx) >= 0


# ---- radix selection, 8 bits a round (FlashInfer's top_k, Quest's RAFT select), in one launch ----
# A score p >= 0 has the key bits(p) + 1 (the fp32 bits of a non-negative float order as integers); a position
# that is no candidate has key 0. Keys fit 31 bits, so int32 shifts never sign-extend. Round r histograms digit
# r of the keys whose higher digits are the k-th largest key's; rounds stop as soon as the k-th key's bucket is
# taken whole. Then one pass in position order takes every key above the prefix and the first ties on it.
# Keys rank by (key, then the lower position): a total order, so a kv head's top k lies within the union of its
# position slices' own top k. The launch is a grid of slices: each program picks its slice's k (a few KB, from
# L2), and the last of a head's programs to finish (a ticket counter) picks the k of their n_slices * k.
RADIX = tl.constexpr(256)
SELECT_WARPS = 8
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
def _kth_prefix(keys, n, hist, K, CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """Radix rounds 1-3 over keys[0:n], round 0's histogram of their top digits given -> (prefix, shift, need):
    the K largest keys are those whose bits above `shift` exceed prefix, and the first `need` equal to it."""
    offs = tl.arange(0, CHUNK)
    prefix, need, count = _bucket(hist, K)
    shift = prefix * 0 + 24
    for r in tl.static_range(1, 4):
        if count > need:  # the k-th key's bucket is not taken whole: its next 8 bits decide
            hist = tl.zeros([RADIX], tl.int32)
            for c0 in range(0, n, CHUNK):
                inn = c0 + offs < n
                key = tl.load(keys + c0 + offs, mask=inn, other=0, cache_modifier=CACHE)
                hist += tl.histogram((key >> (24 - 8 * r)) & 255, RADIX, mask=inn & ((key >> (32 - 8 * r)) == prefix))
            digit, need, count = _bucket(hist, need)
            prefix = (prefix << 8) | digit
            shift = shift * 0 + (24 - 8 * r)
    return prefix, shift, need


@triton.jit
def _take_in_order(keys, pos_at, n, base, prefix, shift, need, K, out_pos, out_key, CHUNK: tl.constexpr,
                   CACHE: tl.constexpr, MERGE: tl.constexpr):
    """Every key of keys[0:n] above the prefix and the first `need` on it, in their order, to out_pos/out_key
    [0:K]: a slice's positions base + i and keys; MERGE (the candidates): positions pos_at[i], written as int64,
    and key > 0 as int8. One scan
    counts both (above in the low 16 bits, ties in the high: CHUNK < 2^16); the ties taken before an entry are
    min(ties, left)."""
    offs = tl.arange(0, CHUNK)
    n_take = prefix * 0
    n_tie = prefix * 0
    for c0 in range(0, n, CHUNK):
        i = c0 + offs
        inn = i < n
        key = tl.load(keys + i, mask=inn, other=0, cache_modifier=CACHE)
        above = (((key >> shift) > prefix) & inn).to(tl.int32)
        tie = (((key >> shift) == prefix) & inn).to(tl.int32)
        both = above + (tie << 16)
        before = tl.cumsum(both, 0) - both
        ties_left = tl.maximum(need - n_tie, 0)
        take = above | (tie & ((before >> 16) < ties_left).to(tl.int32))
        slot = n_take + (before & 0xFFFF) + tl.minimum(before >> 16, ties_left)
        put = (take != 0) & (slot < K)  # (exactly K are taken: a guard)
        if MERGE:
            pos = tl.load(pos_at + i, mask=inn, other=0, cache_modifier=CACHE)
            tl.store(out_pos + slot, pos.to(tl.int64), mask=put)
            tl.store(out_key + slot, (key > 0).to(tl.int8), mask=put)
        else:
            tl.store(out_pos + slot, base + i, mask=put)
            tl.store(out_key + slot, key, mask=put)
        total = tl.sum(both, 0)
        n_take += (total & 0xFFFF) + tl.minimum(total >> 16, ties_left)
        n_tie += total >> 16


@triton.jit
def _select_kernel(logits, lse, l_sb, l_sh, l_sr, n_quant_ptr, keys, cand_key, cand_pos, tickets, work, sel_idx,
                   sel_ok, S, S_PAD, SLICE, N_SLICES, K, FIRST, G, Hkv, fetch_idx, fetch_valid, slot_rows, RING, OFF,
                   q, q_sb, q_sh, q_sr, q_sd, s_q, s_lse, new_k, new_v, n_sb, n_sh, n_sd, new_pos, s_k, s_v, s_pos, D,
                   R: tl.constexpr, RS: tl.constexpr, RECORD: tl.constexpr, STAGE_Q: tl.constexpr,
                   HAS_NEW: tl.constexpr, CHUNK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B*Hkv, N_SLICES): the k rows of kv head bh that the next step fetches, and what the transfer needs,
    in one launch. Program (bh, s): the keys of positions [s*SLICE, (s+1)*SLICE) from the logits the attention
    wrote (score = max_r sum_g 2^(logit - lse), select_ref), its slice's K largest in position order to
    cand_key/cand_pos; the head's last program to take a ticket: the K largest of the N_SLICES * K candidates, in
    position order, to sel_idx/sel_ok, and then RECORD (the plain transfer): lay them out in the ring as
    transfer.record_rows does (a row the ring holds keeps its slot; the others take the freed slots in order)
    into fetch_idx/fetch_valid [.., RING] from slot OFF, and give the transfer its host row per ring slot,
    slot_rows (-1: keep). STAGE_Q (re-ranking, whose candidates are sel_idx/sel_ok): the query rows and their
    lse, RS rows a head from the R tokens, into s_q/s_lse. HAS_NEW: the step's token new_k/new_v and new_pos into
    s_k/s_v/s_pos. The staged inputs are what the side stream reads: the step's own tensors are graph temporaries.
    tickets [B*Hkv] are zero between launches (the last program resets its head's)."""
    bh = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    b, h = bh // Hkv, bh % Hkv
    offs = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < G * R
    lse_g = tl.load(lse + b * l_sb + (h * G + offs_g // R) * l_sh + (offs_g % R) * l_sr, mask=g_ok,
                    other=float("inf")) * LOG2E
    hi = tl.minimum(tl.load(n_quant_ptr), S)
    row = logits + (bh * G * R + offs_g)[:, None] * S
    first = sl * SLICE
    my_keys = keys + bh * S_PAD + first
    # the slice's keys, and the histogram of their top digits
    hist = tl.zeros([RADIX], tl.int32)
    for c0 in range(0, SLICE, CHUNK):
        pos = first + c0 + offs
        ok = (pos >= FIRST) & (pos < hi)
        lg = tl.load(row + pos[None, :], mask=g_ok[:, None] & ok[None, :], other=-float("inf"))
        key = _radix_key(best_row(tl.exp2(lg - lse_g[:, None]), offs_g, g_ok, R), ok)
        tl.store(my_keys + c0 + offs, key)
        hist += tl.histogram(key >> 24, RADIX)
    tl.debug_barrier()  # (the keys are read back below in another layout: other threads' stores)
    prefix, shift, need = _kth_prefix(my_keys, SLICE, hist, K, CHUNK, "")
    my_cand = bh * N_SLICES * K + sl * K
    _take_in_order(my_keys, my_keys, SLICE, first, prefix, shift, need, K, cand_pos + my_cand, cand_key + my_cand,
                   CHUNK, "", False)
    tl.debug_barrier()  # (every thread's candidates stored before the ticket releases them)
    if tl.atomic_add(tickets + bh, 1, sem="acq_rel") == N_SLICES - 1:  # the head's last slice: pick from all
        tl.debug_barrier()
        n_cand = N_SLICES * K
        heads_cand = bh * n_cand
        hist = tl.zeros([RADIX], tl.int32)
        for c0 in range(0, n_cand, CHUNK):
            inn = c0 + offs < n_cand
            key = tl.load(cand_key + heads_cand + c0 + offs, mask=inn, other=0, cache_modifier=".cg")
            hist += tl.histogram(key >> 24, RADIX, mask=inn)
        prefix, shift, need = _kth_prefix(cand_key + heads_cand, n_cand, hist, K, CHUNK, ".cg")
        _take_in_order(cand_key + heads_cand, cand_pos + heads_cand, n_cand, 0, prefix, shift, need, K,
                       sel_idx + bh * K, sel_ok + bh * K, CHUNK, ".cg", True)
        tl.atomic_xchg(tickets + bh, 0)
        offs_k = tl.arange(0, BLOCK_K)
        if RECORD:
            _record(keys + bh * S_PAD, work + bh * 2 * BLOCK_K, sel_idx + bh * K, sel_ok + bh * K,
                    fetch_idx + bh * RING + OFF, fetch_valid + bh * RING + OFF, slot_rows + bh * K, offs_k, K, S_PAD)
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
def _record(where, work, sel_idx, sel_ok, fetch_idx, fetch_valid, slot_rows, offs_k, K, S_PAD):
    """transfer.record_rows for one kv head in O(k): `where` (the spent keys) maps a position to the ring slot
    that holds it, checked against fetch_idx (entries the map never set hold stale keys); `work` [2, BLOCK_K]
    holds which slots keep their row, then the free slots in order."""
    kept, free_list = work, work + offs_k.shape[0]
    k_ok = offs_k < K
    tl.debug_barrier()  # (the selection's stores, read back below by other threads)
    old = tl.load(fetch_idx + offs_k, mask=k_ok, other=-1)
    old_ok = k_ok & (tl.load(fetch_valid + offs_k, mask=k_ok, other=0) != 0) & (old >= 0) & (old < S_PAD)
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


_TICKETS: dict = {}  # device -> every counter buffer made there, the newest last


def _tickets(device, n: int) -> Tensor:
    """The selection's ticket counters, zero between launches (each launch's last programs reset theirs): one
    buffer a device, so a launch needs no memset. A larger batch gets a larger buffer; the old ones are kept,
    since a CUDA graph captured earlier still writes to them. Selections on one device run one at a time (the
    step's stream), which these shared counters assume."""
    made = _TICKETS.setdefault(torch.device(device), [])
    if not made or made[-1].numel() < n:
        made.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return made[-1]


def slices(S: int, k: int, chunk: int) -> tuple[int, int, int]:
    """-> (chunk, slice length, slices) of the one-launch selection over S positions: slices of whole chunks, at
    least 4x the (padded) k so the last program's n_slices * k candidates are at most a quarter of the
    positions, at most MAX_SLICES of them."""
    chunk = min(chunk, triton.next_power_of_2(S))
    need = max(chunk, 4 * triton.next_power_of_2(k), triton.cdiv(S, MAX_SLICES))
    length = triton.cdiv(need, chunk) * chunk
    return chunk, length, triton.cdiv(S, length)


def select_triton(logits, lse_rows, n_quant, k: int, first: int = 0, out=None, record=None, stage_q=None, token=None,
                  chunk: int = 1024):
    """select_ref in one launch (_select_kernel), -> (idx, valid) [B,Hkv,k]; `out`: where to write them
    (re-ranking: its staged candidates). record = (fetch_idx, fetch_valid, off, slot_rows): lay the rows out in
    the ring and give the transfer its host rows (record_rows); stage_q = (q_rows [B,H,R',D], s_q [B,H,RS,D],
    s_lse [B,H,RS]); token = (new_k, new_v, new_pos, s_k, s_v, s_pos). Strided inputs are read in place.
    `chunk`: positions a loop iteration reads (slices are whole chunks: a small chunk gives several slices)."""
    B, Hkv, GR, S = logits.shape
    H, R = lse_rows.shape[1:]
    G, BH, dev = H // Hkv, B * Hkv, logits.device
    if k > S:
        raise ValueError(f"top-k of {k} over {S} slots")
    assert logits.is_contiguous() and GR == G * R
    chunk, length, n_slices = slices(S, k, chunk)
    S_PAD = n_slices * length
    BLOCK_K = triton.next_power_of_2(k)
    keys = torch.empty(BH, S_PAD, dtype=torch.int32, device=dev)
    cand_key = torch.empty(BH, n_slices * k, dtype=torch.int32, device=dev)
    cand_pos = torch.empty(BH, n_slices * k, dtype=torch.int32, device=dev)
    work = torch.empty(BH, 2, BLOCK_K, dtype=torch.int32, device=dev)
    idx, ok = out if out is not None else (torch.empty(B, Hkv, k, dtype=torch.long, device=dev),
                                           torch.empty(B, Hkv, k, dtype=torch.bool, device=dev))
    assert idx.is_contiguous() and ok.is_contiguous() and idx.shape == ok.shape == (B, Hkv, k)
    any_t = keys  # absent inputs: any valid pointer
    fetch_idx, fetch_valid, off, slot_rows = record if record is not None else (any_t, any_t, 0, any_t)
    if record is not None:
        assert fetch_idx.is_contiguous() and fetch_valid.is_contiguous() and slot_rows.shape == (B, Hkv, k)
        fetch_valid = fetch_valid.view(torch.int8)
    q, s_q, s_lse = stage_q if stage_q is not None else (any_t, any_t, any_t)
    q_strides, RS = (q.stride(), s_q.shape[2]) if stage_q is not None else ((0,) * 4, 1)
    new_k, new_v, new_pos, s_k, s_v, s_pos = token if token is not None else (any_t,) * 6
    new_strides = (new_k.stride(0), new_k.stride(1), new_k.stride(3)) if token is not None else (0,) * 3
    assert token is None or new_v.stride() == new_k.stride()
    D = s_k.shape[-1] if token is not None else s_q.shape[-1] if stage_q is not None else 1
    _select_kernel[(BH, n_slices)](
        logits, lse_rows, *lse_rows.stride(), n_quant, keys, cand_key, cand_pos, _tickets(dev, BH), work, idx,
        ok.view(torch.int8), S, S_PAD, length, n_slices, k, first, G, Hkv, fetch_idx, fetch_valid, slot_rows,
        fetch_idx.shape[-1] if record is not None else 0, off,
        q, *q_strides, s_q, s_lse, new_k, new_v, *new_strides, new_pos, s_k, s_v, s_pos, D,
        R=R, RS=RS, RECORD=record is not None, STAGE_Q=stage_q is not None, HAS_NEW=token is not None, CHUNK=chunk,
        BLOCK_G=max(2, triton.next_power_of_2(G * R)), BLOCK_K=BLOCK_K, BLOCK_M=max(2, triton.next_power_of_2(G * RS)),
        BLOCK_D=triton.next_power_of_2(D), num_warps=SELECT_WARPS)
    return idx, ok
