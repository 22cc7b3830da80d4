"""Where do SpeCache's fetches miss? Measurements of the fetched rows against exact attention,
taken from outside the decode path (forward hooks on the SpeCache layers; eager runs only).

For each layer and decode step, with p the real token's exact attention probabilities (fp16 keys
from the host store, over every position it sees, softmax per query head) and H the rows held in
fp16 while it attends (the ring):
  hit      |H ∩ top-k(p)| / |top-k(p)|, top-k over the quantized positions by p summed over the
           kv head's query heads (rebuttal Q6's "top-k hit rate" against the exact fp16 top-k)
  hit_own  the same against the real token's own low-bit top-k (what a sequential fetch brings)
  mass     sum of p over H, mean over query heads: the share of the real token's attention
           that the fetched rows carry exactly (1.0 when every row it cares about was fetched)
  mass_topk  the same for the exact top-k: the best any k rows could do
Steps with nothing quantized yet are not recorded.
"""
import torch

import kernels
from cache import SpeCache
from kernels import Residual


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
        names = ("q", "k", "v", "input_pos", "mode")
        got = dict(zip(names, args), **kwargs)
        got.setdefault("mode", "decode")
        return got

    def _before(self, i):
        @torch.no_grad()
        def hook(cache, args, kwargs):
            a = self._args(args, kwargs)
            if a["mode"] != "decode" or int(cache.n_quant) == 0:
                self._pending.pop(i, None)
                return
            q, k = a["q"][:, :, 0].float(), a["k"][:, :, :1]
            pos = int(a["input_pos"][0])
            n_quant = int(cache.n_quant)
            B, H, D = q.shape
            Hkv = k.shape[1]
            G = H // Hkv
            # exact probabilities of the real token: host keys [0, pos) and its own key
            keys = torch.cat([cache.prefetcher.host_keys(cache.layer_idx)[:, :, :pos].float(), k.float()], 2)
            logits = torch.einsum("bhgd,bhsd->bhgs", q.view(B, Hkv, G, D), keys) * cache.sm_scale
            p = torch.softmax(logits, -1)  # [B,Hkv,G,pos+1]
            score = p[..., :n_quant].sum(2)  # per kv head, over the quantized positions
            n = min(cache.n_fetch, n_quant)
            top = score.topk(n, -1).indices
            # the real token's own low-bit top-k: its low-bit attention without fetched rows
            res_k = torch.cat([cache.k_res[:, :, :int(cache.res_len)], k.to(cache.k_res.dtype)], 2)
            res_v = torch.cat([cache.v_res[:, :, :int(cache.res_len)], a["v"][:, :, :1].to(cache.v_res.dtype)], 2)
            _, lse = kernels.attention_lowbit_ref(a["q"][:, :, :1], cache.stored(),
                                                  Residual(res_k, res_v, torch.tensor(res_k.shape[2])), None,
                                                  cache.sm_scale)
            own_score, own = kernels.topk_lowbit_ref(q, lse[:, :, 0], cache.stored(), n, cache.sm_scale)
            self._pending[i] = dict(step_pos=pos, n_quant=n_quant, p=p, top=top, own=own,
                                    held=_held(cache), mass_topk=_mass(p, top))
        return hook

    def _after(self, i):
        @torch.no_grad()
        def hook(cache, args, kwargs, output):
            rec = self._pending.pop(i, None)
            if rec is None:
                return
            # Sequential/oracle fetch inside the step: the real token used what the ring holds now.
            held = _held(cache) if cache.fetch in ("sequential", "oracle") else rec["held"]
            p, top, own = rec.pop("p"), rec.pop("top"), rec.pop("own")
            rec.update(hit=_overlap(held, top), hit_own=_overlap(held, own), mass=_mass(p, held))
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


def _held(cache) -> torch.Tensor:
    """[B,Hkv,K] positions held in fp16 by the ring, -1 for unused slots."""
    return torch.where(cache.fetch_valid, cache.fetch_idx, -1).clone()


def _overlap(held, top) -> float:
    """Mean over batch and kv heads of |held ∩ top| / |top|."""
    hit = (top[..., :, None] == held[..., None, :]).any(-1).float()
    return float(hit.mean())


def _mass(p, rows) -> float:
    """Mean over query heads of the probability on `rows` ([B,Hkv,K] positions, -1 = none)."""
    safe = rows.clamp(min=0)[:, :, None, :].expand(-1, -1, p.shape[2], -1)
    taken = torch.gather(p, 3, safe) * (rows >= 0)[:, :, None, :]
    return float(taken.sum(-1).mean())
