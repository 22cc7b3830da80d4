"""Decode-time kernels over the low-bit device cache (SpeCache §3.2-3.4), as torch: what each computes, and
the one entry point that runs its Triton kernel (gpu/) on CUDA.

  attention_lowbit_ref  attention of T new query tokens over
                      quantized slots [0, n_quant)  (codes dequantized on the fly),
                      minus the slots whose fp rows were fetched (eq. 1: C' ∪ C_K replaces C'_K),
                      plus the fetched fp rows and the fp residual window (causal among the new tokens).
  select_ref        which positions' fp16 rows to fetch: the k with the largest attention probability under
                    the selecting token(s), from the logits the attention wrote while it attended (the
                    quantized slots' low-bit scores, the fetched rows' exact ones, the residual's): the
                    probability summed over the query heads that share a kv head (GQA: one fetch per kv
                    head serves them all), the best of the selecting tokens (gpu/topk.py: one launch).
  topk_lowbit_ref   the same top-k scored from the stored codes (tests and tools/probe.py).
  topk_exact        the top-k from full-precision keys (the oracle fetch, hit rates).

What they read is described by three small tuples of quant.py: LowBitKV (the stored codes and their scales),
Residual (the fp window) and Fetched (fp rows fetched from the host and the positions they replace).

GQA: H = Hkv * G query heads, query head h reads kv head h // G. A query block of one kv head
is the G*T rows m = g*T + t, contiguous in a [B, H, T, D] tensor.

CUDA runs the Triton kernel behind a torch.library custom op (so torch.compile(fullgraph=True) can call it);
CPU runs the torch reference inline, written with static shapes (masks over all S slots, no slicing by
n_quant, garbage past the valid lengths masked out) so one compiled graph serves every step. The Triton
launchers (gpu/) also run on CPU tensors under TRITON_INTERPRET=1, which is how the tests check them against
the references.
"""
import math
from typing import NamedTuple, Optional

import torch

from quant import Fetched, LowBitKV, Residual, Tensor

LOG2E = math.log2(math.e)  # the kernels' scores are in log2 units (exp2)


