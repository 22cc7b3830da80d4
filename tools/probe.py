"""Where do SpeCache's fetches miss, and which misses matter? Measurements of the fetched rows
against exact attention, taken from outside the decode path (forward hooks on the SpeCache layers;
eager runs only).

For each layer and decode step, with p the real token's exact attention probabilities (fp16 keys
from the host store, over every position it sees, softmax per query head) and H the rows held in
fp16 while it attends (the ring: fetched rows and attention sinks):
  hit       |H ∩ top-k| / |top-k|, top-k = the exact top-k over the quantized positions
            (kernels.topk_exact, the oracle's choice): rebuttal Q6's "top-k hit rate"
  hit_mass  the same against the k quantized positions that carry the most of the real token's
            attention (p summed over the kv head's query heads): the set that maximizes `mass`.
            Under GQA the two top-k differ only in how query heads are weighed: topk_exact
            renormalizes each head over the quantized positions, so a head whose attention sits
            on the sinks and the recent window votes as loudly as one that attends the old tokens.
            The two agree for one query head, and nearly agree with no sinks (docs/policies.md).
  hit_own   the same against the real token's own low-bit top-k (what a sequential fetch brings)
  mass      sum of p over H, mean over query heads: the share of the real token's attention
            that its fp16 rows carry exactly; mass_topk / mass_best: the same for the exact /
            the most-mass top-k (no k rows carry more than mass_best)
  err       relative L2 error of the real token's attention output with H in fp16 and the rest
            low-bit, against exact attention (mean over query heads); err_topk / err_own / err_none:
            the same with the exact top-k rows, with its own low-bit top-k rows, with no fp16 rows.
            The error is what the next layer sees; hit and mass only say how the choice overlaps.
  reuse     |R' ∩ R| / |R'|: of the rows the ring holds after the step (R', this step's fetch;
            sinks aside), the share it already held before the step (R): rows a transfer that
            moves only what the ring lacks would not copy again.
Steps with nothing quantized yet are not recorded.
"""
import torch

import kernels
from cache import SpeCache
from quant import Fetched, Residual

KEYS = ("hit", "hit_mass", "hit_own", "mass", "mass_topk", "mass_best", "err", "err_topk", "err_own", "err_none",
        "reuse")


