"""The prefill side of tools/baselines.py (kvpress venv; no project root module): kvpress's hook on the
pressed layers, the attention that also returns H2O's column sums, and the shared prefill every cell of a
prompt starts from (docs/baselines.md, "One prefill for every cell").

H2O (kvpress's ObservedAttentionPress) scores a key by the attention it received during the prefill:
the eager attention weights summed over the queries, divided by how many queries saw the key. Only that
sum is needed, so the attention here (COLSUM, registered with transformers as an attention
implementation) is sdpa's, plus, in a layer marked `record_colsum`, the softmax weights summed over the
queries, computed a block of queries at a time: [B, heads, 1, keys] in place of eager's [B, heads,
queries, keys], whose `.sum(2)` is the same. At 16k tokens on Gemma 3 that is 256 KiB a layer instead of
4 GiB, so one sdpa prefill serves every press, H2O included.
"""
import time

COLSUM = "sdpa_colsum"  # the attention implementation the runner loads models with
QUERY_BLOCK = 512  # queries per block of the column sums: [B, heads, 512, keys] fp32 at a time


def column_sums(query, key, mask, scaling: float):
    """softmax(q k^T * scaling + mask) summed over the queries: query [B, Hq, T, D], key [B, Hkv, S, D], mask
    None (causal, the queries the last T positions), boolean (True: attend) or additive -> [B, Hq, 1, S] fp32."""
    import torch
    B, Hq, T, _ = query.shape
    S = key.shape[2]
    k = key.repeat_interleave(Hq // key.shape[1], 1).float()
    out = torch.zeros(B, Hq, 1, S, dtype=torch.float32, device=query.device)
    for t0 in range(0, T, QUERY_BLOCK):
        t1 = min(T, t0 + QUERY_BLOCK)
        logits = query[:, :, t0:t1].float() @ k.transpose(2, 3) * scaling
        if mask is None:
            pos = torch.arange(S - T + t0, S - T + t1, device=query.device)
            logits = logits.masked_fill(torch.arange(S, device=query.device)[None, :] > pos[:, None], -torch.inf)
        elif mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask[..., t0:t1, :S], -torch.inf)
        else:
            logits = logits + mask[..., t0:t1, :S].float()
        out += logits.softmax(-1).sum(2, keepdim=True)
    return out


def register_colsum_attention():
    """COLSUM as a transformers attention implementation: sdpa's output; as its weights, the column
    sums in a module with `record_colsum` set (None elsewhere, as sdpa returns)."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
        if not getattr(module, "record_colsum", False):
            return out, None
        return out, column_sums(query, key, attention_mask, scaling if scaling is not None else module.head_dim ** -0.5)
    transformers.AttentionInterface.register(COLSUM, attention)
    transformers.AttentionMaskInterface.register(COLSUM, sdpa_mask)


def attention_module(model, i):
    """Layer i's attention module, handed the model's rotary embedding (some presses re-rotate queries)."""
    attn = model.model.layers[i].self_attn
    attn.rotary_emb = model.model.rotary_emb
    return attn


def record_colsums(model, layers, on: bool):
    """Mark (or unmark) the layers whose attention returns its column sums (H2O's score)."""
    for i in layers:
        attention_module(model, i).record_colsum = on


class Hooked:
    """`hook` as a forward hook on the pressed layers' attention modules, for one prefill. With a press's
    hook it is what kvpress's `press(model)` does, minus the sliding layers it presses on Gemma 3's text model."""

    def __init__(self, model, hook, layers):
        self.model, self.hook, self.layers, self.hooks = model, hook, layers, []

    def __enter__(self):
        self.hooks = [attention_module(self.model, i).register_forward_hook(self.hook, with_kwargs=True)
                      for i in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


class SharedPrefill:
    """One prefill that every press and budget on a prompt shares. A press prunes a layer's K/V after
    that layer's exact attention, so the prefill's hidden states do not depend on the press: record what
    kvpress's hook sees in each pressed layer (input hidden states, rotary embeddings, with `colsums` the
    attention's column sums) and every layer's K/V; give each cell a cache as its own pressed prefill
    would leave it.

    Two forwards: the context ids[:at] (what a press compresses unless question-aware; the same
    forward as `run`'s prefill), then the question ids[at:] appended. A question-aware cell sees the
    two chunks joined (one forward's hidden states, K/V and column sums, up to rounding). The recording
    cache keeps every entry (a sliding layer's mask still applies its window)."""

    def __init__(self, model, ids, at, pressed, colsums: bool):
        import torch
        import transformers
        self.model, self.ids, self.at, self.pressed = model, ids, at, pressed
        self.full = transformers.DynamicCache()  # no config: full layers, every entry kept
        self.chunks = {i: [] for i in pressed}

        def hook(module, args, kwargs, output):
            self.chunks[module.layer_idx].append((kwargs["hidden_states"], kwargs["position_embeddings"], output[1]))
        self.logits = []  # the last position's logits after the context, and after the whole prompt
        t0 = time.perf_counter()
        record_colsums(model, pressed, colsums)
        try:
            with torch.no_grad(), Hooked(model, hook, pressed):
                for lo, hi in ((0, at), (at, len(ids))):
                    if hi > lo:
                        p = torch.arange(lo, hi)
                        self.logits.append(model(input_ids=torch.tensor([ids[lo:hi]]), past_key_values=self.full,
                                                 position_ids=p[None], cache_position=p, use_cache=True,
                                                 logits_to_keep=1).logits[0, -1])
        finally:
            record_colsums(model, pressed, False)
        self.seconds = time.perf_counter() - t0

    def inputs(self, i, n, colsums: bool):
        """What kvpress's hook on layer i sees after a prefill of the first n tokens (n = at or all); the
        column sums of both chunks added (each key's sum over every query that saw it) when `colsums`."""
        import torch
        import torch.nn.functional as F
        chunks = self.chunks[i][:1] if n == self.at else self.chunks[i]
        hs = torch.cat([c[0] for c in chunks], dim=1)
        cos, sin = (torch.cat([c[1][j] for c in chunks], dim=1) for j in (0, 1))
        sums = sum(F.pad(c[2], (0, n - c[2].shape[-1])) for c in chunks) if colsums else None
        layer = self.full.layers[i]
        return hs, layer.keys[:, :, :n], layer.values[:, :, :n], sums, dict(hidden_states=hs, position_embeddings=(cos, sin))

    def cache(self, n, make_cache, press=None, colsums=False):
        """A cache as a pressed prefill of ids[:n] leaves it: every layer's K/V through that layer's own
        update (a sliding layer keeps its window, a quantized layer quantizes), then each pressed
        layer's entries replaced by what the press keeps (kvpress's hook does the same)."""
        import torch
        cache = make_cache()
        with torch.no_grad():
            for i, layer in enumerate(self.full.layers):
                cache.layers[i].update(layer.keys[:, :, :n], layer.values[:, :, :n])
            if press is not None:
                for i in self.pressed:
                    hs, k, v, sums, kwargs = self.inputs(i, n, colsums)
                    module = attention_module(self.model, i)
                    cache.layers[i].keys, cache.layers[i].values = press.compress(module, hs, k, v, sums, kwargs)
        return cache

    def logits_after(self, n):
        return self.logits[0] if n == self.at else self.logits[-1]
