"""The attention backend vLLM runs when the plugin is registered (CPU_ATTN's place): KIVI's and SpeCache's caches in
vLLM's paged KV memory, by the project's own math.

A layer's step, per request row (vLLM puts one row per decode request, prefill and decode rows in one step, in an
order that changes between steps; a row is known by its block table, its state lives in its first block):
  do_kv_cache_update  the step's K/V to the host store at vLLM's slots; a block written to is not quantized
  forward             the request's whole blocks below its final tokens that are not quantized yet are quantized
                      (LowBitCache.quantize, into the page: pages.py); then
                      prefill rows attend exactly (cache.exact_attention) over the host store (KIVI: its
                      quantized blocks dequantized, as LowBitCache.prefill reads them);
                      decode rows attend over the quantized blocks, the residual window and, for SpeCache, the
                      fetched rows (kernels.attention_lowbit_ref; the Triton kernels behind kernels.attention_op on
                      CUDA), which the fetch policy picks from that attention's logits (kernels.select_ref):
                        sequential  this step's query picks, the rows are fetched, it attends (paper Table 4)
                        lag         the previous step's query picked this step's rows; this one picks the next's
                                    (the first step picks for itself first, as pre-decoding does)
                        oracle      as sequential, by the exact top-k of the fp keys (kernels.topk_exact)
A block is quantized once all its tokens are final (vLLM counts them computed), so a rejected draft's slot, written
again, never reaches the codes. The configuration is the cache name in $SPECACHE_CACHE (CacheConfig names).
"""
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

import kernels
from cache import exact_attention
from config import CacheConfig
from integrations.specache_vllm import pages
from prefetch import rerank_exact
from quant import Fetched, Residual
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

logger = init_logger("vllm.plugins.specache")  # (vLLM shows its own loggers' lines)
ENV = "SPECACHE_CACHE"  # the cache name the engine runs (every process reads it)
LAYOUT: Optional[pages.PageLayout] = None  # this worker's page, set by the first layer's impl (customize_spec reads it)
ENGINE: Optional[int] = None  # id of the vLLM config LAYOUT was set for (in-process engines come one after another)
CAPTURE: Optional[dict] = None  # tests: {layer name: [per step {q, k, v, pos, out, fetch}]} of request row 0


def engine_config() -> CacheConfig:
    """The configuration $SPECACHE_CACHE names (ValueError for an unknown or unset name)."""
    name = os.environ.get(ENV)
    if not name:
        raise ValueError(f"the SpeCache vLLM backend needs ${ENV}: a cache name, e.g. {ENV}=specache-1bit")
    return CacheConfig.from_name(name)


class SpeCacheBackend(CPUAttentionBackend):
    """CPU_ATTN with the packed page: its declarations (dtypes, head sizes, layout) are the stock backend's."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # (vLLM looks the backend up by this name)

    @staticmethod
    def get_impl_cls():
        return SpeCacheImpl

    @staticmethod
    def get_builder_cls():
        return RowsBuilder

    @classmethod
    def customize_spec(cls, spec):
        """The page: pages.PageLayout's bytes per slot and kv head (codes, scales, zeros, the slot's share of a
        request's fp rows) in place of 2 * head_dim elements."""
        if LAYOUT is None:
            raise RuntimeError("the SpeCache backend's page is set by its attention layers, none was built")
        if spec.block_size != LAYOUT.block or spec.num_kv_heads != LAYOUT.n_kv_heads:
            raise ValueError(f"the KV spec (block {spec.block_size}, {spec.num_kv_heads} kv heads) is not the page's "
                             f"(block {LAYOUT.block}, {LAYOUT.n_kv_heads})")
        return replace(spec, state_content_bytes=LAYOUT.slot_bytes)


@dataclass
class Rows:
    """A step's rows, read once a step for every layer: row r's query tokens are [qsl[r], qsl[r + 1]), its sequence
    holds seq[r] tokens after this step's in blocks[r] (its block ids, in order), the cache slots of its positions
    [0, seq[r]) are slots[r] (on the host: they index the host store)."""
    qsl: list
    seq: list
    prefill: list  # the row is (a chunk of) its prompt
    blocks: list
    slots: list


