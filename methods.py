"""The caches of every configuration, in one place: cache.py builds the full, KIVI and SpeCache caches
over a quantizer's store class, which a sibling quantizer subclasses in its own file (`STORES`, by
config.scheme); the block-retrieval baselines build their own (quest.py, infllm.py). cache.py names no
sibling, and generate.py's loop runs over whichever caches a model holds."""
import torch

import cache
from baselines import infllm
from siblings import quantspec
from baselines import quest
from siblings import zipcache
from config import CacheConfig

# config.scheme -> the cache class of its quantizer: KIVI's, ZipCache's, QuantSpec's hierarchical store
STORES = {"kivi": cache.LowBitCache, "zipcache": zipcache.ZipCache, "quantspec": quantspec.HierCache}
BLOCK_RETRIEVAL = {"quest": quest.setup_caches, "infllm": infllm.setup_caches}  # config.kind -> its setup


def setup_caches(model, config: CacheConfig | str = "specache", batch: int = 1, max_seq_len=None,
                 row_start=None) -> cache.KVCaches:
    """Give every layer of `model` the cache of `config` (a CacheConfig or its name): cache.setup_caches
    with the configuration's quantizer's store, or a baseline's own caches. QuantSpec's cache is shared
    with its draft: quantspec.setup_caches builds it. row_start [B]: a left-padded batch's first real slot
    per row (prompts of different lengths): the full, KIVI and SpeCache caches over KIVI's quantizer take it;
    the siblings' quantizers and the baselines refuse a batch with padding."""
    config = CacheConfig.from_name(config) if isinstance(config, str) else config
    if config.kind == "quantspec":
        raise ValueError("the quantspec cache is shared with QuantSpec's draft: build it with quantspec.setup_caches")
    padded = row_start is not None and bool(torch.as_tensor(row_start).any())
    if padded and (config.kind in BLOCK_RETRIEVAL or config.scheme != "kivi"):
        raise ValueError(f"cache {config.name}: runs a batch of one prompt length only (prompts of different "
                         f"lengths need the full, KIVI or SpeCache cache over KIVI's quantizer)")
    if config.kind in BLOCK_RETRIEVAL:
        return BLOCK_RETRIEVAL[config.kind](model, config, batch, max_seq_len)
    return cache.setup_caches(model, config, batch, max_seq_len, store=STORES[config.scheme], row_start=row_start)
