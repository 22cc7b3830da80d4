"""Can per-row side information make the low-bit top-k closer to the exact fp16 top-k?

The real token's own low-bit top-k bounds what any policy that ranks by low-bit scores can fetch.
This study decodes with a SpeCache preset (eager, CPU) and, at every layer and decode step, ranks
the quantized positions for the real token's query by several estimators of q.k, then reports the
share of the exact fp16 top-k (topk.topk_exact's reduction: softmax per query head over the
quantized positions, summed over the kv head's query heads) each estimator's top-k holds:

  base      q.k' with k' the dequantized low-bit key (what topk_lowbit ranks by)
  ucb<l>    q.k' + l |q| |e| / sqrt(D): an optimistic bound, e = k - k' per row (one fp16 per row)
  lognorm   q.k' + |q|^2 |e|^2 / (2D): E[exp(q.k)] for an isotropic error of norm |e|
  normfix   q.k' |k| / |k'|: the key's exact norm restored (one fp16 per row)
  diagvar   q.k' + sum_c q_c^2 e_c^2 / 2: the per-channel error (as much side data as the key itself)
  recall@2k share of the exact top-k inside the base estimator's top-2k (fetching twice the rows)
  requant   base recomputed here: the host keys quantized with quant.quantize_keys (checks the study)
  prerope   the keys quantized *before* RoPE (the rotation undone, quantized per channel in the same
            groups, rotated back): KVQuant's observation that channel outliers are fixed pre-RoPE
  hadamard  the keys times a normalized Hadamard matrix before quantizing (q rotated alike, q.k kept)

Run from the repository root:
  python results/policies/estimators/estimators.py --method specache-1bit-resync-k96-g32-r32-sink4
"""
import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import quant  # noqa: E402
import topk  # noqa: E402
from cache import SpeCache  # noqa: E402
from config import CacheConfig  # noqa: E402
from model import apply_rope  # noqa: E402
from tools import eval as ev  # noqa: E402


def overlap(got, exact):
    return float((exact[..., :, None] == got[..., None, :]).any(-1).float().mean())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="specache-1bit-resync-k96-g32-r32-sink4")
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt", default="essay", choices=["essay", "needle"])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results.jsonl")
    args = p.parse_args()
    runner = ev.Runner(ev.parse_args(["hitrate", "--threads", "1", "--out", "/tmp/unused"]))
    m = CacheConfig.from_name(args.method)
    hits = {}

    @torch.no_grad()
    def hook(cache, a, kw):
        got = dict(zip(("q", "k", "v", "input_pos", "mode"), a), **kw)
        nq = int(cache.n_quant)
        if got.get("mode", "decode") != "decode" or nq == 0:
            return
        q = got["q"][:, :, 0].float()
        keys = cache.prefetcher.host_keys(cache.layer_idx)[:, :, :nq].float()
        B, H, D = q.shape
        Hkv = keys.shape[1]
        approx = cache.dequantized(nq)[0].float()
        qg = q.reshape(B, Hkv, H // Hkv, D) * cache.sm_scale
        valid = torch.arange(nq) >= cache.sinks
        n = min(cache.n_fetch, nq - cache.sinks)

        def top(logits, k=n):  # [B,Hkv,G,nq] -> the k positions of highest summed probability
            prob = torch.softmax(logits.masked_fill(~valid, -1e30), -1).sum(2)
            return torch.where(valid, prob, -1.0).topk(min(k, nq - cache.sinks), -1).indices

        exact = topk.topk_exact(q, keys, nq, n, cache.sm_scale, first=cache.sinks)[1]  # the oracle's choice
        base = qg @ approx.transpose(-1, -2)
        err = keys - approx
        q_norm, e_norm = qg.norm(dim=-1, keepdim=True), err.norm(dim=-1)[:, :, None]
        scores = {"base": base, "lognorm": base + (q_norm * e_norm) ** 2 / (2 * D),
                  "normfix": base * (keys.norm(dim=-1) / approx.norm(dim=-1).clamp_min(1e-6))[:, :, None],
                  "diagvar": base + 0.5 * (qg ** 2) @ (err ** 2).transpose(-1, -2)}
        for lam in (0.5, 1.0, 2.0):
            scores[f"ucb{lam}"] = base + lam * q_norm * e_norm / math.sqrt(D)
        rot = runner.model.rope[:nq].float()  # [nq, D/2, 2] (cos, sin)

        def rotate(x, sign):  # x [B,Hkv,nq,D]; sign -1 (sin negated) undoes the rotation
            return apply_rope(x.transpose(1, 2), rot * torch.tensor([1.0, sign])).transpose(1, 2)

        def requant(x):
            keep = torch.arange(nq // m.group) == 0 if not m.sinks else None
            c, sc, z = quant.quantize_keys(x, m.bits, m.group, m.one_bit, fit=m.fit, keep_range=keep)
            return quant.dequantize_keys(c, sc, z, m.bits, m.group)

        had = torch.ones(1, 1)
        while had.shape[0] < D:
            had = torch.cat([torch.cat([had, had], 1), torch.cat([had, -had], 1)], 0)
        had = had / math.sqrt(D)
        scores["hadamard"] = (qg @ had) @ requant(keys @ had).transpose(-1, -2)
        scores["requant"] = qg @ requant(keys).transpose(-1, -2)
        scores["prerope"] = qg @ rotate(requant(rotate(keys, -1.0)), 1.0).transpose(-1, -2)
        for name, s in scores.items():
            hits.setdefault(name, []).append(overlap(top(s), exact))
        hits.setdefault("recall@2k", []).append(overlap(top(base, 2 * n), exact))

    def attach(caches):
        for c in caches:
            if isinstance(c, SpeCache):
                c.register_forward_pre_hook(hook, with_kwargs=True)

    if args.prompt == "needle":
        text = ev.render(runner.tok, ev.niah(runner.tok, args.length, 0.5))
    else:
        text = ev.summary_prompt(runner.tok, args.length, 0)
    runner.generate(m, runner.encode_prompt(text), args.steps, before=attach)
    row = dict(method=args.method, prompt=args.prompt, length=args.length, steps=args.steps,
               **{k: round(100 * sum(v) / len(v), 1) for k, v in hits.items()})
    print(json.dumps(row))
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