class FetchProbe:
    def __init__(self, caches):
        self.caches = [c for c in caches if isinstance(c, SpeCache)]
        self.records = [[] for _ in self.caches]  # per layer: one dict per decode step
        self._pending = {}
        self._handles = []
        for i, c in enumerate(self.caches):
            self._handles.append(c.register_forward_pre_hook(self._before(i), with_kwargs=True))
            self._handles.append(c.register_forward_hook(self._after(i), with_kwargs=True))

    def remove(self):
        for h in self._handles:
            h.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    @staticmethod
    def _args(args, kwargs):
        got = dict(zip(("q", "k", "v", "input_pos", "mode"), args), **kwargs)
        got.setdefault("mode", "decode")
        return got

    def _before(self, i):
        @torch.no_grad()
        def hook(cache, args, kwargs):
            a = self._args(args, kwargs)
            if a["mode"] != "decode" or int(cache.n_quant) == 0:
                self._pending.pop(i, None)
                return
            pos, n_quant = int(a["input_pos"][0]), int(cache.n_quant)
            q = a["q"][:, :, :1]  # the real token
            k_own, v_own = a["k"][:, :, :1], a["v"][:, :, :1]
            host_k = cache.prefetcher.host_keys(cache.layer_idx)
            host_v = cache.prefetcher.host_v[cache.layer_idx].to(host_k.device)
            keys = torch.cat([host_k[:, :, :pos].float(), k_own.float()], 2)
            vals = torch.cat([host_v[:, :, :pos].float(), v_own.float()], 2)
            B, H, _, D = q.shape
            Hkv = keys.shape[1]
            G = H // Hkv
            logits = (q.float().reshape(B, Hkv, G, D) @ keys.transpose(-1, -2)) * cache.sm_scale
            p = torch.softmax(logits, -1)  # [B,Hkv,G,pos+1]
            exact_out = p @ vals  # [B,Hkv,G,D]
            n = min(cache.n_fetch, n_quant - cache.sinks)
            _, top = kernels.topk_exact(q[:, :, 0], host_k, cache.n_quant, n, cache.sm_scale, first=cache.sinks)
            best = most_mass_topk(p, cache.sinks, n_quant, n)
            # the real token's own low-bit attention (its kept rows, no fetched rows) and top-k
            res = Residual(torch.cat([cache.k_res[:, :, :int(cache.res_len)], k_own.to(cache.k_res.dtype)], 2),
                           torch.cat([cache.v_res[:, :, :int(cache.res_len)], v_own.to(cache.v_res.dtype)], 2),
                           torch.tensor(int(cache.res_len) + 1))
            none_out, lse = kernels.attention_lowbit_ref(q, cache.stored(), res, None, cache.sm_scale)
            _, own = kernels.topk_lowbit_ref(q[:, :, 0], lse[:, :, 0], cache.stored(), n, cache.sm_scale,
                                             first=cache.sinks)
            sinks = torch.where(cache.fetch_valid[:, :, :cache.sinks], cache.fetch_idx[:, :, :cache.sinks], -1)

            def err_with(rows):  # rows [B,Hkv,n] quantized positions held in fp16 (-1: none)
                rows = torch.cat([sinks, rows], 2)
                valid = rows >= 0
                safe = rows.clamp(min=0)
                gather = lambda x: torch.gather(x, 2, safe[..., None].expand(-1, -1, -1, D))  # noqa: E731
                f = Fetched(gather(host_k).to(cache.k_res.dtype), gather(host_v).to(cache.v_res.dtype), safe, valid)
                out, _ = kernels.attention_lowbit_ref(q, cache.stored(), res, f, cache.sm_scale)
                return _rel_err(out, exact_out)

            self._pending[i] = dict(step_pos=pos, n_quant=n_quant, p=p, top=top, best=best, own=own, err_with=err_with,
                                    held=_held(cache), mass_topk=_mass(p, top), mass_best=_mass(p, best),
                                    err_topk=err_with(top), err_own=err_with(own), err_none=_rel_err(none_out, exact_out))
        return hook

    def _after(self, i):
        @torch.no_grad()
        def hook(cache, args, kwargs, output):
            rec = self._pending.pop(i, None)
            if rec is None:
                return
            # A fetch inside the step (sequential, oracle): the real token used what the ring holds now.
            before, after = rec["held"][:, :, cache.sinks:], _held(cache)[:, :, cache.sinks:]
            held = before if cache.policy.ahead else after
            p, top, best, own = rec.pop("p"), rec.pop("top"), rec.pop("best"), rec.pop("own")
            rec.update(hit=_overlap(held, top), hit_mass=_overlap(held, best), hit_own=_overlap(held, own),
                       mass=_mass(p, held), err=rec.pop("err_with")(held), reuse=_reuse(before, after))
            del rec["held"]
            self.records[i].append(rec)
        return hook

    # ---- summaries ---------------------------------------------------------------------------------
    def per_step(self, key) -> list:
        """Mean over layers of `key`, one value per recorded decode step (the steps all layers saw)."""
        n = min((len(r) for r in self.records), default=0)
        return [sum(r[s][key] for r in self.records) / len(self.records) for s in range(n)]

    def per_layer(self, key) -> list:
        return [sum(x[key] for x in r) / len(r) if r else None for r in self.records]


def most_mass_topk(p, first: int, n_quant: int, k: int) -> torch.Tensor:
    """The k positions in [first, n_quant) that carry the most attention: p [B,Hkv,G,S] (each query
    head's probabilities over everything it attends to) summed over the kv head's G query heads
    -> [B,Hkv,k]. No k rows hold more of `mass`; kernels.topk_exact renormalizes each head over
    [first, n_quant) first, which weighs the heads differently."""
    return p[..., first:n_quant].sum(2).topk(k, -1).indices + first


def _held(cache) -> torch.Tensor:
    """[B,Hkv,sinks + K] positions held in fp16 by the ring, -1 for unused slots."""
    return torch.where(cache.fetch_valid, cache.fetch_idx, -1).clone()


def _overlap(held, top) -> float:
    """Mean over batch and kv heads of |held ∩ top| / |top|."""
    hit = (top[..., :, None] == held[..., None, :]).any(-1).float()
    return float(hit.mean())


def _reuse(before, after) -> float:
    """|after ∩ before| / |after| over the valid (>= 0) rows of all kv heads (0 when after is empty)."""
    kept = (after[..., :, None] == before[..., None, :]).any(-1) & (after >= 0)
    return float(kept.sum() / (after >= 0).sum().clamp_min(1))


def _mass(p, rows) -> float:
    """Mean over query heads of the probability on `rows` ([B,Hkv,K] positions, -1 = none)."""
    safe = rows.clamp(min=0)[:, :, None, :].expand(-1, -1, p.shape[2], -1)
    taken = torch.gather(p, 3, safe) * (rows >= 0)[:, :, None, :]
    return float(taken.sum(-1).mean())


def _rel_err(out, exact) -> float:
    """out [B,H,1,D] vs exact [B,Hkv,G,D]: mean over query heads of ||out - exact|| / ||exact||."""
    B, Hkv, G, D = exact.shape
    out = out.float().reshape(B, Hkv, G, D)
    return float(((out - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)).mean())
