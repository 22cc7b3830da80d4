"""One SpeCache layer's reference attention and selection at SmolLM2's shapes (3 kv heads of 3 query heads, d 64),
8k, fetched rows, compiled and eager, 1 thread: the tree before the fused selection (topk_lowbit_ref over the codes
again) or after it (select_ref over the attention's logits). Usage: python layer_cpu.py TREE (2026-11-27:
1e9767c compiled 2.30 ms, eager 10.95; after 1.64 ms, eager 4.48; see layer_cpu.txt)."""
import time, torch, sys
sys.path.insert(0, sys.argv[1])
import kernels, topk, lowbit, quant
from lowbit import LowBitKV, Residual, Fetched
torch.manual_seed(0)
B,Hkv,G,T,D,S,R = 1,3,3,2,64,8192+128,66
k = torch.randn(B,Hkv,S,D); v = torch.randn(B,Hkv,S,D)
kc,ks,kz = quant.quantize_keys(k,1,64); vc,vs,vz = quant.quantize_values(v,1,64)
store = LowBitKV(kc,ks,kz,vc,vs,vz,torch.tensor(8128),1,64,64)
res = Residual(torch.randn(B,Hkv,R,D), torch.randn(B,Hkv,R,D), torch.tensor(40))
f = Fetched(torch.randn(B,Hkv,64,D), torch.randn(B,Hkv,64,D), torch.randint(0,8000,(B,Hkv,64)), torch.ones(B,Hkv,64,dtype=torch.bool))
q = torch.randn(B,Hkv*G,T,D)
new = hasattr(topk, "select_ref")
def step():
    if new:
        out, lse, lg = kernels.attention_lowbit_ref(q, store, res, f, 0.125, select=1)
        return topk.select_ref(lg, lse[:, :, -1:], store.n_quant, 64)
    out, lse = kernels.attention_lowbit_ref(q, store, res, f, 0.125)
    return topk.topk_lowbit_ref(q[:, :, -1], lse[:, :, -1], store, 64, 0.125, f)
for fn, name in ((step, "eager"), (torch.compile(step, fullgraph=True), "compiled")):
    for _ in range(3): fn()
    ts=[]
    for _ in range(20):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    ts.sort(); print(sys.argv[1], name, "median ms", round(1e3*ts[10],2), "min", round(1e3*ts[0],2))
