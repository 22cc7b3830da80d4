"""The compile gate: every Triton kernel variant the launchers use compiles for sm_80 and sm_90 on
this CPU-only machine (triton_aot.py), and the gate catches what the interpreter lets through."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT


def run_python(args, interpret: bool, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gate_rows(request, tmp_path_factory):
    """The gate's rows: from the run conftest.py started in the background at collection, or a run now."""
    from pathlib import Path
    gate = getattr(request.config, "specache_gate", None)
    if gate:
        stdout, _ = gate["proc"].communicate(timeout=1800)
        r = subprocess.CompletedProcess(gate["proc"].args, gate["proc"].returncode, stdout, "")
        out = Path(gate["json"])
    else:
        out = tmp_path_factory.mktemp("gate") / "gate.json"
        r = run_python(["triton_aot.py", "--no-report", "--json", str(out)], interpret=False)
    rows = json.loads(out.read_text()) if out.exists() else []
    return r, rows


def test_every_kernel_variant_compiles_for_sm80_and_sm90(gate_rows):
    r, rows = gate_rows
    failed = [row for row in rows if not row["ok"]]
    assert r.returncode == 0 and rows and not failed, (r.stdout[-3000:] + r.stderr[-3000:])
    assert {row["arch"] for row in rows} == {80, 90}
    kernels = {row["kernel"] for row in rows}
    assert {"_attn_split_kernel", "_attn_combine_kernel", "_topk_score_kernel", "_radix_round_kernel",
            "_radix_collect_kernel", "_radix_order_kernel", "_transfer_rows_kernel", "_stage_kernel",
            "_rerank_score_kernel", "_rerank_layout_kernel", "_rerank_pick_kernel"} <= kernels, kernels


def test_fp32_variants_use_ieee_dots_and_16bit_variants_tensor_cores(gate_rows):
    """Triton's default fp32 dot is TF32 (1e-3 off the reference): fp32 inputs must ask for IEEE."""
    _, rows = gate_rows
    dots = [row for row in rows if row["ok"] and "DOT" in row["constexprs"]]
    assert dots
    for row in dots:  # the launchers pick IEEE exactly for fp32 inputs (the first pointer: the queries)
        assert (row["constexprs"]["DOT"] == "ieee") == (row["first_ptr"] == "fp32"), row
        if row["first_ptr"] == "fp32":
            assert not row["tf32"], row


BROKEN = textwrap.dedent('''
    import torch, triton, triton.language as tl

    @triton.jit
    def _pick(x_ptr, i):
        return tl.load(x_ptr + i).to(tl.float32), i
    @triton.jit
    def broken(x_ptr, out_ptr, N: tl.constexpr):
        acc = tl.zeros([], tl.float32)
        for _ in range(N):
            for j in range(2):  # `_` (an int) becomes a float carried by this loop: rejected
                _, i = _pick(x_ptr, j)
                acc += _
        tl.store(out_ptr, acc)
''')


def run_snippet(path, code, interpret):
    path.write_text(BROKEN + textwrap.dedent(code))  # @triton.jit needs its source in a file
    return run_python([str(path)], interpret=interpret, timeout=120)


def test_gate_catches_what_the_interpreter_lets_through(tmp_path):
    """The loop-carried type change that stopped every SpeCache run on an H100 (Triton 3.6): the
    interpreter runs it, triton.compile for sm_90 rejects it."""
    interp = run_snippet(tmp_path / "interp.py", '''
        out = torch.zeros(1)
        broken[(1,)](torch.ones(4), out, N=3)
        print("ran", float(out))
    ''', interpret=True)
    assert interp.returncode == 0 and "ran 6.0" in interp.stdout, interp.stderr[-2000:]
    compiled = run_snippet(tmp_path / "aot.py", '''
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        src = ASTSource(broken, {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"}, {(2,): 3})
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32))
            print("compiled")
        except Exception as e:
            print("rejected", type(e).__name__, e)
    ''', interpret=False)
    assert "rejected" in compiled.stdout and "Loop-carried variable" in compiled.stdout, compiled.stdout + compiled.stderr