# =============================================================================================
# torch references (the CPU path)
# =============================================================================================
def attention_lowbit_ref(q, store: LowBitKV, residual: Residual, fetched: Optional[Fetched], sm_scale, select=0):
    """Softmax attention of the T query tokens over three parts: the quantized slots [0, n_quant)
    without the fetched positions, the fetched fp rows, and the residual rows (causal). select > 0:
    also the last `select` tokens' logits for the selection (selection_logits). `store` reads its codes
    through its own methods (key_logits, value_sum), so any tuple with those methods runs here."""
    B, H, T, D = q.shape
    Hkv, S, R = store.k_codes.shape[1], store.k_codes.shape[2], residual.k.shape[2]
    M, dev = (H // Hkv) * T, q.device
    qg = q.float().reshape(B, Hkv, M, D) * sm_scale

    keep_q = (torch.arange(S, device=dev) < store.n_quant).expand(B, Hkv, S)
    if fetched is not None:  # eq. 1: a fetched fp row replaces its quantized copy
        keep_q = keep_q & ~replaced_mask(fetched, S)
    t = torch.arange(M, device=dev) % T  # query row m = g*T + t sees residual rows < length - T + t + 1
    keep_res = torch.arange(R, device=dev) < residual.length - T + 1 + t[:, None]  # [M, R]
    if store.row_start is not None:  # a left-padded row attends from its first real slot on
        keep_q = keep_q & store.real_slots()
        keep_res = keep_res & (store.n_quant + torch.arange(R, device=dev) >= store.row_start[:, None, None, None])
    fp_parts = [(residual.k, residual.v, keep_res)]
    if fetched is not None:
        fp_parts.append((fetched.k, fetched.v, fetched.valid[:, :, None, :]))
    # scores of each part, masked; one softmax over all of them
    scores = [torch.where(keep_q[:, :, None, :], store.key_logits(qg), -math.inf)]
    scores += [torch.where(keep, qg @ k.float().transpose(-1, -2), -math.inf) for k, _, keep in fp_parts]
    m = torch.stack([x.amax(-1) for x in scores], -1).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = [torch.exp(x - m) for x in scores]
    l = sum(x.sum(-1, keepdim=True) for x in p)
    out = store.value_sum(p[0], keep_q)
    for pi, (_, v, keep) in zip(p[1:], fp_parts):  # garbage rows are zeroed: NaN would leak through p = 0
        rows_ok = keep.any(-2) if keep.shape[-2] > 1 else keep[..., 0, :]
        out = out + pi @ torch.where(rows_ok.expand(B, Hkv, -1)[..., None], v.float(), 0.0)
    out = out / torch.where(l > 0, l, 1.0)
    lse = (m + torch.log(l)).squeeze(-1)
    out, lse = out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)
    if not select:
        return out, lse
    rows = lambda x: x.view(B, Hkv, M // T, T, -1)[:, :, :, T - select:].flatten(2, 3)  # noqa: E731 (the selecting rows)
    quantized = rows(scores[0])  # (-inf at the replaced slots, which take their fp rows' scores below)
    if fetched is not None:
        safe = torch.where(fetched.valid, fetched.idx, S - 1)[:, :, None].expand(-1, -1, quantized.shape[2], -1)
        exact = torch.where(fetched.valid[:, :, None], rows(scores[2]), quantized.gather(-1, safe))
        quantized = quantized.scatter(-1, safe, exact)
    return out, lse, selection_logits(quantized, rows(scores[1]), store.n_quant, residual.length)


def selection_logits(quantized, res_scores, n_quant, res_len):
    """What the attention kernels write for the selection, in log2 units [B,Hkv,rows,S]: the quantized
    slots' scores (fetched positions: their fp rows'), and residual row r's at slot n_quant + r."""
    B, Hkv, Mr, S = quantized.shape
    R = res_scores.shape[-1]
    pos = torch.arange(S, device=quantized.device)
    r = (pos - n_quant).clamp(0, R - 1)
    in_res = (pos >= n_quant) & (pos < n_quant + res_len)
    logits = torch.where(in_res, res_scores.gather(-1, r.expand(B, Hkv, Mr, S)), quantized)
    return logits * LOG2E


def replaced_mask(fetched: Fetched, S: int) -> Tensor:
    """[B,Hkv,S] bool: quantized slots whose fp row was fetched. Unused fetch slots point at S-1,
    a scratch slot that is never attended."""
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return torch.zeros(*fetched.idx.shape[:2], S, dtype=torch.bool, device=fetched.idx.device).scatter(2, safe, fetched.valid)


def row_scores(logits, lse_rows, G, R):
    """logits [B,Hkv,G*R,N] of query rows m = g*R + r -> score [B,Hkv,N]: the attention probability
    summed over the kv head's G query heads, the best of the R query tokens."""
    B, Hkv, _, N = logits.shape
    p = torch.exp(logits - lse_rows.float().reshape(B, Hkv, G * R, 1))
    return p.view(B, Hkv, G, R, N).sum(2).amax(2)


def as_rows(q_row, lse_row):
    """[B,H,D] / [B,H] (one query token) or [B,H,R,D] / [B,H,R] (R tokens) -> the 4-d / 3-d form."""
    return (q_row[:, :, None], lse_row[:, :, None]) if q_row.dim() == 3 else (q_row, lse_row)


def fp_row_scores(q_rows, lse_rows, keys, sm_scale):
    """row_scores of fp keys [B,Hkv,N,D] for query rows [B,H,R,D] -> [B,Hkv,N]."""
    B, H, R, D = q_rows.shape
    Hkv = keys.shape[1]
    qg = q_rows.float().reshape(B, Hkv, (H // Hkv) * R, D) * sm_scale
    return row_scores(qg @ keys.float().transpose(-1, -2), lse_rows, H // Hkv, R)




# =============================================================================================
# which quantized positions' fp16 rows to fetch (§3.3, Algorithm 3's ArgTopK)
# =============================================================================================
def exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched: Fetched):
    """Algorithm 3 takes ArgTopK of the attention that already used the fetched fp rows: their
    positions get exact scores, so a row that matters keeps its place whatever its low-bit copy
    scores. Invalid fetch slots write back the scratch slot's own value (position S-1 >= n_quant)."""
    S = prob.shape[2]
    exact = fp_row_scores(q_rows, lse_rows, fetched.k, sm_scale)
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return prob.scatter(-1, safe, torch.where(fetched.valid, exact, prob.gather(-1, safe)))


def candidates(S: int, n_quant, first: int, row_start, device) -> Tensor:
    """[B or 1, 1, S] bool: the positions a selection may pick, [first, n_quant) from each row's first real slot
    (row_start [B], a left-padded batch's; None: 0). Below them: padding, and the rows kept in fp16 anyway."""
    pos = torch.arange(S, device=device)
    lo = first if row_start is None else first + row_start[:, None, None]
    return (pos >= lo) & (pos < n_quant)


def topk_lowbit_ref(q_row, lse_row, store: LowBitKV, k: int, sm_scale, fetched: Optional[Fetched] = None,
                    first: int = 0):
    """score[p] = sum over the G query heads of kv head j of exp(sm_scale * q_g . k'_p - lse_g): the
    attention probability kv row p would get, summed over the heads that share it (one fetch per
    kv head serves all G heads); with several query tokens ([B,H,R,D]) the best of them. With
    `fetched`, fetched positions score with their fp rows. Positions that are no `candidates` (below `first`
    from the row's start: padding, rows kept in fp anyway; >= n_quant) score -1 with index 0. Sorted descending."""
    q_rows, lse_rows = as_rows(q_row, lse_row)
    B, H, R, D = q_rows.shape
    Hkv, S = store.k_codes.shape[1], store.k_codes.shape[2]
    G = H // Hkv
    prob = row_scores(store.key_logits(q_rows.float().reshape(B, Hkv, G * R, D) * sm_scale), lse_rows, G, R)
    if fetched is not None:
        prob = exact_fetched_scores(prob, q_rows, lse_rows, sm_scale, fetched)
    valid = candidates(S, store.n_quant, first, store.row_start, q_row.device)
    score, idx = torch.where(valid, prob, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


def topk_exact(q_row, keys, n_quant, k, sm_scale, first: int = 0, row_start=None):
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
    valid = candidates(S, n_quant, first, row_start, q_row.device)
    scores = scores.masked_fill(~(valid[:, :, None] if valid.dim() == 3 else valid), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).view(B, Hkv, G, R, S).sum(2).amax(2)  # [B,Hkv,S]
    score, idx = torch.where(valid, probs, -1.0).topk(k, dim=-1)
    return score, torch.where(score >= 0, idx, 0)


# =============================================================================================
# the selection: the top-k of the scores the attention pass wrote (Algorithm 3's ArgTopK)
# =============================================================================================
class Selection(NamedTuple):
    """What a layer's fetch picks its rows by (Prefetcher.start): the selecting tokens' logits that the
    attention kernel wrote while it attended (attention_lowbit_ref(select=R): quantized slots scored
    by their low-bit keys, fetched positions by their fp rows, the residual at n_quant + r), so no kernel
    reads the key codes a second time."""
    logits: Tensor  # [B,Hkv,G*R,S] fp32, log2 units; row g*R + r: query head g of the kv head, selecting token r
    lse: Tensor  # [B,H,R] the selecting tokens' logsumexp (natural log)
    n_quant: Tensor  # 0-d: the candidates are positions [first, n_quant)
    k: int  # rows to pick (re-ranking: its N*k candidates)
    first: int = 0  # positions below it are kept in fp16 anyway (attention sinks)
    rerank: Optional[tuple] = None  # re-ranking: (q_rows [B,H,R,D], lse, sm_scale) score the candidates' fp keys
    row_start: Optional[Tensor] = None  # [B] each row's first real slot: `first` counts from it (candidates)


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
    p = torch.exp2(logits - lse_rows.float().reshape(B, Hkv, GR, 1) * LOG2E)
    return p.view(B, Hkv, GR // R, R, S).sum(2).amax(2)


def select_ref(logits, lse_rows, n_quant, k: int, first: int = 0, row_start=None):
    """-> (idx, valid) [B,Hkv,k]: the k `candidates` (positions [first, n_quant), first counted from each row's
    start) with the largest selection_scores, in position order; of several positions with the k-th score the
    lowest get in (as the kernel decides: deterministic). With fewer than k candidates the other slots are
    invalid (the lowest other positions)."""
    score = selection_scores(logits, lse_rows)
    B, Hkv, S = score.shape
    pos = torch.arange(S, device=score.device)
    score = torch.where(candidates(S, n_quant, first, row_start, score.device), score, -1.0)
    kth = score.topk(k, -1).values[..., -1:]
    above, tie = score > kth, score == kth
    take = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    slot = torch.where(take, take.cumsum(-1) - 1, k)  # (slot k: a bin for the positions not taken)
    idx = torch.zeros(B, Hkv, k + 1, dtype=torch.long, device=score.device).scatter(-1, slot, pos.expand(B, Hkv, S))
    idx = idx[..., :k]
    return idx, score.gather(-1, idx) >= 0


# =============================================================================================
# the custom op (the CUDA path, opaque to torch.compile) and the dispatcher
# =============================================================================================
# The op takes the tuples' tensors flat (custom ops take tensors, not tuples): `op_inputs` / `from_op_inputs`.
def op_inputs(store: LowBitKV, residual: Residual, fetched: Optional[Fetched]) -> tuple[list, list, list]:
    f = fetched or Fetched(None, None, None, None)
    tensors = [store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero, store.n_quant,
               residual.k, residual.v, residual.length]
    return tensors, [store.bits, store.group_k, store.group_v], [f.k, f.v, f.idx, f.valid, store.row_start]


def from_op_inputs(tensors, ints, optional):
    store = LowBitKV(*tensors[:7], *ints[:3], row_start=optional[4])
    return store, Residual(*tensors[7:10]), (Fetched(*optional[:4]) if optional[0] is not None else None)


@torch.library.custom_op("specache::attention_lowbit", mutates_args=())
def attention_op(q: Tensor, tensors: list[Tensor], ints: list[int], optional: list[Optional[Tensor]], sm_scale: float,
                 attn_path: str, select: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """attention_lowbit_ref's (out, lse, logits) by the Triton kernels (gpu/attention.py: CUDA, or CPU tensors
    interpreted), from op_inputs' flat tensors; attn_path: config.ATTN_PATHS; logits is empty when select is 0."""
    from gpu.attention import attention_lowbit_triton
    out = attention_lowbit_triton(q, *from_op_inputs(tensors, ints, optional), sm_scale, attn_path=attn_path,
                                  select=select)
    return out if select else (*out, q.new_empty(0, dtype=torch.float32))


def attention_fake(q, tensors, select):
    """The shapes an attention op returns (contiguous, like the real op, which makes q contiguous first)."""
    B, H, T, _ = q.shape
    Hkv, S = tensors[0].shape[1:3]
    logits = q.new_empty((B, Hkv, H // Hkv * select, S) if select else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32), logits


@attention_op.register_fake
def _(q, tensors, ints, optional, sm_scale, attn_path, select=0):
    return attention_fake(q, tensors, select)
