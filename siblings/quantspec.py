"""QuantSpec (quantspec.txt §4, Algorithm 1): self-speculative decoding over one hierarchical cache.

    python generate.py --method quantspec --gamma 4 --prompt-file essay.txt     # greedy, or --temperature
    python tools/eval.py quantspec --lengths 4000,8000 --gammas 1,2,4,6               # acceptance rates

The draft is the model itself with two cheaper parts: its linear layers (and output head) use
group-wise INT4 weights (`Int4Linear`, its own copy; norms and embeddings are shared), and its
attention reads only the upper INT4 planes of the hierarchical KV cache. The target is the model
with its own weights reading both planes (the INT8 view). Both write to one QuantSpecCache per
layer (`setup_caches`, then `share_caches`): no second KV cache exists.

One round (`generate_quantspec`, the decode loop; `python generate.py --method quantspec` runs it):
  draft    gamma one-token steps ("draft" mode) propose d_1..d_gamma from the last token x;
  verify   one step over [x, d_1..d_gamma] ("verify" mode) gives the target's distributions;
  accept   the longest agreeing prefix (greedy: d_i == argmax p_{i-1}; sampled: the standard
           speculative-sampling rule, `accept`), plus one token from the target (the correction
           or, when all agree, the next one);
  commit   every layer keeps the target's KV of x, d_1..d_a (`QuantSpecCache.accept`): the rejected
           ones are dropped from the full-precision buffer, never quantized.
The draft step, the verify step and the commit are each one static-shape graph; the number of
accepted tokens is a tensor until the loop reads it once per round to emit the tokens.
"""
import functools
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import cache
import quant
from cache import LowBitCache
from config import CacheConfig
from decoding import Decoding, cloned, compiled_step, prefill, sample
from quant import Residual
from siblings.attn_views import ViewKV, attention_views


# ---- QuantSpec hierarchical INT8 = upper INT4 + lower INT4 (quantspec.txt §4.2) ------------------
# Upper U in [0,15]: 4-bit asymmetric RTN, x ~ U*s4 + z. Lower L in [-8,7]: symmetric RTN of the
# error x - (U*s4 + z) with s8 = s4/16, stored as L + 8. INT8 view: (16U + L)*s8 + z.
def _quantize_hier(x, group, along, meta_dtype):
    upper, scale, zero = quant.quantize_codes(x, 4, group, along, meta_dtype=meta_dtype)
    err = quant.finite_fp32(x, meta_dtype) - quant.dequantize_codes(upper, scale, zero, group, along)
    s8 = quant.expand_groups(scale, group, along) / 16
    lower = quant.round_clamp(err / torch.where(s8 == 0, 1.0, s8), -8, 7) + 8
    return quant.pack_bits(upper, 4), quant.pack_bits(lower.to(torch.uint8), 4), scale, zero


def _dequantize_hier(codes_hi, codes_lo, scale, zero, group, along, view_bits, dtype):
    upper = quant.unpack_bits(codes_hi, 4, torch.int32)
    if view_bits == 4:
        return quant.dequantize_codes(upper, scale, zero, group, along, dtype)
    assert view_bits == 8, view_bits
    int8 = 16 * upper.float() + quant.unpack_bits(codes_lo, 4, torch.int32).float() - 8
    return quant.dequantize_codes(int8, scale.float() / 16, zero, group, along, dtype)


def quantize_hier_keys(k, group, meta_dtype=torch.float16):
    """-> (codes_hi, codes_lo) uint8 [B,H,T,D//2] each, scale (= s4) / zero [B,H,T//group,D]."""
    return _quantize_hier(k, group, "tokens", meta_dtype)


def quantize_hier_values(v, group, meta_dtype=torch.float16):
    return _quantize_hier(v, quant.value_group(group, v.shape[-1]), "channels", meta_dtype)


def dequantize_hier_keys(codes_hi, codes_lo, scale, zero, group, view_bits=8, dtype=torch.float32):
    return _dequantize_hier(codes_hi, codes_lo, scale, zero, group, "tokens", view_bits, dtype)


