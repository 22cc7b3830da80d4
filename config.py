"""The one way to name a KV cache configuration, and what each fetch policy does.

`CacheConfig` is what a cache is: kind (full, kivi, specache; the sibling quantspec; the baselines quest, infllm),
bits, quantization group, fp residual window, fetched rows k, fetch policy, quantization scheme and the
SpeCache options (attention sinks, re-ranking). It is built from a name such as "specache-1bit-oracle" or
"specache-2bit-best" (a preset), or from CLI flags, and checked in one place (`validated`, by kind). Every
entry point (generate.py, tools/eval.py, tools/bench.py, integrations/hf.py) names caches this way, and result
tables print the canonical name (`CacheConfig.name`).

`FetchPolicy` is everything a fetch policy changes: how many tokens a decode step feeds, whose
attention picks the rows and when they move (cache.SpeCache.forward runs that), and what the decode
loop does around the steps (generate.generate reads `step_tokens`, `pre_decode` and `resync`).
"""
import re
from dataclasses import dataclass, fields
from typing import Optional

import quant

KINDS = ("full", "kivi", "specache", "quantspec", "quest", "infllm")
SCHEMES = ("kivi", "zipcache", "quantspec")
SCHEME_BITS = {"kivi": quant.BITS, "zipcache": quant.BITS, "quantspec": (4, 8)}  # QuantSpec: INT4 upper planes, INT8 both
FETCH_IMPLS = ("uva", "staged")
ATTN_PATHS = ("words", "planes", "gluon")  # the low-bit kernels' reads of the codes (DEFAULT_ATTN_PATH)
# Attention paths over the quantized slots: "words" (32-bit words unpacked by shifts), "planes" (bit-plane tiles),
# "gluon" (plane tiles in gpu/attn_gluon.py's kernel, compiled 16-bit launches). The default, "auto", is Gluon where
# a launch fits it (no operand through shared memory: docs/kernels.md; docs/gpu.md has its times) and words elsewhere
# (the interpreter, fp32, layouts Gluon cannot take): gpu/attention.py's launch_path decides per launch, from its
# shapes.
DEFAULT_ATTN_PATH = "auto"  # (ATTN_PATHS names the others)


def check_attn_path(attn_path: Optional[str]) -> str:
    """The attention path a cache runs (None: DEFAULT_ATTN_PATH); an unknown name is an error."""
    path = attn_path or DEFAULT_ATTN_PATH
    if path not in ATTN_PATHS + (DEFAULT_ATTN_PATH,):
        raise ValueError(f"unknown attention path {path!r} ({', '.join(ATTN_PATHS)})")
    return path


@dataclass(frozen=True)
class FetchPolicy:
    """Which fp16 rows the real token of a decode step attends to, and how they get there."""
    name: str
    step_tokens: int = 2     # 2: a step feeds [real, speculative] (Algorithm 3); 1: the real token alone
    selects: str = "last"    # whose attention picks the rows: the step's last token, or "both" (the larger probability)
    ahead: bool = True       # True: the rows are the next step's, copied while this step computes; False: this
    #                          step's own, selected, fetched and waited for before attention runs again (Table 4)
    exact: bool = False      # select by the fp16 keys in host memory (an upper bound), not the low-bit ones
    pre_decode: bool = True  # Algorithm 2 before the first step: T1's attention picks the first step's rows
    resync: bool = False     # after a wrong speculative token, pre-decode again from the real one


