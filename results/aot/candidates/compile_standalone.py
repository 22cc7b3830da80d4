import sys, importlib.util
sys.path.insert(0, '.'); sys.path.insert(0, 'results/aot/candidates')
from tools import triton_aot as A
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import standalone_kernel as E
sig = dict(q="*bf16", k_codes="*u8", k_scale="*bf16", k_zero="*bf16", v_codes="*u8", v_scale="*bf16", v_zero="*bf16",
           out="*fp32", qk_scale="fp32", S="i32", hi="i32", D="i32", M="i32", BITS="constexpr", GROUP_K="constexpr",
           NGV="constexpr", BLOCK_M="constexpr", BLOCK_D="constexpr", MAGIC="constexpr", ASM="constexpr")
names = list(sig)
for spec in sys.argv[1:]:
    bits, warps, stages, magic, arch, asm = (int(x) for x in spec.split(","))
    cx = dict(BITS=bits, GROUP_K=64, NGV=2, BLOCK_M=16, BLOCK_D=128, MAGIC=bool(magic), ASM=bool(asm))
    consts = {(names.index(k),): v for k, v in cx.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("q","k_codes","k_scale","k_zero","v_codes","v_scale","v_zero","out","S","D")}
    k = triton.compile(ASTSource(E._exp, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    text = A.sass(k.asm["cubin"])
    # (the SASS: A.sass(k.asm["cubin"]), not kept)
    h = A.hot_loop(text)
    ru = A.resource_usage(k.asm["cubin"])
    print(spec, "regs", ru["registers"], "stack", ru["stack"], "smem", k.metadata.shared, h,
          "per token", h.get("loop_instr", 0) * warps / 64)