def dequantize_hier_values(codes_hi, codes_lo, scale, zero, group, view_bits=8, dtype=torch.float32):
    group = quant.value_group(group, codes_hi.shape[-1] * 2)
    return _dequantize_hier(codes_hi, codes_lo, scale, zero, group, "channels", view_bits, dtype)


# ---- QuantSpec's draft weights: group-wise INT4, weight-only (quantspec.txt §4.1) -------------------
def quantize_weight_int4(w: torch.Tensor, group: int):
    """w [N, K] -> (codes uint8 [N, K] in [0, 15], scale, zero [N, K // group] fp32) with
    w ~ code * scale + zero per group of `group` input features (eq. 2 at 4 bits, asymmetric RTN)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"in_features {K} is not a multiple of the weight group {group}")
    wg = w.float().reshape(N, K // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    codes = quant.round_clamp((wg - lo) / torch.where(scale == 0, 1.0, scale), 0, 15)
    return codes.to(torch.uint8).reshape(N, K), scale.squeeze(-1), lo.squeeze(-1)


def dequantize_weight_int4(codes, scale, zero, group, dtype=torch.float32):
    N, K = codes.shape
    w = codes.float().reshape(N, K // group, group) * scale[..., None] + zero[..., None]
    return w.reshape(N, K).to(dtype)


class Int4Linear(nn.Module):
    """y = x @ W'^T with W' the group-wise INT4 copy of W (quantize_weight_int4). Runs ATen's
    int4 weight-only matmul (CPU: `_weight_int4pack_mm_for_cpu`, CUDA: `_weight_int4pack_mm`, both
    with bf16 activations, as they require), or the torch reference (dequantize, then matmul) where
    those are missing."""

    def __init__(self, weight: torch.Tensor, group: int = 32):
        super().__init__()
        codes, scale, zero = quantize_weight_int4(weight, group)
        self.out_features, self.in_features, self.group = weight.shape[0], weight.shape[1], group
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("zero", zero, persistent=False)
        self.packed, self.scales_zeros = self._pack(codes, scale, zero, weight.device)

    @staticmethod
    def _pack(codes, scale, zero, device):
        """ATen's layout: packed codes, and [K/group, N, 2] (scale, zero) in bf16 with w = (c - 8) * scale + zero."""
        sz = torch.stack([scale, zero + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        group = codes.shape[1] // scale.shape[1]
        if group not in (32, 64, 128, 256):  # what the ATen kernels take
            return None, sz
        try:
            if device.type == "cuda":
                pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()  # two codes per byte, high nibble first
                inner = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
                return torch.ops.aten._convert_weight_to_int4pack(pairs, inner), sz
            if device.type == "cpu":
                return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1), sz
        except (RuntimeError, StopIteration, AttributeError):
            pass
        return None, sz

    def reference(self, x):
        w = dequantize_weight_int4(self.codes, self.scale, self.zero, self.group, x.dtype)
        return F.linear(x, w)

    def forward(self, x):
        if self.packed is None:
            return self.reference(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if x.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)


def make_draft(model, group: int = 32):
    """The draft: a copy of `model`'s module tree whose linear layers (and output head, the tied
    embedding too) are Int4Linear; embeddings, norms, the rope table and the KV caches are the model's
    own (the caches are attached by setup_caches on `model` and shared by reference)."""
    import copy
    if hasattr(model, "int4_draft"):  # a transformers model (hf.HFModel): its own module tree
        return model.int4_draft(group)
    draft = copy.copy(model)  # shares parameters and buffers
    draft._modules = dict(model._modules)
    draft.layers = nn.ModuleList()
    for layer in model.layers:
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        for part_name in ("attention", "feed_forward"):
            part = copy.copy(getattr(layer, part_name))
            part._modules = {n: Int4Linear(m.weight.detach(), group) if isinstance(m, nn.Linear) else m
                             for n, m in part._modules.items()}
            new._modules[part_name] = part
        draft.layers.append(new)
    head = model.output.weight if model.output is not None else model.tok_embeddings.weight
    draft.output = Int4Linear(head.detach(), group)
    return draft


def share_caches(draft, model):
    """Point the draft's attention layers at the model's caches (after setup_caches on the model)."""
    for d, m in zip(draft.layers, model.layers):
        d.attention.kv_cache = m.attention.kv_cache


# ---- the cache ----------------------------------------------------------------------------------------
class HierCache(LowBitCache):
    """LowBitCache with QuantSpec's hierarchical quantizer (quantspec.txt §4.2): INT8 codes stored as
    their upper INT4 planes (k_codes, v_codes) and lower INT4 planes (k_codes_lo, v_codes_lo, the same
    shape). Attention reads one of two views: the upper planes alone (INT4) or both (INT8: 16*U + L - 8);
    config bits 4 or 8 picks the default (`view_bits`). Cache names: quantspec[-gN] (QuantSpecCache),
    kivi-/specache-...-quantspec (this store under KIVI's or SpeCache's decoding)."""
    scheme = "quantspec"
    one_attn_path = "words"  # (attn_views has one kernel: the word path's)

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig,
                 max_step_tokens=2, meter=None, row_start=None):
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, max_step_tokens, meter,
                         row_start)
        self.view_bits = config.bits
        self.zeros_buffer("k_codes_lo", self.k_codes.shape, dtype=torch.uint8)
        self.zeros_buffer("v_codes_lo", self.v_codes.shape, dtype=torch.uint8)

    @staticmethod
    def code_bits(config: CacheConfig) -> int:
        return 4  # each plane

    def stored(self, view_bits=None) -> ViewKV:
        """The view `view_bits` (4 or 8; default the configuration's) as the kernels read it."""
        if (view_bits or self.view_bits) == 8:
            return ViewKV(super().stored(), k_codes_lo=self.k_codes_lo, v_codes_lo=self.v_codes_lo)
        return ViewKV(super().stored())

    def attend(self, q, fetched=None, select: int = 0):
        """LowBitCache.attend through this store's views (attn_views' kernel)."""
        return self.attention(q, self.stored(), self.residual_rows(q.shape[2]), fetched, select)

    def attention(self, q, store: ViewKV, residual, fetched, select: int = 0):
        """The attention over a view of the store (QuantSpec's draft reads the INT4 one)."""
        return attention_views(q, store, residual, fetched, self.sm_scale, use_op=self.custom_ops, select=select)

    def quantize(self, k, v, row0, first_group):
        kc, kl, ks, kz = quantize_hier_keys(k, self.group, self.k_scale.dtype)
        vc, vl, vs, vz = quantize_hier_values(v, self.group_v, self.k_scale.dtype)
        return dict(k_codes=kc, k_codes_lo=kl, v_codes=vc, v_codes_lo=vl, v_scale=vs, v_zero=vz), dict(k_scale=ks, k_zero=kz)

    def read_bytes(self, step_tokens: int = 1, view_bits=None) -> int:
        """Bytes a step's attention reads in the view `view_bits` (both planes for the INT8 view)."""
        return super().read_bytes(step_tokens, self.stored(view_bits))


