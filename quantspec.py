"""QuantSpec (quantspec.txt §4, Algorithm 1): self-speculative decoding over one hierarchical cache.

    python generate.py --method quantspec --gamma 4 --prompt-file essay.txt     # greedy, or --temperature
    python eval.py quantspec --lengths 4000,8000 --gammas 1,2,4,6               # acceptance rates

The draft is the model itself with two cheaper parts: its linear layers (and output head) use
group-wise INT4 weights (`Int4Linear`, its own copy; norms and embeddings are shared), and its
attention reads only the upper INT4 planes of the hierarchical KV cache. The target is the model
with its own weights reading both planes (the INT8 view). Both write to one QuantSpecCache
(cache.py): no second KV cache exists.

One round (`generate_quantspec`):
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
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import quant
from generate import compile_step, prefill, sample


# ---- the draft's weights ---------------------------------------------------------------------------
class Int4Linear(nn.Module):
    """y = x @ W'^T with W' the group-wise INT4 copy of W (quant.quantize_weight_int4). Runs ATen's
    int4 weight-only matmul (CPU: `_weight_int4pack_mm_for_cpu`, CUDA: `_weight_int4pack_mm`, both
    with bf16 activations, as they require), or the torch reference (dequantize, then matmul) where
    those are missing."""

    def __init__(self, weight: torch.Tensor, group: int = 32):
        super().__init__()
        codes, scale, zero = quant.quantize_weight_int4(weight, group)
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
        w = quant.dequantize_weight_int4(self.codes, self.scale, self.zero, self.group, x.dtype)
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


# ---- the loop --------------------------------------------------------------------------------------------
def draft_step(draft, token, input_pos, temperature: float = 0.0):
    """One draft token: token [B] at input_pos [1] -> (next token [B], its distribution [B, V])."""
    logits = draft(token[:, None], input_pos, mode="draft")[:, 0]
    probs = torch.softmax(logits / max(temperature, 1e-6), -1) if temperature > 0 else logits
    return sample(logits, temperature, None), probs


def verify_step(model, tokens, input_pos):
    """The target over [x, d_1..d_g]: logits [B, g+1, V]."""
    return model(tokens, input_pos, mode="verify")


def commit(caches, n):
    for c in caches:
        c.accept(n)


@torch.no_grad()
def generate_quantspec(model, draft, prompt: torch.Tensor, max_new_tokens: int, gamma: int, *, temperature=0.0,
                       eos_ids=(), chunk=2048, on_token=None, steps=None, sync=lambda: None, prefill_fn=None):
    """prompt [1, P] -> (ids [1, N], stats). gamma = 0 is autoregressive decoding by the target over
    the same cache (INT8 view, same buffer policy): the baseline QuantSpec must equal when greedy.
    `steps`: (draft_step, verify_step, commit) to use, e.g. compiled ones (compile_steps)."""
    B, P = prompt.shape
    if B != 1:
        raise ValueError("QuantSpec decodes one sequence at a time (acceptance differs per row)")
    d_step, v_step, c_step = steps or (draft_step, verify_step, commit)
    caches = [layer.attention.kv_cache for layer in model.layers]
    device = prompt.device
    t0 = time.perf_counter()
    logits = prefill_fn(model, prompt) if prefill_fn else prefill(model, prompt, chunk)
    x = sample(logits, temperature, None)
    sync()
    stats = dict(prefill_s=time.perf_counter() - t0, drafted=0, accepted=0, rounds=0, gamma=gamma)
    out = [int(x)]
    if on_token:
        on_token(x)
    t1 = time.perf_counter()
    pos = torch.tensor([P], device=device)
    while len(out) < max_new_tokens and not (eos_ids and out[-1] in eos_ids):
        tokens, probs, t = [x], [], x
        for i in range(gamma):
            t, q = d_step(draft, t, pos + i, temperature)
            tokens.append(t)
            probs.append(q)
        fed = torch.stack(tokens, 1)  # [1, gamma + 1]
        logits = v_step(model, fed, pos + torch.arange(gamma + 1, device=device))
        if gamma:
            q = torch.stack(probs, 1) if temperature > 0 else torch.zeros(1, gamma, 1, device=device)
            a, nxt = accept(logits, fed[:, 1:], q, temperature, cap=boundary_cap(caches[0]))
        else:
            a, nxt = torch.zeros(1, dtype=torch.long, device=device), sample(logits[:, 0], temperature, None)
        c_step(caches, a[0] + 1)  # x, d_1..d_a stay
        n = int(a[0])  # the one sync of the round: the tokens leave the device
        new = fed[0, 1:1 + n].tolist() + [int(nxt[0])]
        stats["drafted"] += gamma
        stats["accepted"] += n
        stats["rounds"] += 1
        for tok in new:
            if len(out) >= max_new_tokens or (eos_ids and out[-1] in eos_ids):
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


def compile_steps(device, gamma: int):
    """The draft step, the verify step (gamma + 1 tokens) and the commit, each one fullgraph graph
    (CUDA graphs on CUDA)."""
    d, v, c = (compile_step(device, f) for f in (draft_step, verify_step, commit))
    if device.type != "cuda":
        return d, v, c
    # A CUDA graph's outputs live in its pool and the next replay of the same graph overwrites them:
    # gamma draft steps replay one graph, and each token feeds the next and the verify step. The
    # outputs (a token, a distribution, the logits) are small: copy them out.
    def draft(*a):
        return tuple(x.clone() for x in d(*a))

    def verify(*a):
        return v(*a).clone()
    return draft, verify, c
