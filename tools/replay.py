"""The shared prefill of the evaluations and benchmarks (tools/eval.py, tools/bench.py --shared-prefill,
tools/bench_hf.py): one exact prefill per prompt, stored into every cache under test."""
import torch

from cache import FullCache


class PrefillReplay:
    """Algorithm 1 once per prompt, replayed into every cache configuration. The prompt is prefilled
    in chunks through fp caches that record it (Recorder): a layer that attends to every position keeps
    all of them (and the queries, only for `methods` that read them, None: all: ZipCache's saliency probes,
    InfLLM's representative scores; 5.6 GB on a 1.5B model at 32k), a layer with a shorter sliding window its
    ring, as its own FullCache would. Every new set of caches then stores the recording as its own one-chunk
    prefill would (quantize, offload; a ring copies the window): the exact attention of Algorithm 1 over the
    whole prompt. Evaluations run many caches on the same prompt: this turns N prefills into one.
    one_row (tools/bench.py --prefill-one-row): the batch's rows are one prompt, so one row is prefilled and
    stored into every row, a chunk at a time (Table 3's 75 rows of 32k tokens: minutes of prefill otherwise)."""

    def __init__(self, chunk: int = 2048, methods=None, one_row: bool = False):
        self.chunk, self.key, self.recorded, self.logits, self.one_row = chunk, None, None, None, one_row
        self.keep_queries = methods is None or any(m.scheme == "zipcache" or m.kind == "infllm" for m in methods)

    def __call__(self, model, prompt):
        from generate import prefill
        batch = prompt.shape[0]
        if self.one_row:
            if not bool((prompt == prompt[:1]).all()):
                raise ValueError("one_row: the batch's rows are different prompts")
            prompt = prompt[:1]
        # a left-padded batch of different prompts: the caches' row_start, which the recording masks by too
        saved = getattr(model, "row_start", None)
        row_start = None if saved is None or not bool(saved.any()) else saved
        key = (tuple(prompt.shape), hash(tuple(map(tuple, prompt.tolist()))), str(prompt.device),
               None if row_start is None else tuple(row_start.tolist()))
        if key != self.key:
            caches = [layer.attention.kv_cache for layer in model.layers]
            B, P = prompt.shape
            w, a = model.tok_embeddings.weight, model.args
            self.recorded = model.setup_caches(lambda i: Recorder(B, a.n_kv_heads, P, a.head_dim, w.dtype, w.device,
                                                                  sliding_window=a.window(i), keep=self.keep_queries,
                                                                  row_start=row_start), row_start)
            self.logits, self.key = prefill(model, prompt, self.chunk), key
            for layer, cache in zip(model.layers, caches):
                layer.attention.kv_cache = cache
            model.row_start = saved
        for layer, rec in zip(model.layers, self.recorded):
            self.store(layer.attention.kv_cache, rec.recording(), batch)
        return self.logits.expand(batch, -1)

    def store(self, cache, recording, batch):
        k, v, pos, q = recording
        if k.shape[0] == batch:
            return cache.append_prefill(k, v, pos, q)
        rows = lambda x, s: None if x is None else x[:, :, s].expand(batch, -1, -1, -1)  # noqa: E731
        for s in range(0, k.shape[2], self.chunk):  # (each append copies what it is given: a chunk's rows)
            part = slice(s, s + self.chunk)
            cache.append_prefill(rows(k, part), rows(v, part), pos[part], rows(q, part))


class Recorder(FullCache):
    """A prefill-only FullCache for PrefillReplay (a ring for a layer with a shorter sliding window)
    that also keeps the queries of a layer that attends to every position (unless keep_queries=False)."""

    def __init__(self, *args, keep=True, **kw):
        super().__init__(*args, **kw)
        self.keep_queries = keep

    def prefill(self, q, k, v, input_pos):
        if not self.ring and self.keep_queries:
            self.queries = getattr(self, "queries", []) + [q]
        return super().prefill(q, k, v, input_pos)

    def recording(self):
        """(k, v, positions, q) of what the layer keeps, in position order (q None for a ring or unkept):
        the same tensors on every call, once the prefill is over (InfLLM's replay shares its softmax
        normalisers by them), views of the cache where its slots are the positions in order."""
        if getattr(self, "kept", None) is None:
            pos, order = self.key_pos.sort()
            n = int((pos < self.EMPTY).sum())
            pos, order = pos[:n], order[:n]
            if torch.equal(order, torch.arange(n, device=order.device)):
                k, v = self.k_cache[:, :, :n], self.v_cache[:, :, :n]
            else:
                k, v = self.k_cache[:, :, order], self.v_cache[:, :, order]
            q = None if self.ring or not self.keep_queries else torch.cat(self.queries, 2)
            self.__dict__.pop("queries", None)  # (the chunks, now joined in q)
            self.kept = (k, v, pos, q)
        return self.kept