POLICIES = {p.name: p for p in (
    # Algorithm 3: the speculative token's attention picks the next step's rows
    FetchPolicy("speculative"),
    # the same step; a position scores the larger of the two tokens' probabilities, so a wrong
    # speculative token still leaves the real token's rows
    FetchPolicy("union", selects="both"),
    # the speculative step; whenever the speculative token was wrong, pre-decoding runs again with the
    # real token, so the chain of guesses cannot drift (one extra one-token forward per miss)
    FetchPolicy("resync", resync=True),
    # one token per step: the real token's own attention picks the next step's rows (one step late)
    FetchPolicy("lag", step_tokens=1),
    # paper Table 4: the real token's own low-bit attention picks rows, fetched now, attention recomputed
    FetchPolicy("sequential", step_tokens=1, ahead=False, pre_decode=False),
    # as sequential, with the exact top-k of the fp16 keys: an accuracy upper bound
    FetchPolicy("oracle", step_tokens=1, ahead=False, exact=True, pre_decode=False),
)}
NO_FETCH = FetchPolicy("none", step_tokens=1, pre_decode=False)  # the full, KIVI and QuantSpec caches
# Presets (--preset NAME, or NAME as a part of a cache name): defaults for a SpeCache configuration;
# the name's other parts and explicit flags win over them. "paper" is Algorithm 3 with §4.1's settings
# (the default); "best" is every choice the measurements on the default model favour (docs/policies.md:
# hit rates, perplexity, NIAH and RULER, and the GPU step times). Its k 64 rows are re-ranked from 2k
# low-bit candidates by their fp keys, which moves 1.5x the paper's bus bytes (128 keys + 64 values).
PRESETS = {
    "paper": dict(fetch="speculative", group=64, k=64, residual=None, sinks=0),
    "best": dict(fetch="resync", group=32, k=64, residual=None, sinks=4, fit="lsq", rerank=2),  # residual 64
}


