import sys, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root
import generate
from tools import bench
emu = sys.argv[1] == "on"
def compile_step(device, fn=generate.decode_step):
    return torch.compile(fn, fullgraph=True, options={"emulate_precision_casts": emu})
generate.compile_step = compile_step
bench.main(sys.argv[2:])
