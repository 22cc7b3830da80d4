"""The vLLM backend's packed page, without vLLM: what a slot costs, where a block's codes, scales and zeros lie in
its page, and the moves between the pages, the host store and the project's tuples (quant.LowBitKV, Residual,
Fetched) that kernels.py's attention and selection read.

vLLM hands a layer its KV cache as [num_blocks, H_kv, block, C] in the model's dtype, C chosen by the backend's
`customize_spec` (`slot_bytes` below). Each (block, kv head) is one run of block * slot_bytes bytes laid out as

    k codes [block, D*bits/8] | v codes [block, D*bits/8] | v scale, v zero [block, D/gv] | k scale, k zero
    [block/g, D] | state: int32 [2 + k] | the rest

as LowBitCache stores them (codes uint8, scales and zeros 16-bit). The state holds whether the block is quantized
(head 0) and, in a request's first block, the rows its last step selected (SpeCache: what the next step fetches or
attends with). A slot also carries its share of a request's fp rows on the device (the residual window, the
sinks and the fetched rows: what LowBitCache and SpeCache keep beside their codes for every request), spread over
max_model_len slots, so the engine's block count is the tokens its budget holds with every device byte counted.
The full-precision K/V of every slot is in the host store ([num_blocks * block, H, D] per layer), outside the
engine's budget: the residual window and the rows to fetch are read from there.
"""
import math
from dataclasses import dataclass
import torch

from cache import LowBitCache, SpeCache
from config import CacheConfig
from prefetch import Prefetcher
from quant import LowBitKV, value_group

POLICIES = ("sequential", "lag", "oracle")  # the fetch policies this backend runs (config.POLICIES names them all)
KINDS = ("kivi", "specache")


def check(config: CacheConfig, head_dim: int, block: int):
    """ValueError, naming what to change, for a configuration the engine cannot run or a block size that does not
    fit it: the engine runs KIVI's quantizer, SpeCache's policies in POLICIES, blocks of whole key groups that tile
    the residual window."""
    if config.kind not in KINDS:
        raise ValueError(f"cache {config.name}: the vLLM backend runs the kivi and specache caches "
                         f"(--cache kivi|specache[-...]); the full cache is vLLM's own attention")
    if config.scheme != "kivi":
        raise ValueError(f"cache {config.name}: the vLLM backend quantizes with KIVI's quantizer only, not {config.scheme}'s")
    if config.kind == "specache" and config.fetch not in POLICIES:
        raise ValueError(f"cache {config.name}: fetch policy {config.fetch!r} is not available in the vLLM backend: "
                         f"it runs {', '.join(POLICIES)} (the two-token speculative step has no place in vLLM's "
                         f"one-row decode: docs/vllm.md)")
    config.validated(head_dim)
    if block % config.group or config.residual_len % block:
        raise ValueError(f"cache {config.name}: block size {block} must be a multiple of the key group ({config.group}) "
                         f"and divide the residual window ({config.residual_len}): a block holds whole key groups and "
                         f"a flush quantizes whole blocks (--block-size)")


def fixed_bytes(config: CacheConfig, n_kv_heads: int, head_dim: int, dtype, max_model_len: int) -> tuple[int, int]:
    """(as run, in a 16-bit deployment): the device bytes one request adds per layer beyond its slots' codes and
    meta, by the project's own accounting: a LowBitCache (SpeCache with its ring) of one request at max_model_len,
    less the codes and meta of max_model_len tokens (its residual window, fetched rows and sinks, counters, the
    flush's scratch block)."""
    cfg = CacheConfig.from_name(config.name)  # (a fresh copy: attn_path etc. do not matter here)
    if config.kind == "specache":
        pf = Prefetcher(1, 1, n_kv_heads, max_model_len, head_dim, min(config.k, max_model_len), dtype, "cpu",
                        key_rows=min(config.rerank * config.k, max_model_len))
        c = SpeCache(0, pf, 1, n_kv_heads, max_model_len, head_dim, dtype, "cpu", cfg)
    else:
        c = LowBitCache(1, n_kv_heads, max_model_len, head_dim, dtype, "cpu", cfg)
    codes = c.stored().read_bytes(max_model_len)  # the codes and meta of max_model_len tokens, as stored
    return c.device_bytes() - codes, c.deployed_bytes() - codes


