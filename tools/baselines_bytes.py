"""The baselines' device bytes, counted as deployed (docs/baselines.md, "Equal device bytes"): every
method's K/V bytes are those of a 16-bit deployment (2 bytes a K or V element), whatever dtype this CPU
computes in, as the project's caches count theirs (quant.deployed_nbytes). Plain arithmetic, no model:
tools/baselines.py sizes each press's budget with it, and `make test` checks it without the kvpress venv.
"""
from types import SimpleNamespace

DEPLOYED_ITEMSIZE = 2  # bytes of a K or V element in the fp16/bf16 deployment every byte figure assumes


class CellError(Exception):
    """One cell (press x budget) that cannot run: `run` ends with its error line, `cells` skips it."""


def entry_bytes(n_kv_heads: int, head_dim: int, itemsize: int = DEPLOYED_ITEMSIZE) -> int:
    """Device bytes of one position in one layer: its key and value rows over the KV heads."""
    return 2 * n_kv_heads * head_dim * itemsize


def window_entries(window: int, fed: int) -> int:
    """Entries a sliding layer holds after `fed` tokens: transformers keeps the last window - 1."""
    return min(fed, window - 1)


def appended(n_prompt: int, n_compressed: int, max_new: int) -> int:
    """Entries a pressed layer gains after the press: the uncompressed rest of the prompt and every new
    token but the last (which is sampled, never fed)."""
    return n_prompt - n_compressed + max_new - 1


def device_bytes(kept, windows, n_prompt, n_compressed, max_new, entry) -> int:
    """kv_device_bytes of a run: each pressed layer's kept entries plus what it appends, each sliding
    layer's window (windows[i] None: a pressed layer). The most the cache holds, reached when
    decoding runs to max_new tokens."""
    fed = n_prompt + max_new - 1
    add = appended(n_prompt, n_compressed, max_new)
    return entry * sum(k + add if w is None else window_entries(w, fed) for k, w in zip(kept, windows))


def kept_for_bytes(target: int, windows, n_prompt, n_compressed, max_new, entry) -> int:
    """Context entries per pressed layer whose run holds at most `target` bytes, within one entry per
    pressed layer of it. Raises CellError when the budget keeps no context entry."""
    fed = n_prompt + max_new - 1
    fixed = sum(window_entries(w, fed) for w in windows if w is not None)
    pressed = sum(w is None for w in windows)
    add = appended(n_prompt, n_compressed, max_new)
    n = (target // entry - fixed) // pressed - add
    if n < 1:
        need = entry * (fixed + pressed * (add + 1))
        raise CellError(f"--match-bytes {target} keeps no context entry: the sliding layers hold {entry * fixed} bytes and "
                        f"each of the {pressed} pressed layers {entry * add} bytes of question and new tokens; "
                        f"at least {need} bytes are needed")
    return n


def ratio_for(n: int, ctx: int) -> float:
    """The compression_ratio for which kvpress keeps int(ctx * (1 - ratio)) == n entries (0: keep all)."""
    return 0.0 if n >= ctx else 1 - (n + 0.5) / ctx


def check_ratio_keeps(ratio: float, ctx: int):
    """A ratio under which kvpress would keep no entry of the ctx compressed ones: CellError."""
    if int(ctx * (1 - ratio)) < 1:
        raise CellError(f"--ratio {ratio} keeps no entry of the {ctx} compressed tokens (kvpress keeps "
                        f"int({ctx} x (1 - ratio)) = 0); use a ratio below {1 - 1 / ctx:.6f}")


def pyramid_layer_budget(press, layer: int, pressed, q_len: int) -> int:
    """PyramidKV's budget for `layer`, its pyramid spread over the pressed layers only (kvpress spreads it
    over all of the model's layers, sliding ones included: on Gemma 3 its top would fall on layers no press
    touches). `press` is a kvpress PyramidKVPress; `layer` one of `pressed`."""
    view = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=len(pressed)), layer_idx=pressed.index(layer))
    return press.pyramid_budget(view, q_len)


def pyramid_applies(press, pressed, q_len: int) -> bool:
    """Does kvpress's PyramidKV build a pyramid at the press's ratio, or fall back to SnapKV's one budget?
    (It falls back unless the smallest layer budget, 1/beta of the mean, is at least its window.)"""
    budgets = {pyramid_layer_budget(press, i, pressed, q_len) for i in pressed}
    return not (len(budgets) == 1 and budgets == {max(1, round(q_len * (1 - press.compression_ratio)))})


def pyramid_ratio_for(press, target_total: int, pressed, ctx: int) -> float:
    """PyramidKV gives each layer its own budget: the ratio whose budgets over the pressed layers sum to
    the largest total <= target_total (bisection over the press's own budgets)."""
    def total(r):
        press.compression_ratio = r
        return sum(pyramid_layer_budget(press, i, pressed, ctx) for i in pressed)
    lo, hi = 0.0, 1 - 1e-9  # total(lo) largest
    if total(lo) <= target_total:
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if total(mid) <= target_total else (mid, hi)
    return hi


def tensor_bytes(x, deployed: bool = False) -> int:
    """Storage bytes of a tensor, a quantized tensor subclass (quanto: its inner tensors) or a
    container of them (HQQ: the codes and a dict of scales and zeros). deployed: a floating-point
    element counts DEPLOYED_ITEMSIZE bytes (codes as stored)."""
    import torch
    if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
        return sum(tensor_bytes(getattr(x, name), deployed) for name in x.__tensor_flatten__()[0])
    if isinstance(x, torch.Tensor):
        return x.numel() * DEPLOYED_ITEMSIZE if deployed and x.is_floating_point() else x.nbytes
    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(v, deployed) for v in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(v, deployed) for v in x.values())
    return 0


def layer_bytes(layer, deployed: bool = False) -> int:
    """A transformers cache layer's K/V bytes: its fp tensors and (QuantizedCache) its quantized ones."""
    return sum(tensor_bytes(getattr(layer, k, None), deployed)
               for k in ("keys", "values", "_quantized_keys", "_quantized_values"))
