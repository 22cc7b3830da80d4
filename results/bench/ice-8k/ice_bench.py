import sys, torch
sys.path.insert(0, "/work/main")
import generate, bench
emu = sys.argv[1] == "on"
def compile_step(device, fn=generate.decode_step):
    return torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": emu})
generate.compile_step = compile_step
bench.main(sys.argv[2:])