@dataclass(frozen=True)
class PageLayout:
    """Byte offsets within a (block, kv head) page, and what a slot costs."""
    config: CacheConfig
    n_kv_heads: int
    head_dim: int
    block: int
    dtype: torch.dtype
    max_model_len: int
    offsets: tuple  # (k_codes, v_codes, v_scale, v_zero, k_scale, k_zero, state, used): byte offsets
    slot_bytes: int  # bytes per (slot, kv head) as run: vLLM's state_content_bytes
    slot_bytes_16: float  # the same in a 16-bit deployment

    @property
    def bits(self) -> int:
        return self.config.bits

    @property
    def group(self) -> int:
        """The key group (tokens)."""
        return self.config.group

    @property
    def group_v(self) -> int:
        """The value group (channels), as LowBitCache's."""
        return value_group(self.config.group, self.head_dim)

    @property
    def n_fetch(self) -> int:
        """Rows a step fetches per kv head (SpeCache; 0 for KIVI)."""
        return n_fetched(self.config, self.max_model_len)

    @classmethod
    def build(cls, config: CacheConfig, n_kv_heads: int, head_dim: int, block: int, dtype, max_model_len: int):
        check(config, head_dim, block)
        D, bits, g = head_dim, config.bits, config.group
        gv = value_group(g, D)
        meta = 2  # scale and zero: 16-bit (bf16 under a bf16 model, else fp16), as LowBitCache stores them
        n_fetch = n_fetched(config, max_model_len)
        sizes = [block * D * bits // 8] * 2 + [block * (D // gv) * meta] * 2 + [block // g * D * meta] * 2
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + n)
        state = -(-offs[-1] // 4) * 4  # int32-aligned
        used = state + 4 * (2 + n_fetch)
        run, dep = fixed_bytes(config, n_kv_heads, D, dtype, max_model_len)
        packed = offs[-1]
        per_head_run = run / n_kv_heads * block / max_model_len  # a block's share of a request's fixed bytes
        item = torch.empty((), dtype=dtype).element_size()
        slot = math.ceil(max(used, packed + per_head_run) / block / item) * item
        slot16 = (packed + dep / n_kv_heads * block / max_model_len) / block
        return cls(config, n_kv_heads, D, block, dtype, max_model_len, tuple(offs[:6]) + (state, used), slot, slot16)

    # ---- views ------------------------------------------------------------------------------------------------
    def bytes_of(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer's cache as [num_blocks, H, block * slot_bytes] uint8."""
        assert kv_cache.is_contiguous() and kv_cache.shape[2] == self.block, kv_cache.shape
        return kv_cache.view(torch.uint8).view(kv_cache.shape[0], kv_cache.shape[1], -1)

    def region(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    # ---- the state: int32 [quantized (head 0), has a selection, n_fetch rows] per (block, head) -------------------
    def state(self, pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[n, H, 2 + n_fetch] int32: a copy."""
        s = slice(self.offsets[6], self.offsets[7])
        return pages[:, :, s][blocks].contiguous().view(torch.int32)

    def set_state(self, pages: torch.Tensor, blocks: torch.Tensor, values: torch.Tensor):
        s = slice(self.offsets[6], self.offsets[7])
        pages[blocks, :, s] = values.to(torch.int32).contiguous().view(torch.uint8).view(values.shape[0],
                                                                                          values.shape[1], -1)

    def quantized(self, pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """[n] bool: the blocks whose codes are written (head 0's flag)."""
        return self.state(pages, blocks)[:, 0, 0] != 0

    def mark(self, pages: torch.Tensor, blocks: torch.Tensor, value: int):
        """Set the blocks' quantized flag (a block written to again is not quantized: do_kv_cache_update)."""
        at = self.offsets[6]
        flag = torch.tensor([value], dtype=torch.int32).view(torch.uint8)
        pages[blocks, 0, at:at + 4] = flag

    # ---- codes ---------------------------------------------------------------------------------------------------
    def write(self, pages: torch.Tensor, blocks: torch.Tensor, per_row: dict, per_group: dict):
        """A LowBitCache.quantize result for len(blocks) whole blocks ([1, H, n * block, ...] per row, [1, H,
        n * block / g, D] per key group) into the blocks' pages."""
        n, H = blocks.shape[0], self.n_kv_heads
        parts = (per_row["k_codes"], per_row["v_codes"], per_row["v_scale"], per_row["v_zero"], per_group["k_scale"],
                 per_group["k_zero"])
        for i, x in enumerate(parts):  # [1, H, n * rows, w] -> [n, H, rows * w bytes]
            x = x[0].reshape(H, n, -1, x.shape[-1]).transpose(0, 1).contiguous()
            pages[blocks, :, self.region(i)] = x.view(torch.uint8).reshape(n, H, -1)

    def read(self, pages: torch.Tensor, blocks: torch.Tensor, n_slots: int, meta_dtype) -> LowBitKV:
        """The blocks (a request's, in order) as one request's LowBitKV over n_slots slots (>= len(blocks) * block,
        a multiple of the key group): the blocks' codes first, zeros after (never attended: n_quant masks them)."""
        n, H, D, blk = blocks.shape[0], self.n_kv_heads, self.head_dim, self.block
        raw = pages[:, :, :self.offsets[6]][blocks]  # [n, H, the codes' and meta's bytes]
        dev = pages.device

        def part(i, rows, width, dtype):
            x = raw[:, :, self.region(i)].contiguous().view(dtype).view(n, H, rows, width)
            x = x.transpose(0, 1).reshape(1, H, n * rows, width)
            pad = n_slots // (blk // rows) - n * rows
            return torch.cat([x, torch.zeros(1, H, pad, width, dtype=dtype, device=dev)], 2) if pad else x
        cb, gv = D * self.bits // 8, D // self.group_v
        return LowBitKV(part(0, blk, cb, torch.uint8), part(4, blk // self.group, D, meta_dtype),
                        part(5, blk // self.group, D, meta_dtype), part(1, blk, cb, torch.uint8),
                        part(2, blk, gv, meta_dtype), part(3, blk, gv, meta_dtype),
                        torch.zeros((), dtype=torch.int64, device=dev), self.bits, self.group, self.group_v)

    # ---- capacity ------------------------------------------------------------------------------------------------
    def stock_slot_bytes(self) -> int:
        """vLLM's own page per (slot, kv head) in this run's dtype: K and V of head_dim elements."""
        return 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


def n_fetched(config: CacheConfig, max_model_len: int) -> int:
    """Rows a step fetches per kv head: SpeCache's k (at most the context), none for KIVI."""
    return min(config.k, max_model_len) if config.kind == "specache" else 0


def quantizer(config: CacheConfig, n_kv_heads: int, head_dim: int, dtype) -> LowBitCache:
    """A one-request LowBitCache whose `quantize` is the quantizer every flush runs (quant.py through the project's
    own cache, so that the codes are LowBitCache's to the bit)."""
    cfg = CacheConfig.from_name(config.name)
    return LowBitCache(1, n_kv_heads, config.residual_len, head_dim, dtype, "cpu", cfg)


def quantize_blocks(q: LowBitCache, k: torch.Tensor, v: torch.Tensor, row0: int) -> tuple[dict, dict]:
    """k, v [1, H, n, D] of positions [row0, row0 + n) (whole key groups) -> LowBitCache.quantize's dicts, with the
    group holding position 0 marked as a request's first (the least-squares fit keeps its min/max, as the cache
    does without sinks)."""
    groups = row0 // q.group + torch.arange(k.shape[2] // q.group, device=k.device)
    return q.quantize(k, v, torch.tensor(row0, device=k.device), (groups == 0)[None])


def request_slots(block_ids: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """The cache slots of a request's positions [0, n) (its block ids in order): [n] int64."""
    pos = torch.arange(n, device=block_ids.device)
    return block_ids.long()[pos // block] * block + pos % block


def gathered(host: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Rows idx [1, H, K] (a request's positions, valid [1, H, K]; slots [n] its cache slots, on the host) of a host
    store [num_slots, H, D] -> [1, H, K, D], zero where not valid."""
    at = slots[idx.clamp(min=0, max=slots.shape[0] - 1)]  # [1, H, K] slots
    rows = host[at, torch.arange(host.shape[1])[None, :, None]]
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype))