class QuantSpecCache(HierCache):
    """QuantSpec's cache (quantspec.txt §4.2-4.3): one hierarchical store read two ways, the draft's
    INT4 view (upper planes) and the target's INT8 view (both planes), and a double full-precision
    buffer of two groups for the newest tokens: F1 (the older group, always full after prefill) and
    F2 (new tokens). A round appends the draft's tokens one by one ("draft": INT4 view), then the
    target's KV of the same tokens plus one ("verify": INT8 view, written over the draft's), and
    `accept(n)` keeps the first n. Only verified tokens are ever quantized: when the buffer holds two
    groups, F1 is quantized and F2 becomes F1. Rejected tokens are dropped, never quantized. All
    counters are tensors: the draft, verify and accept steps are static-shape graphs."""

    def __init__(self, batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config: CacheConfig, gamma=4,
                 meter=None, row_start=None):
        # residual capacity: the two groups + one round's unverified tokens
        super().__init__(batch, n_kv_heads, max_seq_len, head_dim, dtype, device, config, max_step_tokens=gamma + 1,
                         meter=meter, row_start=row_start)
        self.gamma = gamma
        self.register_buffer("n_draft", torch.zeros((), dtype=torch.int64, device=self.k_codes.device), persistent=False)

    def blocks_to_quantize(self, n: int) -> int:
        """Whole groups, keeping between one and two groups of the newest tokens in fp (once n >= G)."""
        return max(0, (n - self.group) // self.group * self.group)

    def forward(self, q, k, v, input_pos, mode="verify"):
        if mode == "prefill":
            return self.prefill(q, k, v, input_pos)
        if mode not in ("draft", "verify"):
            raise ValueError(f"the quantspec cache runs 'draft' and 'verify' steps, not {mode!r}")
        T = k.shape[2]
        draft = mode == "draft"
        at = self.res_len + (self.n_draft if draft else 0)  # verify writes over the round's draft rows
        rows = at + torch.arange(T, device=k.device)
        self.k_res.index_copy_(2, rows, k)
        self.v_res.index_copy_(2, rows, v)
        out, _ = self.attention(q, self.stored(4 if draft else 8), Residual(self.k_res, self.v_res, at + T), None)
        if draft:
            self.n_draft.add_(T)
        return out

    def accept(self, n):
        """Keep the first n (a 0-d tensor) of the round's verified tokens; quantize F1 when the
        buffer reached two groups (static shape: otherwise into the scratch block)."""
        G = self.group
        self.res_len.add_(n)
        self.n_draft.zero_()
        full = self.res_len >= 2 * G
        row0 = torch.where(full, self.n_quant, torch.full_like(self.n_quant, self.capacity))
        self.quantize_block(self.k_res[:, :, :G], self.v_res[:, :, :G], row0)
        C = self.k_res.shape[2]
        for buf in (self.k_res, self.v_res):  # F2 becomes F1
            buf[:, :, :C - G] = torch.where(full, buf[:, :, G:].clone(), buf[:, :, :C - G])
        self.n_quant.add_(full.long() * G)
        self.res_len.sub_(full.long() * G)


def setup_caches(model, config: CacheConfig | str = "quantspec", batch: int = 1, max_seq_len=None, gamma: int = 4):
    """cache.setup_caches with a QuantSpecCache in each layer (its residual holds a round of gamma + 1)."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if config.kind != "quantspec":
        raise ValueError(f"QuantSpec runs on the quantspec cache (quantspec[-gN]), not {config.name}")
    return cache.setup_caches(model, config, batch, max_seq_len, store=QuantSpecCache, max_step_tokens=gamma + 1,
                              gamma=gamma)


# ---- acceptance ----------------------------------------------------------------------------------------
def boundary_cap(cache):
    """The most drafts a round may keep (a 0-d tensor): the target's rows at buffer index >= 2G were
    computed with F1 still in full precision, where one-token decoding would already have quantized
    it (it flushes as soon as the buffer holds two groups). Keeping only the rows before that index
    makes greedy QuantSpec equal one-token decoding exactly; it costs a shorter round once per G tokens."""
    return 2 * cache.group - 1 - cache.res_len


def accept(target_logits, drafts, draft_probs, temperature: float, cap=None):
    """target_logits [B, g+1, V] (the target at x, d_1..d_g), drafts [B, g], draft_probs [B, g, V]
    (the draft's distributions the d_i were sampled from) -> (a [B] accepted drafts, next token [B]).
    Greedy: d_i is kept while it is the target's argmax. Sampled (Leviathan et al.'s rule): d_i is
    kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token comes from
    norm(max(0, p_i - q_i)), and after g acceptances from p_g: the output follows the target's
    distribution exactly. `cap` (0-d) bounds a (see boundary_cap). All tensor operations."""
    B, g1, V = target_logits.shape
    g = g1 - 1
    if temperature <= 0:
        best = target_logits.argmax(-1)  # [B, g+1]
        ok = (best[:, :g] == drafts).long()
        a = ok.cumprod(1).sum(1)
        a = a if cap is None else torch.minimum(a, cap)
        return a, best.gather(1, a[:, None])[:, 0]
    p = torch.softmax(target_logits.float() / temperature, -1)  # [B, g+1, V]
    p_d = p[:, :g].gather(2, drafts[..., None])[..., 0]
    q_d = draft_probs.gather(2, drafts[..., None])[..., 0]
    ok = (torch.rand_like(p_d) * q_d <= p_d).long()  # u < p/q, without dividing by q
    a = ok.cumprod(1).sum(1)  # [B]
    capped = None
    if cap is not None:  # past the cap: d_{cap+1} passed its test (row cap is valid) and is the next token
        capped = a > cap
        a = torch.minimum(a, cap)
    residual = (p[:, :g] - draft_probs).clamp(min=0)
    residual = torch.cat([residual, p[:, g:]], 1)  # after g acceptances: p_g itself
    pick = residual.gather(1, a[:, None, None].expand(B, 1, V))[:, 0]
    pick = pick / pick.sum(-1, keepdim=True).clamp(min=1e-30)
    nxt = torch.argmax(pick / torch.empty_like(pick).exponential_(1), -1)  # a sample, no host sync
    if capped is not None:
        nxt = torch.where(capped, drafts.gather(1, a[:, None].clamp(max=g - 1))[:, 0], nxt)
    return a, nxt


# ---- the steps of a round and the loop (quantspec.txt Algorithm 1) ---------------------------------------
def draft_step(draft, token, input_pos, temperature: float = 0.0):
    """One draft token: token [B] at input_pos [1] -> (next token [B], its distribution [B, V])."""
    logits = draft(token[:, None], input_pos, mode="draft")[:, 0]
    probs = torch.softmax(logits / max(temperature, 1e-6), -1) if temperature > 0 else logits
    return sample(logits, temperature, None), probs


def verify_step(model, tokens, input_pos):
    """The target over [x, d_1..d_g]: logits [B, g+1, V]."""
    return model(tokens, input_pos, mode="verify")


def commit(caches, n):
    """Every layer's QuantSpecCache keeps the round's first n tokens (a layer of another kind keeps its own)."""
    for c in caches:
        if isinstance(c, QuantSpecCache):
            c.accept(n)


@dataclass(frozen=True)
class Steps:
    """What runs each forward of a round: the eager functions above (the default) or their compiled
    graphs (`compiled`); prefill is Algorithm 1's, as generate.py's loop runs it."""
    prefill: Callable = prefill  # (model, prompt) -> last logits [B, V]
    draft: Callable = draft_step
    verify: Callable = verify_step
    commit: Callable = commit

    def compiled(self, device) -> "Steps":
        """The draft, verify and commit steps as fullgraph graphs (CUDA graphs on CUDA). Prefill stays."""
        draft, verify = compiled_step(device, self.draft), compiled_step(device, self.verify)
        if device.type == "cuda":
            # A CUDA graph's outputs live in its pool and the next replay of the same graph overwrites
            # them: gamma draft steps replay one graph, and each token feeds the next and the verify step.
            # The outputs (a token, a distribution, the logits) are small: copy them out.
            draft, verify = functools.partial(cloned, draft), functools.partial(cloned, verify)
        return replace(self, draft=draft, verify=verify, commit=compiled_step(device, self.commit))


def check_args(gamma: int, batch_size: int, draft_group: int):
    """generate.py --method quantspec's flags (ValueError: one `error:` line)."""
    if gamma < 0:
        raise ValueError(f"--gamma must be >= 0, got {gamma}")
    if batch_size != 1:
        raise ValueError("--method quantspec decodes one sequence (--batch-size 1)")
    if draft_group not in (32, 64, 128, 256):
        raise ValueError(f"--draft-group must be 32, 64, 128 or 256, got {draft_group}")


def run(model, config, prompt, max_seq_len: int, gamma: int, draft_group: int, decoding: Decoding, prefill_fn,
        compile: bool = False, on_token=None):
    """generate.py --method quantspec: the caches, the draft and the loop -> (caches, ids, stats)."""
    caches = setup_caches(model, config, 1, max_seq_len, gamma=max(gamma, 1))
    draft = make_draft(model, draft_group)
    share_caches(draft, model)
    steps = Steps(prefill=prefill_fn)
    steps = steps.compiled(prompt.device) if compile else steps
    return (caches, *generate_quantspec(model, draft, prompt, gamma, decoding, steps, on_token))


@torch.no_grad()
def generate_quantspec(model, draft, prompt: torch.Tensor, gamma: int, decoding: Decoding, steps: Steps = Steps(),
                       on_token=None):
    """prompt [1, P] -> (ids [1, N], stats), over setup_caches' caches shared with `draft`
    (make_draft, share_caches). gamma = 0 is autoregressive decoding by the target over the
    same cache (INT8 view, same buffer policy): the baseline QuantSpec must equal when greedy."""
    B, P = prompt.shape
    if B != 1:
        raise ValueError("QuantSpec decodes one sequence at a time (acceptance differs per row)")
    caches = [layer.attention.kv_cache for layer in model.layers]
    boundary = next(c for c in caches if isinstance(c, QuantSpecCache))
    device, temperature, eos_ids = prompt.device, decoding.temperature, decoding.eos_ids
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    x = decoding.sample(steps.prefill(model, prompt))
    sync()
    stats = dict(prefill_s=time.perf_counter() - t0, drafted=0, accepted=0, rounds=0, gamma=gamma)
    out = [int(x)]
    if on_token:
        on_token(x)
    t1 = time.perf_counter()
    pos = torch.tensor([P], device=device)
    while len(out) < decoding.max_new_tokens and not (eos_ids and out[-1] in eos_ids):
        tokens, probs, t = [x], [], x
        for i in range(gamma):
            t, q = steps.draft(draft, t, pos + i, temperature)
            tokens.append(t)
            probs.append(q)
        fed = torch.stack(tokens, 1)  # [1, gamma + 1]
        logits = steps.verify(model, fed, pos + torch.arange(gamma + 1, device=device))
        if gamma:
            q = torch.stack(probs, 1) if temperature > 0 else torch.zeros(1, gamma, 1, device=device)
            a, nxt = accept(logits, fed[:, 1:], q, temperature, cap=boundary_cap(boundary))
        else:
            a, nxt = torch.zeros(1, dtype=torch.long, device=device), sample(logits[:, 0], temperature, None)
        steps.commit(caches, a[0] + 1)  # x, d_1..d_a stay
        n = int(a[0])  # the one sync of the round: the tokens leave the device
        new = fed[0, 1:1 + n].tolist() + [int(nxt[0])]
        stats["drafted"] += gamma
        stats["accepted"] += n
        stats["rounds"] += 1
        for tok in new:
            if len(out) >= decoding.max_new_tokens or (eos_ids and out[-1] in eos_ids):
                break
            out.append(tok)
            if on_token:
                on_token(torch.tensor([tok]))
        pos = pos + n + 1
        x = nxt
    sync()
    n_new = len(out) - 1
    stats["decode_s"] = time.perf_counter() - t1
    stats["decode_tok_s"] = n_new / stats["decode_s"] if n_new else 0.0
    stats["acceptance_rate"] = stats["accepted"] / stats["drafted"] if stats["drafted"] else None
    return torch.tensor([out], device=device), stats