class RowsBuilder(AttentionMetadataBuilder[Rows]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):  # (the base's is abstract)
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, cm: CommonAttentionMetadata, fast_build: bool = False) -> Rows:
        R, block = cm.num_reqs, self.kv_cache_spec.block_size
        qsl = cm.query_start_loc_cpu[:R + 1].tolist()
        seq = cm.seq_lens[:R].tolist()
        pref = cm.is_prefilling[:R].tolist() if cm.is_prefilling is not None else [qsl[r + 1] - qsl[r] > 1 for r in range(R)]
        blocks = [cm.block_table_tensor[r, :-(-L // block)].long() for r, L in enumerate(seq)]
        slots = [pages.request_slots(b.cpu(), block, L) for b, L in zip(blocks, seq)]
        return Rows(qsl, seq, [bool(p) for p in pref], blocks, slots)


class SpeCacheImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None, sinks=None):
        global LAYOUT, ENGINE
        vc = get_current_vllm_config()  # (set while the model is built: before any weight loads)
        if ENGINE != id(vc):
            LAYOUT, ENGINE = None, id(vc)
        mc, cc = vc.model_config, vc.cache_config
        config = engine_config()
        unsupported = [what for what, bad in (
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            ("a sliding window", sliding_window is not None), ("ALiBi", alibi_slopes is not None),
            ("a logits soft cap", bool(logits_soft_cap)), ("attention sinks as parameters", sinks is not None),
            (f"kv_cache_dtype {kv_cache_dtype}", kv_cache_dtype != "auto"),
            ("prefix caching", bool(cc.enable_prefix_caching)),
            (f"a layer reading another's KV ({kv_sharing_target_layer_name})", kv_sharing_target_layer_name is not None))
            if bad]
        if unsupported:
            raise ValueError(f"the SpeCache vLLM backend ({config.name}) does not run {', '.join(unsupported)} "
                             f"(model type {mc.hf_config.model_type})")
        check_head_size(head_size)
        layout = pages.PageLayout.build(config, num_kv_heads, head_size, cc.block_size, mc.dtype, mc.max_model_len)
        if LAYOUT is not None and LAYOUT != layout:
            raise ValueError("the SpeCache vLLM backend runs layers of one shape (head size, kv heads) only")
        LAYOUT = layout
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        self.config, self.layout, self.policy = config, layout, config.policy
        self.quantizer = pages.quantizer(config, num_kv_heads, head_size, mc.dtype)
        self.meta_dtype = self.quantizer.k_scale.dtype
        self.host_k = self.host_v = None  # the host store, [num_blocks * block, H, D] each, made at the first write

    # ---- the host store ------------------------------------------------------------------------------------------
    def host(self, kv_cache):
        if self.host_k is None:
            n = kv_cache.shape[0] * self.layout.block
            pin = dict(pin_memory=True) if kv_cache.is_cuda else {}  # (CUDA: the kernels read it over UVA)
            shape = (n, self.num_kv_heads, self.head_size)
            self.host_k = torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", **pin)
            self.host_v = torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", **pin)
            logger.info_once("SpeCache host store (%s): %.1f MiB a layer for %d slots", self.config.name,
                             2 * self.host_k.nbytes / 2**20, n)
        return self.host_k, self.host_v

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        host_k, host_v = self.host(kv_cache)
        n = min(slot_mapping.shape[0], key.shape[0])
        ok = slot_mapping[:n] >= 0  # (negative slots: padding)
        slots = slot_mapping[:n][ok].long()
        at = slots.cpu()
        host_k[at] = key[:n][ok].to(host_k.dtype).cpu()
        host_v[at] = value[:n][ok].to(host_v.dtype).cpu()
        self.layout.mark(self.layout.bytes_of(kv_cache), torch.unique(slots // self.layout.block), 0)

    # ---- a step ----------------------------------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # (vLLM's warm-up and memory profile)
            return output
        rows: Rows = attn_metadata
        pages_u8 = self.layout.bytes_of(kv_cache)
        self.host(kv_cache)
        for r in range(len(rows.seq)):
            q0, q1, L = rows.qsl[r], rows.qsl[r + 1], rows.seq[r]
            if q1 == q0:
                continue
            blocks, slots = rows.blocks[r], rows.slots[r]
            T = q1 - q0
            computed = L - T
            if computed == 0:  # a new request, or one recomputed after preemption: no selection yet
                self.set_selection(pages_u8, blocks[0], None)
            n_quant = computed // self.config.residual_len * self.config.residual_len
            self.flush(pages_u8, blocks, slots, n_quant)
            q = query[q0:q1].transpose(0, 1)[None]  # [1, Hq, T, D]
            if rows.prefill[r]:
                out = self.prefill(q, pages_u8, blocks, slots, computed, L, n_quant)
            else:
                out = self.decode(q, pages_u8, blocks, slots, L, n_quant)
            output[q0:q1] = out[0].transpose(0, 1).to(output.dtype)
            if CAPTURE is not None and r == 0:
                CAPTURE.setdefault(layer.layer_name, []).append(dict(
                    q=q.cpu().clone(), k=key[q0:q1].cpu().clone(), v=value[q0:q1].cpu().clone(), pos=(computed, L),
                    out=out.cpu().clone(), fetch=self.selection(pages_u8, blocks[0])))
        return output

    def flush(self, pages_u8, blocks, slots, n_quant: int):
        """Quantize the request's blocks below n_quant that are not yet (whole runs at once, from the host store)."""
        nb = n_quant // self.layout.block
        if nb == 0:
            return
        todo = (~self.layout.quantized(pages_u8, blocks[:nb])).nonzero().flatten().tolist()
        for first, last in runs(todo):
            at = blocks[first:last + 1]
            pos = slice(first * self.layout.block, (last + 1) * self.layout.block)
            k, v = self.host_k[slots[pos]], self.host_v[slots[pos]]  # [n, H, D]
            per_row, per_group = pages.quantize_blocks(self.quantizer, k.transpose(0, 1)[None],
                                                       v.transpose(0, 1)[None], pos.start)
            self.layout.write(pages_u8, at, per_row, per_group)
            self.layout.mark(pages_u8, at, 1)

    def rows_of(self, slots, lo: int, hi: int, dtype, device):
        """Host rows of positions [lo, hi) as [1, H, hi - lo, D] K and V."""
        at = slots[lo:hi]
        return (self.host_k[at].transpose(0, 1)[None].to(device, dtype), self.host_v[at].transpose(0, 1)[None].to(device, dtype))

    def prefill(self, q, pages_u8, blocks, slots, computed: int, L: int, n_quant: int):
        """Exact attention of positions [computed, L) over [0, L): the host store's rows (KIVI: its quantized
        blocks dequantized, as LowBitCache reads back an earlier chunk)."""
        if self.config.kind == "kivi" and n_quant:
            store = self.layout.read(pages_u8, blocks[:n_quant // self.layout.block], n_quant, self.meta_dtype)
            kq, vq = store.dequantized()
            k_fp, v_fp = self.rows_of(slots, n_quant, L, q.dtype, q.device)
            k, v = torch.cat([kq.to(q.dtype), k_fp], 2), torch.cat([vq.to(q.dtype), v_fp], 2)
        else:
            k, v = self.rows_of(slots, 0, L, q.dtype, q.device)
        pos = torch.arange(L, device=q.device)
        return exact_attention(q, k, v, pos[computed:], pos)

    def decode(self, q, pages_u8, blocks, slots, L: int, n_quant: int):
        """The low-bit attention over the quantized blocks, the residual window [n_quant, L) and the fetched rows."""
        blk = self.layout.block
        S = -(-L // blk) * blk
        store = self.layout.read(pages_u8, blocks[:n_quant // blk], S, self.meta_dtype)
        store = store._replace(n_quant=torch.tensor(n_quant, device=q.device))
        k_res, v_res = self.rows_of(slots, n_quant, L, q.dtype, q.device)
        residual = Residual(k_res, v_res, torch.tensor(L - n_quant, device=q.device))
        if self.config.kind == "kivi":
            return self.attend(q, store, residual, None)[0]
        pol = self.policy
        prev = self.selection(pages_u8, blocks[0])
        if prev is not None:  # (rows at or past n_quant are no fetch: a draft that was rejected, in speculative decoding)
            prev = (prev[0], prev[1] & (prev[0] < n_quant) & (prev[0] >= self.config.sinks))
        if pol.name == "lag":  # this step's rows were picked by the last; its first step picks for itself
            if prev is None:
                _, lse, logits = self.attend(q, store, residual, self.fetched(slots, n_quant, None, q.device), select=1)
                prev = self.pick(q, lse, logits, n_quant, slots, S)
            out, lse, logits = self.attend(q, store, residual, self.fetched(slots, n_quant, prev, q.device), select=1)
            self.set_selection(pages_u8, blocks[0], self.pick(q, lse, logits, L // self.config.residual_len *
                                                               self.config.residual_len, slots, S))
            return out
        # sequential, oracle: pick with this step's own query (the sinks, and what the ring still holds, attended),
        # fetch, attend again
        held = self.fetched(slots, n_quant, prev, q.device) if self.config.sinks else None
        _, lse, logits = self.attend(q, store, residual, held, select=1)
        sel = self.pick(q, lse, logits, n_quant, slots, S)
        self.set_selection(pages_u8, blocks[0], sel)
        return self.attend(q, store, residual, self.fetched(slots, n_quant, sel, q.device))[0]

    def attend(self, q, store, residual, fetched, select: int = 0):
        """kernels' attention: the Triton kernels behind their custom op on CUDA, the torch reference elsewhere."""
        if q.is_cuda:
            out = kernels.attention_op(q, *kernels.op_inputs(store, residual, fetched), float(self.scale),
                                       self.config.attn_path or "auto", select)
            return out if select else out[:2]
        return kernels.attention_lowbit_ref(q, store, residual, fetched, self.scale, select)

    def pick(self, q, lse, logits, n_quant: int, slots, S: int):
        """(idx, valid) [1, H, k]: the rows to fetch among positions [sinks, n_quant), by the selecting token's
        attention probability (kernels.select_ref), re-ranked by their fp keys (rrN), or the oracle's exact top-k."""
        cfg, k = self.config, self.layout.n_fetch
        n = torch.tensor(n_quant, device=q.device)
        if self.policy.exact:
            keys, _ = self.rows_of(slots, 0, min(S, slots.shape[0]), torch.float32, q.device)
            keys = torch.cat([keys, keys.new_zeros(1, keys.shape[1], S - keys.shape[2], keys.shape[3])], 2)
            score, idx = kernels.topk_exact(q[:, :, -1:], keys, n, min(k, S), self.scale, first=cfg.sinks)
            return padded(idx, score >= 0, k)
        n_cand = cfg.rerank * k if cfg.rerank > 1 else k
        idx, valid = kernels.select_ref(logits, lse[:, :, -1:], n, min(n_cand, S), cfg.sinks)
        if cfg.rerank > 1:  # re-ranking: the k of the candidates whose fp keys score best
            keys = pages.gathered(self.host_k, slots, idx.cpu(), valid.cpu()).to(q.device, torch.float32)
            score, best = rerank_exact(q[:, :, -1:], lse[:, :, -1:], keys, valid, min(k, idx.shape[-1]), self.scale)
            idx, valid = idx.gather(-1, best), score >= 0
        return padded(idx, valid, k)

    def fetched(self, slots, n_quant: int, sel, device) -> Fetched:
        """The fp rows attended in place of their quantized copies: the first `sinks` positions once quantized, then
        the selection's rows, from the host store."""
        H, sinks = self.num_kv_heads, self.config.sinks
        sink_idx = torch.arange(sinks).expand(1, H, sinks)
        idx, valid = sel if sel is not None else (torch.zeros(1, H, self.layout.n_fetch, dtype=torch.int64),
                                                  torch.zeros(1, H, self.layout.n_fetch, dtype=torch.bool))
        idx = torch.cat([sink_idx, idx.cpu()], -1)
        valid = torch.cat([sink_idx < n_quant, valid.cpu()], -1)
        k, v = (pages.gathered(host, slots, idx, valid).to(device) for host in (self.host_k, self.host_v))
        return Fetched(k, v, torch.where(valid, idx, 0).to(device), valid.to(device))

    # ---- a request's selection, in its first block's state ---------------------------------------------------------
    def selection(self, pages_u8, first_block):
        s = self.layout.state(pages_u8, first_block.reshape(1))[0]  # [H, 2 + k]
        if not bool(s[0, 1]):
            return None
        idx = s[:, 2:].long()[None]
        return idx.clamp(min=0), idx >= 0

    def set_selection(self, pages_u8, first_block, sel):
        b = first_block.reshape(1)
        s = self.layout.state(pages_u8, b)
        s[:, :, 1] = 0 if sel is None else 1
        if sel is not None:
            idx, valid = sel
            s[0, :, 2:] = torch.where(valid[0], idx[0], -1).to(torch.int32).cpu()
        self.layout.set_state(pages_u8, b, s)


def check_head_size(head_size: int):
    """ValueError for a head size vLLM's CPU attention does not take (the stock backend's and this one's)."""
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in sizes:
        raise ValueError(f"head size {head_size} is not one vLLM's CPU attention takes ({', '.join(map(str, sizes))})")


def padded(idx, valid, k: int):
    """A selection of fewer than k rows (a context shorter than k) as k, the others invalid."""
    n = k - idx.shape[-1]
    if n <= 0:
        return idx, valid
    return torch.cat([idx, idx.new_zeros(*idx.shape[:-1], n)], -1), torch.cat([valid, valid.new_zeros(*valid.shape[:-1], n)], -1)


def runs(sorted_ints: list) -> list:
    """[(first, last)] of the consecutive runs in a sorted list."""
    out = []
    for i in sorted_ints:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out
