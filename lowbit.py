"""What the low-bit cache and its kernels share (kernels.py's attention, topk.py's selection,
cache.py's caches): the tuples a kernel reads, the torch references of the stored codes, and the
rules that pick a tile layout.

  LowBitKV   the quantized tokens of a KIVI cache (LowBitCache.stored()): codes, scales, zeros;
             its methods are the torch references of reading them
  Residual   the fp window (the newest tokens), Fetched: fp rows fetched from the host store and the
             quantized positions they replace (eq. 1)

The references dequantize or score every slot with static shapes (garbage past n_quant is masked
by the callers); the Triton kernels fold the same scales and zeros into the query and the
probabilities (docs/design.md). Layout rules: 32-bit words or bytes (`code_layout`), and the
bit-plane tiles (`planes_fit`, `plane_codes_mode`); the attention paths (`check_attn_path`).
"""
import os
from typing import NamedTuple, Optional

import torch
import triton

import quant
from config import ATTN_PATHS

Tensor = torch.Tensor


class LowBitKV(NamedTuple):
    """The quantized tokens of a KIVI cache (cache.LowBitCache.stored()). Slots [0, n_quant) hold
    tokens; the rest is garbage the kernels never read into a result. The torch references are its
    methods, so any tuple with the same methods runs the same reference attention
    (kernels.attention_lowbit_ref)."""
    k_codes: Tensor  # [B,Hkv,S,D*bits/8] uint8; keys quantized per channel in groups of group_k tokens
    k_scale: Tensor  # [B,Hkv,S/group_k,D] (16-bit)
    k_zero: Tensor
    v_codes: Tensor  # [B,Hkv,S,D*bits/8] uint8; values quantized per token in groups of group_v channels
    v_scale: Tensor  # [B,Hkv,S,D/group_v]
    v_zero: Tensor
    n_quant: Tensor  # 0-d int64
    bits: int
    group_k: int
    group_v: int
    # [B] int64: each row's first real slot (a left-padded batch); slots before it are padding, never attended
    row_start: Optional[Tensor] = None

    def starts(self) -> Tensor:
        """row_start, or zeros (a batch without padding)."""
        return self.row_start if self.row_start is not None else \
            torch.zeros(self.k_codes.shape[0], dtype=torch.int64, device=self.k_codes.device)

    def real_slots(self) -> Tensor:
        """[B,1,S] bool: the slots at or after each row's start (what a row may attend)."""
        S = self.k_codes.shape[2]
        return torch.arange(S, device=self.k_codes.device) >= self.starts()[:, None, None]

    def codes(self, kv: str) -> Tensor:
        """Integer codes of the keys (kv="k") or values as fp32 [B,Hkv,S,D]."""
        return quant.unpack_bits(self.k_codes if kv == "k" else self.v_codes, self.bits, torch.int32).float()

    def key_logits(self, qg) -> Tensor:
        """qg [B,Hkv,M,D] (fp32, pre-scaled) -> q.k' [B,Hkv,M,S] over every slot (garbage past n_quant)."""
        return code_logits(qg, self.codes("k"), self.k_scale.float(), self.k_zero, self.group_k)

    def value_sum(self, p, keep) -> Tensor:
        """sum_n p[.., n] v'_n for p [B,Hkv,M,S] (zero where not keep [B,Hkv,S]) -> [B,Hkv,M,D]."""
        return code_value_sum(p, self.codes("v"), self.v_scale.float(), self.v_zero, self.group_v, keep)

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """Keys and values in fp32 [B,Hkv,S,D]."""
        return (quant.dequantize_keys(self.k_codes, self.k_scale, self.k_zero, self.bits, self.group_k),
                quant.dequantize_values(self.v_codes, self.v_scale, self.v_zero, self.bits, self.group_v))

    def first_tokens(self, n: int) -> "LowBitKV":
        """The tuple cut to quantized tokens [0, n) (n a multiple of the key group)."""
        g = n // self.group_k
        return self._replace(k_codes=self.k_codes[:, :, :n], k_scale=self.k_scale[:, :, :g], k_zero=self.k_zero[:, :, :g],
                             v_codes=self.v_codes[:, :, :n], v_scale=self.v_scale[:, :, :n], v_zero=self.v_zero[:, :, :n])

    def read_bytes(self, n_quant: int) -> int:
        """Bytes of the codes and scales of tokens [0, n_quant) (what the attention reads of them)."""
        per_row = sum(t[:, :, :n_quant].nbytes for t in (self.k_codes, self.v_codes, self.v_scale, self.v_zero))
        return per_row + sum(t[:, :, :n_quant // self.group_k].nbytes for t in (self.k_scale, self.k_zero))


class Residual(NamedTuple):
    """The fp window: rows [0, length) hold the newest tokens in order; a step's T query tokens are
    its last T rows (causal among them)."""
    k: Tensor  # [B,Hkv,R,D]
    v: Tensor
    length: Tensor  # 0-d


class Fetched(NamedTuple):
    """fp rows fetched from the host store; they replace quantized positions idx where valid."""
    k: Tensor  # [B,Hkv,K,D]
    v: Tensor
    idx: Tensor  # [B,Hkv,K] int64
    valid: Tensor  # [B,Hkv,K] bool


# =============================================================================================
# torch references
# =============================================================================================
def replaced_mask(fetched: Fetched, S: int) -> Tensor:
    """[B,Hkv,S] bool: quantized slots whose fp row was fetched. Unused fetch slots point at S-1,
    a scratch slot that is never attended."""
    safe = torch.where(fetched.valid, fetched.idx, S - 1)
    return torch.zeros(*fetched.idx.shape[:2], S, dtype=torch.bool, device=fetched.idx.device).scatter(2, safe, fetched.valid)


def row_scores(logits, lse_rows, G, R):
    """logits [B,Hkv,G*R,N] of query rows m = g*R + r -> score [B,Hkv,N]: the attention probability
    summed over the kv head's G query heads, the best of the R query tokens."""
    B, Hkv, _, N = logits.shape
    p = torch.exp(logits - lse_rows.float().reshape(B, Hkv, G * R, 1))
    return p.view(B, Hkv, G, R, N).sum(2).amax(2)


def as_rows(q_row, lse_row):
    """[B,H,D] / [B,H] (one query token) or [B,H,R,D] / [B,H,R] (R tokens) -> the 4-d / 3-d form."""
    return (q_row[:, :, None], lse_row[:, :, None]) if q_row.dim() == 3 else (q_row, lse_row)


def fp_row_scores(q_rows, lse_rows, keys, sm_scale):
    """row_scores of fp keys [B,Hkv,N,D] for query rows [B,H,R,D] -> [B,Hkv,N]."""
    B, H, R, D = q_rows.shape
    Hkv = keys.shape[1]
    qg = q_rows.float().reshape(B, Hkv, (H // Hkv) * R, D) * sm_scale
    return row_scores(qg @ keys.float().transpose(-1, -2), lse_rows, H // Hkv, R)


def code_logits(qg, c, k_scale, k_zero, g: int) -> Tensor:
    """qg [B,Hkv,M,D] . keys whose integer codes c [B,Hkv,S,D] (fp32) dequantize as c * scale + zero per
    channel and group of g tokens (scale [B,Hkv,S/g,D] fp32, in the codes' units) -> [B,Hkv,M,S]. The
    scale and zero fold into the query, as in the Triton kernel: q.k' = (q*s_g).c + q.z_g, so only the
    integer codes are expanded to [S, D]."""
    B, Hkv, M, D = qg.shape
    S = c.shape[2]
    qs = qg[:, :, None] * k_scale[:, :, :, None, :]  # [B,Hkv,S/g,M,D]
    logits = qs @ c.view(B, Hkv, S // g, g, D).transpose(-1, -2) + \
        (qg @ k_zero.float().transpose(-1, -2)).transpose(-1, -2)[..., None]
    return logits.permute(0, 1, 3, 2, 4).reshape(B, Hkv, M, S)


def code_value_sum(p, c, v_scale, v_zero, group_v: int, keep) -> Tensor:
    """sum_n p[.., n] v'_n for p [B,Hkv,M,S] over values whose integer codes c [B,Hkv,S,D] dequantize as
    c * scale + zero per token and group of channels (v_scale [B,Hkv,S,D/group_v] fp32, in the codes'
    units); rows where not keep [B,Hkv,S] count zero. The scale and zero fold into the probabilities, as
    in the Triton kernel: sum_n p_n (c_n s_n + z_n) = (p*s).c + sum_n p_n z_n."""
    D = c.shape[-1]
    gv = min(group_v, D)
    zero = torch.zeros((), device=p.device)
    scale = torch.where(keep[..., None], v_scale, zero)  # garbage rows (NaN/inf) -> 0
    zeros = torch.where(keep[..., None], v_zero.float(), zero)
    return torch.cat([(p * scale[:, :, None, :, j]) @ c[..., j * gv:(j + 1) * gv] + p @ zeros[..., j:j + 1]
                      for j in range(D // gv)], -1)


# =============================================================================================
# layout rules: words or bytes, bit planes, dot precision
# =============================================================================================
def dot_precision(dtype):
    """fp32 is the reference precision: IEEE dots (Triton's default for fp32 is TF32, ~1e-3 off).
    16-bit models keep tensor-core dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_upcast(dtype) -> bool:
    """The interpreter computes bf16 dots wrongly (silently): there, bf16 operands go up to fp32.
    Compiled kernels always take the model's dtype (the compile gate and the GPU checks cover them)."""
    return dtype == torch.bfloat16 and interpreted()


def code_layout(store: LowBitKV, D: int):
    """(WORDS, block_d, k_codes, v_codes): 32-bit words of the codes when each row is whole words
    and D a power of two (the fast path), else the bytes."""
    if store.group_k & (store.group_k - 1) or store.group_k < 16:
        raise ValueError(f"Triton kernels need a power-of-two key group >= 16, got {store.group_k}")
    words = D & (D - 1) == 0 and (D * store.bits) % 32 == 0
    view = (lambda t: t.contiguous().view(torch.int32)) if words else (lambda t: t.contiguous())
    return words, triton.next_power_of_2(D), view(store.k_codes), view(store.v_codes)


# Attention paths over the quantized slots: "words" (32-bit words unpacked by shifts), "planes" (bit-plane tiles),
# "gluon" (plane tiles in attn_gluon's kernel, compiled 16-bit launches). The default, "auto", is Gluon where a
# launch fits it (on a GPU: the fastest path in every row of the H200 run, docs/gpu.md) and words elsewhere (the
# interpreter, fp32, layouts Gluon cannot take): kernels.launch_path decides per launch, from its shapes.
DEFAULT_ATTN_PATH = "auto"  # (config.ATTN_PATHS names the others)


def interpreted() -> bool:
    """Triton kernels run in the interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def planes_fit(store: LowBitKV, D: int, M: int) -> bool:
    """Whether the bit-plane path takes this layout (M query rows of head_dim D per KV head): whole
    32-bit words per row, D and the value groups powers of two, at most 32 tile rows."""
    NGV = D // min(store.group_v, D)
    return D & (D - 1) == 0 and (D * store.bits) % 32 == 0 and NGV & (NGV - 1) == 0 and \
        triton.next_power_of_2(M) * NGV <= 32


def check_attn_path(attn_path: Optional[str]) -> str:
    """The attention path a cache runs (None: DEFAULT_ATTN_PATH); an unknown name is an error."""
    path = attn_path or DEFAULT_ATTN_PATH
    if path not in ATTN_PATHS + (DEFAULT_ATTN_PATH,):
        raise ValueError(f"unknown attention path {path!r} ({', '.join(ATTN_PATHS)})")
    return path


def plane_codes_mode(store: LowBitKV, D: int, dtype) -> tuple[int, float]:
    """(CODES, CODE_OFF) of tiles.plane_codes for the model's dtype."""
    dot16 = dtype != torch.float32 and not interpreter_upcast(dtype)
    # 16-bit dots read codes as MAGIC + c (exact: c < 128 in bf16, < 1024 in fp16); fp32 converts
    # (the PTX unpacks four elements with one shift: they must share a bit plane, which holds wherever a
    # plane's W bytes are a multiple of the 16 columns a dot-operand layout groups; else Triton's ops)
    codes = 0 if not dot16 or (dtype == torch.bfloat16 and store.bits == 8) else \
        1 if interpreted() or (D * store.bits // 8) % 16 else 2
    return codes, (128.0 if dtype == torch.bfloat16 else 1024.0) if codes else 0.0


# =============================================================================================
# custom ops' inputs
# =============================================================================================
# The ops take the tuples' tensors flat (custom ops take tensors, not tuples): `op_inputs` / `from_op_inputs`.
def op_inputs(store: LowBitKV, residual: Residual, fetched: Optional[Fetched]):
    f = fetched or Fetched(None, None, None, None)
    tensors = (store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero, store.n_quant,
               residual.k, residual.v, residual.length)
    return tensors, (store.bits, store.group_k, store.group_v), (f.k, f.v, f.idx, f.valid, store.row_start)


def from_op_inputs(tensors, ints, optional):
    store = LowBitKV(*tensors[:7], *ints[:3], row_start=optional[4])
    return store, Residual(*tensors[7:10]), (Fetched(*optional[:4]) if optional[0] is not None else None)