@dataclass(frozen=True)
class CacheConfig:
    """One KV cache configuration. Name grammar (parts after the kind in any order):
        full | (kivi|specache)[-<N>bit][-zipcache|-quantspec][-orig][-lsq][-<policy>][-rr<N>][-k<N>][-g<N>][-r<N>][-sink<N>]
        specache-...-(paper|best): a preset (PRESETS) under the name's other parts
    e.g. "kivi-2bit", "specache-1bit-oracle", "specache-2bit-k128-r64", "specache-1bit-best". `name`
    is the canonical form (defaults left out, presets spelled out), which eval and bench use as a label."""
    kind: str = "specache"
    bits: int = 1            # bits per code (QuantSpec: 4 = upper planes, 8 = both planes)
    group: int = 64          # key group (tokens) and value group (channels, capped at head_dim)
    residual: Optional[int] = None  # fp16 residual window; None: 128 for KIVI, 64 for SpeCache (§4.1)
    k: int = 64              # SpeCache: fp16 KV pairs fetched per layer and kv head (the paper's top-k)
    fetch: str = "speculative"  # SpeCache fetch policy (which rows, when)
    scheme: str = "kivi"     # quantizer of the low-bit copy: quant.py's KIVI, ZipCache or QuantSpec
    one_bit: str = "improved"  # 1-bit zero/scale: eq. 3 ("improved") or eq. 2 ("kivi", Table 5)
    fit: str = "range"       # zero/scale from min/max (eq. 2/3), or "lsq": least-squares refit (quant.py)
    fetch_impl: str = "uva"  # CUDA transfer: Triton gather over UVA, or "staged" (eager only)
    attn_path: Optional[str] = None  # low-bit attention/top-k kernels: ATTN_PATHS (None: DEFAULT_ATTN_PATH)
    sinks: int = 0           # SpeCache: the first tokens (attention sinks) kept in fp16 on the device
    rerank: int = 1          # SpeCache: low-bit candidates per fetched row, re-ranked by their fp keys (select)
    salient: float = 0.0     # ZipCache mixed precision: share of each key group's tokens kept at bits_salient
    bits_salient: int = 0    # ... their bit-width (default bits + 2)
    page: int = 16           # quest: tokens per page of the block-retrieval baseline (baselines/quest.py); infllm: per block
    reprs: int = 4           # infllm: representative keys per block (baselines/infllm.py)
    budget: Optional[str] = None  # infllm: its sizes from a budget: a share "1/4" or a cache name (infllm.resolve)

    @property
    def n_ref(self) -> int:
        """ZipCache mixed precision: salient (refined) tokens per key group."""
        return round(self.salient * self.group)

    @property
    def residual_len(self) -> int:
        return self.residual if self.residual is not None else self.residual_len_default

    @property
    def policy(self) -> FetchPolicy:
        """What the fetch policy does (NO_FETCH for the caches that fetch nothing)."""
        return POLICIES[self.fetch] if self.kind == "specache" else NO_FETCH

    @property
    def name(self) -> str:
        if self.kind == "full":
            return "full"
        if self.kind == "quantspec":
            return "quantspec" + (f"-g{self.group}" if self.group != 64 else "")
        if self.kind == "quest":  # baselines/quest.py's block retrieval: every field spelled out
            return f"quest-p{self.page}-k{self.k}-r{self.residual_len}" + (f"-sink{self.sinks}" if self.sinks else "")
        if self.kind == "infllm":  # baselines/infllm.py: the sizes, or the budget they come from
            sizes = "" if self.budget else f"-k{self.k}-r{self.residual_len}-sink{self.sinks}"
            return f"infllm-p{self.page}{sizes}-repr{self.reprs}" + (f"@{self.budget}" if self.budget else "")
        parts = [self.kind, f"{self.bits}bit"]
        parts += [self.scheme] if self.scheme != "kivi" else []
        parts += ["orig"] if self.one_bit == "kivi" else []
        parts += [self.fit] if self.fit != "range" else []
        if self.kind == "specache":
            parts += [self.fetch] if self.fetch != "speculative" else []
            parts += [f"rr{self.rerank}"] if self.rerank != 1 else []
            parts += [f"k{self.k}"] if self.k != 64 else []
        parts += [f"g{self.group}"] if self.group != 64 else []
        parts += [f"r{self.residual}"] if self.residual is not None and self.residual != self.residual_len_default else []
        parts += [f"sink{self.sinks}"] if self.sinks else []
        parts += [f"s{round(100 * self.salient)}", f"hi{self.bits_salient}"] if self.salient else []
        return "-".join(parts)

    @property
    def residual_len_default(self) -> int:
        """128 for KIVI, 64 for SpeCache (§4.1: it trades residual for fetched rows), rounded up to
        a multiple of the group; QuantSpec: its double full-precision buffer, two groups (§4.3)."""
        if self.kind == "quantspec":
            return 2 * self.group
        base = 128 if self.kind == "kivi" else 64
        return -(-base // self.group) * self.group

    @classmethod
    def from_name(cls, name: str, preset: Optional[str] = None, **overrides) -> "CacheConfig":
        """Parse a name; a preset (PRESETS) sets defaults under the name's parts, and keyword
        overrides (e.g. CLI flags that were given) win over both. Raises ValueError."""
        name, at, budget = str(name).strip().lower().partition("@")
        parts = [p for p in name.split("-") if p]
        if not parts or parts[0] not in KINDS:
            raise ValueError(f"unknown cache {name!r}: a name starts with one of {', '.join(KINDS)} "
                             f"(e.g. kivi-2bit, specache-1bit-oracle)")
        kw = dict(kind=parts[0])
        presets = [p for p in parts[1:] if p in PRESETS] + ([preset] if preset else [])
        if len(presets) > 1:
            raise ValueError(f"cache {name!r}: one preset at a time, got {', '.join(presets)}")
        for p in presets:
            if p not in PRESETS:
                raise ValueError(f"unknown preset {p!r} ({', '.join(PRESETS)})")
            if kw["kind"] != "specache":
                raise ValueError(f"cache {name!r}: the presets ({', '.join(PRESETS)}) are SpeCache configurations")
            kw.update({k: v for k, v in PRESETS[p].items() if v is not None})
        parts = [p for p in parts if p not in PRESETS]
        patterns = [(r"(\d+)bit", "bits", int), (r"k(\d+)", "k", int), (r"g(\d+)", "group", int),
                    (r"r(\d+)", "residual", int), (r"sink(\d+)", "sinks", int), (r"rr(\d+)", "rerank", int), (r"s(\d+)", "salient", lambda p: int(p) / 100),
                    (r"hi(\d+)", "bits_salient", int), (r"p(\d+)", "page", int), (r"repr(\d+)", "reprs", int)]
        for p in parts[1:]:
            if kw["kind"] == "full":
                raise ValueError(f"cache {name!r}: the full cache takes no options")
            for pat, key, conv in patterns:
                if m := re.fullmatch(pat, p):
                    kw[key] = conv(m.group(1))
                    break
            else:
                if p in SCHEMES:
                    kw["scheme"] = p
                elif p == "orig":
                    kw["one_bit"] = "kivi"
                elif p in quant.FITS[1:]:
                    kw["fit"] = p
                elif p in POLICIES and kw["kind"] == "specache":
                    kw["fetch"] = p
                elif p in POLICIES:
                    raise ValueError(f"cache {name!r}: {p!r} is a SpeCache fetch policy; use specache-...-{p}")
                else:
                    raise ValueError(f"cache {name!r}: unknown part {p!r} (expected Nbit, {'/'.join(SCHEMES[1:])}, "
                                     f"orig, lsq, {'/'.join(POLICIES)} for specache, rrN, kN, gN, rN, sinkN, sN (salient %), hiN)")
        kw.update({k: v for k, v in overrides.items() if v is not None})
        not_quest = set(kw) - {"kind", "page", "k", "residual", "sinks"} - ({"reprs"} if kw["kind"] == "infllm" else set())
        if kw["kind"] in ("quest", "infllm") and not_quest:
            raise ValueError(f"cache {name!r}: {'an' if kw['kind'] == 'infllm' else 'a'} {kw['kind']} cache takes pN (page), kN (rows fetched), rN (residual), "
                             f"sinkN{', reprN' if kw['kind'] == 'infllm' else ''}; got {', '.join(sorted(not_quest))}")
        if at and kw["kind"] != "infllm":
            raise ValueError(f"cache {name}@{budget}: a budget after @ sizes InfLLM's cache (infllm@1/4, infllm@CACHE)")
        if kw["kind"] == "infllm":  # InfLLM's Mistral setting, where the name and budget say nothing
            kw = {"page": 128, "k": 2048, "residual": 4096, "sinks": 128, **kw, **({"budget": budget} if at else {})}
        if kw["kind"] == "quantspec":  # the hierarchical INT4/INT8 store is what QuantSpec is
            kw.setdefault("scheme", "quantspec")
            kw.setdefault("bits", 8)
        if kw.get("salient") and not kw.get("bits_salient"):
            kw["bits_salient"] = kw.get("bits", 1) + 2
        return cls(**kw).validated()

    def validated(self, head_dim: Optional[int] = None) -> "CacheConfig":
        """Raise ValueError on anything the caches or kernels cannot do; returns self. Each kind has its
        rules below; the low-bit kinds share the quantizer's (`check_quantizer`)."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown cache kind {self.kind!r} ({', '.join(KINDS)})")
        checks = {"full": lambda head_dim: None, "kivi": self.check_kivi, "specache": self.check_specache,
                  "quantspec": self.check_quantspec, "quest": self.check_quest, "infllm": self.check_infllm}
        checks[self.kind](head_dim)
        return self

    def invalid(self, msg: str):
        raise ValueError(f"cache {self.name!r}: {msg}")

    def check_compiled(self):
        """Whether a compiled step (one graph; a CUDA graph on CUDA) can hold this cache's step: the staged
        fetch cannot, as each layer syncs to gather its rows on the host."""
        if self.kind == "specache" and self.fetch_impl == "staged":
            self.invalid("--fetch-impl staged runs eager only (each layer syncs to gather its rows on the host, "
                         "which a CUDA graph cannot hold): drop --compile, or use --fetch-impl uva")

    # ---- KIVI and SpeCache ----
    def check_quantizer(self, head_dim: Optional[int]):
        """The low-bit copy: bits, groups, residual window, zero/scale, and whether head_dim packs."""
        if self.scheme not in SCHEMES:
            self.invalid(f"unknown quantization scheme {self.scheme!r} ({', '.join(SCHEMES)})")
        if self.bits not in SCHEME_BITS[self.scheme]:
            self.invalid(f"--bits {self.bits} is not available for scheme {self.scheme} "
                         f"({', '.join(map(str, SCHEME_BITS[self.scheme]))})")
        if self.group < 1 or self.group & (self.group - 1):
            self.invalid(f"--group must be a positive power of two, got {self.group}")
        if self.residual is not None and (self.residual <= 0 or self.residual % self.group):
            self.invalid(f"--residual ({self.residual}) must be a positive multiple of --group ({self.group})")
        if self.one_bit not in quant.ONE_BIT_MODES:
            self.invalid(f"--one-bit must be one of {', '.join(quant.ONE_BIT_MODES)}")
        if self.one_bit == "kivi" and self.bits != 1:
            self.invalid("'orig' (original KIVI 1-bit zero/scale, eq. 2) exists only for 1 bit")
        if self.fit not in quant.FITS:
            self.invalid(f"--fit must be one of {', '.join(quant.FITS)}")
        if head_dim is not None and head_dim % min(self.group, head_dim):
            self.invalid(f"head_dim {head_dim} is not a multiple of the value group {min(self.group, head_dim)}")
        if head_dim is not None and (head_dim * self.bits) % 8:
            self.invalid(f"head_dim {head_dim} does not pack into whole bytes at {self.bits} bits")
        if self.attn_path is not None and self.attn_path not in ATTN_PATHS:
            self.invalid(f"unknown attention path {self.attn_path!r} ({', '.join(ATTN_PATHS)})")
        self.check_sibling_scheme(head_dim)

    def check_kivi(self, head_dim: Optional[int]):
        self.check_quantizer(head_dim)
        self.check_fetches_nothing()

    def check_fetches_nothing(self):
        if self.sinks or self.rerank != 1:
            self.invalid("attention sinks (sinkN) and re-ranking (rrN) are SpeCache options")

    def check_specache(self, head_dim: Optional[int]):
        """The quantizer's rules, then the fetch: rows, policy, transfer, sinks, re-ranking."""
        self.check_quantizer(head_dim)
        if self.k < 1:
            self.invalid(f"--k must be >= 1, got {self.k}")
        if self.fetch not in POLICIES:
            self.invalid(f"unknown fetch policy {self.fetch!r} ({', '.join(POLICIES)})")
        if self.fetch_impl not in FETCH_IMPLS:
            self.invalid(f"unknown fetch implementation {self.fetch_impl!r} ({', '.join(FETCH_IMPLS)})")
        if self.sinks < 0:
            self.invalid(f"--sinks must be >= 0, got {self.sinks}")
        if self.sinks > self.group:
            self.invalid(f"--sinks ({self.sinks}) must fit in the first quantized group ({self.group} tokens)")
        if self.rerank < 1:
            self.invalid(f"rrN (re-ranking candidates per fetched row) must be >= 1, got {self.rerank}")
        if self.rerank > 1 and self.fetch == "oracle":
            self.invalid("re-ranking (rrN) refines a low-bit selection; the oracle already selects with fp keys")

    # ---- the siblings: ZipCache's and QuantSpec's quantizers, the block-retrieval baselines ----
    def check_sibling_scheme(self, head_dim: Optional[int]):
        """What ZipCache's mixed precision and QuantSpec's planes add to the quantizer, or rule out."""
        if self.fit != "range" and (self.scheme == "quantspec" or self.salient):
            self.invalid("the least-squares fit (lsq) is for the single-width KIVI/ZipCache quantizer, not for "
                         "QuantSpec's planes or ZipCache mixed precision (their codes split one min/max grid)")
        if not (self.salient or self.bits_salient):
            return
        if self.scheme != "zipcache":
            self.invalid("salient tokens at more bits (--salient-ratio, sN) are ZipCache's mixed precision: --quant zipcache")
        if not 0 < self.salient <= 1 or abs(100 * self.salient - round(100 * self.salient)) > 1e-9:
            self.invalid(f"--salient-ratio must be in (0, 1] in whole percent, got {self.salient}")
        r = self.bits_salient - self.bits
        if r not in quant.BITS or self.bits_salient > 6:
            self.invalid(f"--bits-salient ({self.bits_salient}) must exceed --bits ({self.bits}) by 1, 2 or 4 and be "
                         f"at most 6 (the kernels' 16-bit dots hold the mixed codes exactly)")
        if not 1 <= self.n_ref <= 254:
            self.invalid(f"--salient-ratio {self.salient} keeps {self.n_ref} tokens of a key group of {self.group}: "
                         f"needs 1 to 254")
        if head_dim is not None and (head_dim * r) % 8:
            self.invalid(f"head_dim {head_dim} does not pack into whole bytes at {r} refinement bits")

    def check_quantspec(self, head_dim: Optional[int]):
        """QuantSpec's cache: the hierarchical INT4/INT8 store with a double full-precision buffer (§4.3)."""
        self.check_quantizer(head_dim)
        if self.scheme != "quantspec" or self.bits != 8:
            self.invalid("the quantspec cache is the hierarchical INT4/INT8 store (scheme quantspec, 8 bits)")
        if self.residual_len != 2 * self.group:
            self.invalid(f"the quantspec cache's full-precision buffer is two groups ({2 * self.group}), not {self.residual_len}")
        self.check_fetches_nothing()

    def check_quest(self, head_dim: Optional[int]):
        """baselines/quest.py's block retrieval: pages of fp16 rows, none quantized."""
        if self.page < 1:
            self.invalid(f"the page size (pN) must be >= 1, got {self.page}")
        if self.k < self.page or self.k % self.page:
            self.invalid(f"the rows fetched (kN, {self.k}) must be a positive multiple of the page size (pN, {self.page})")
        if self.residual is not None and self.residual < 1:
            self.invalid(f"the residual window (rN) must be >= 1, got {self.residual}")
        if self.sinks < 0:
            self.invalid(f"--sinks must be >= 0, got {self.sinks}")

    def check_infllm(self, head_dim: Optional[int]):
        """baselines/infllm.py: blocks of fp16 rows, none quantized, sized by their fields or by a budget."""
        if self.page < 1 or self.reprs < 1 or self.reprs > self.page:
            self.invalid(f"a block (pN, {self.page}) and its representative keys (reprN, {self.reprs}) must be 1 <= reprN <= pN")
        if self.budget is not None:
            self.check_budget()
        elif self.k < self.page or self.k % self.page or self.residual_len < 1 or self.sinks < 0:
            self.invalid(f"the rows fetched (kN, {self.k}) must be a positive multiple of the block (pN, {self.page}), the "
                         f"window (rN) >= 1 and the initial tokens (sinkN) >= 0")

    def check_budget(self):
        """An InfLLM budget: a share a/b in (0, 1], or the name of a cache that is not itself budgeted."""
        if "/" in self.budget:
            num, _, den = self.budget.partition("/")
            if not (num.isdigit() and den.isdigit() and 0 < int(num) <= int(den)):
                self.invalid(f"the budget {self.budget!r} is a share a/b in (0, 1] (@1/4) or a cache name (@specache-1bit-best)")
            return
        try:
            other = CacheConfig.from_name(self.budget)
        except ValueError as e:
            self.invalid(f"the budget {self.budget!r} names no cache ({e})")
        if other.kind in ("infllm", "quest", "quantspec") or other.scheme != "kivi":
            self.invalid(f"the budget's cache {other.name} must be full, kivi or specache with KIVI's quantizer")

    def bits_per_value(self, head_dim: int, q_per_kv: int = 1) -> float:
        """Device bits per stored key or value element of a quantized token: codes, scales and zeros
        (meta), ZipCache's refinement rows and slot map. The fp residual, SpeCache's fetched rows and
        per-head constants (ZipCache's channel scale) are left out: they do not grow with the context."""
        if self.kind == "full":
            return 16.0
        if self.kind == "quest":  # a page's 16-bit key min and max per channel, over its P tokens' K and V
            return 16 / self.page
        if self.kind == "infllm":  # a block's 16-bit vector per query head (q_per_kv of them), over its tokens' K and V
            return 8 * q_per_kv / self.page
        per_token = sum(quant.quantized_bytes(kind, self.bits, self.group, head_dim) for kind in ("key", "value"))
        if self.salient:
            per_token += 2 * head_dim * (self.bits_salient - self.bits) / 8 * self.n_ref / self.group + 1
        return 8 * per_token / (2 * head_dim)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---- the same fields as command-line flags (generate.py; a name's parts can also be given alone) --------
def add_cache_flags(p):
    """The cache options of a command line: a name (CacheConfig.from_name) and field overrides."""
    p.add_argument("--cache", default="specache",
                   help="full | kivi | specache, or a full name such as specache-2bit-oracle (see config.CacheConfig)")
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="SpeCache settings: paper (Algorithm 3, §4.1; the default) or best (what docs/policies.md's "
                        "measurements favour: resync fetch, 4 sinks, group 32, least-squares zero/scale, "
                        "64 fetched rows re-ranked from 128 low-bit candidates by their fp keys); the name's "
                        "parts and flags win")
    p.add_argument("--bits", type=int, default=None, help="bits per code (default: the name's, else 1)")
    p.add_argument("--group", type=int, default=None, help="quantization group (default 64)")
    p.add_argument("--residual", type=int, default=None, help="fp residual window (default 128 kivi, 64 specache)")
    p.add_argument("--k", type=int, default=None, help="SpeCache: fp16 KV pairs fetched per layer and kv head (64)")
    p.add_argument("--fetch", default=None, help="SpeCache fetch policy: speculative (Algorithm 3, the default), union, "
                   "resync, lag, sequential, oracle (see config.POLICIES)")
    p.add_argument("--sinks", type=int, default=None, help="SpeCache: first tokens kept in fp16 on the device (0)")
    p.add_argument("--rerank", type=int, default=None,
                   help="SpeCache: low-bit candidates per fetched row, re-ranked by their fp keys read from the host "
                        "(1: off; N: N*k keys + k values cross the bus per layer instead of k + k)")
    p.add_argument("--one-bit", default=None, choices=list(quant.ONE_BIT_MODES), help="1-bit zero/scale: eq. 3 or eq. 2")
    p.add_argument("--fit", default=None, choices=list(quant.FITS),
                   help="low-bit zero/scale: from min/max (eq. 2/3), or their least-squares refit (same bytes)")
    p.add_argument("--quant", default=None, choices=list(SCHEMES),
                   help="low-bit scheme: KIVI, ZipCache channel-separable values, QuantSpec INT4/INT8 planes (--bits 4|8)")
    p.add_argument("--fetch-impl", default=None, choices=list(FETCH_IMPLS), help="CUDA host-to-device transfer")
    p.add_argument("--attn-path", default=None, choices=list(ATTN_PATHS),
                   help="low-bit attention kernel on a GPU: words, bit planes, or planes in the Gluon kernel "
                        "(default: Gluon where a launch fits it, else words; config.DEFAULT_ATTN_PATH)")
    p.add_argument("--salient-ratio", type=float, default=None,
                   help="ZipCache mixed precision (--quant zipcache): share of tokens kept at --bits-salient (e.g. 0.4)")
    p.add_argument("--bits-salient", type=int, default=None, help="ZipCache: bits of the salient tokens (default --bits + 2)")


def from_flags(a) -> CacheConfig:
    """The CacheConfig of add_cache_flags' options. Raises ValueError."""
    return CacheConfig.from_name(a.cache, preset=a.preset, bits=a.bits, group=a.group, residual=a.residual, k=a.k,
                                 fetch=a.fetch, one_bit=a.one_bit, fit=a.fit, scheme=a.quant, fetch_impl=a.fetch_impl,
                                 attn_path=a.attn_path,
                                 sinks=a.sinks, rerank=a.rerank, salient=a.salient_ratio, bits_salient=a.bits_salient)
