"""The compile gate: every Triton kernel variant the launchers use compiles for sm_80 and sm_90 on
this CPU-only machine (tools/triton_aot.py), and the gate catches what the interpreter lets through."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.gate


def run_python(args, interpret: bool, timeout=900):
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gate_rows(request, tmp_path_factory):
    """(result, rows, archs): from the run conftest.py started in the background at collection, or
    the whole matrix now."""
    from pathlib import Path
    gate = getattr(request.config, "specache_gate", None)
    if gate:
        stdout, _ = gate["proc"].communicate(timeout=1800)
        r = subprocess.CompletedProcess(gate["proc"].args, gate["proc"].returncode, stdout, "")
        out, archs = Path(gate["json"]), gate["archs"]
    else:
        archs = {80, 90}
        out = tmp_path_factory.mktemp("gate") / "gate.json"
        r = run_python(["tools/triton_aot.py", "--no-report", "--json", str(out)], interpret=False)
    rows = json.loads(out.read_text()) if out.exists() else []
    return r, rows, archs


def test_every_kernel_variant_compiles_for_sm80_and_sm90(gate_rows):
    r, rows, archs = gate_rows
    failed = [row for row in rows if not row["ok"]]
    assert r.returncode == 0 and rows and not failed, (r.stdout[-3000:] + r.stderr[-3000:])
    assert {row["arch"] for row in rows} == archs
    kernels = {row["kernel"] for row in rows}
    assert {"_attn_words_kernel", "_attn_combine_kernel", "_select_kernel", "_transfer_rows_kernel",
            "_rerank_score_kernel", "_rerank_layout_kernel", "_rerank_pick_kernel"} <= kernels, kernels
    # a kernel ptxas takes minutes on is a hang on the GPU (a k 512 x 512 tile on one warp: over 6 min)
    slow = [(row["kernel"], row["variant"], row["compile_s"]) for row in rows if row["compile_s"] > 60]
    assert not slow, slow


def test_fp32_variants_use_ieee_dots_and_16bit_variants_tensor_cores(gate_rows):
    """Triton's default fp32 dot is TF32 (1e-3 off the reference): fp32 inputs must ask for IEEE."""
    _, rows, _ = gate_rows
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


def sass_text(body: list[str]) -> str:
    """`cuobjdump -sass` text of instructions at 0x00, 0x10, ... (each with its encoding line)."""
    lines = ["\tcode for sm_90a", "\t\tFunction : k"]
    for i, ins in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;                /* 0x000000000000000{i % 10} */")
        lines.append("                                                                 /* 0x000fe20000000800 */")
    return "\n".join(lines)


@pytest.fixture()
def aot(monkeypatch):
    """triton_aot without compiling anything (it refuses to import under the interpreter)."""
    import importlib
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return importlib.import_module("tools.triton_aot")


def test_hot_loop_cost_of_a_synthetic_sass(aot):
    """An outer loop (0x20-0x90) around loop A (0x30-0x80: STS + LDS = a shared-memory round trip, a
    spill reload, a barrier), then loop B (0xb0-0x100: LDSM only, fed by LDGSTS), a forward branch
    and the trailing self-branch; B takes a second, earlier backward branch to its label."""
    body = ["LDC R1, c[0x0][0x28]", "S2R R0, SR_TID.X",
            "IMAD R2, R0, 0x4, RZ",                                            # 0x20 outer
            "LDG.E.128 R4, desc[UR4][R2.64]",                                  # 0x30 A
            "STS.128 [R3], R4", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDS.64 R8, [R3+0x10]",
            "LDL R12, [R1+0x8]", "@P0 BRA 0x30",                               # 0x80
            "@P1 BRA 0x20",                                                     # 0x90 outer
            "@!P3 BRA 0x200",                                                   # 0xa0 forward
            "LDGSTS.E.BYPASS.LTC128B.128 [R5], desc[UR4][R6.64]",                      # 0xb0 B
            "LDSM.16.M88.4 R16, [R5]", "@P2 BRA 0xb0", "NOP", "HMMA.16816.F32.BF16 R20, R16, R18, R20",
            "@!P2 BRA 0xb0",                                                    # 0x100
            "EXIT", "BRA 0x120"]
    text = sass_text(body)
    assert aot.loops(text) == [(0x20, 0x90), (0x30, 0x80), (0xb0, 0x100)]
    assert aot.innermost(aot.loops(text)) == [(0x30, 0x80), (0xb0, 0x100)]
    hot = aot.hot_loop(text)  # A: 6 instructions, B: 5 (the NOP does not count)
    assert hot == dict(loop_instr=6, inner_loop_instr=[6, 5], sts=1, lds=1, local=1, bar=1, smem_roundtrip=True), hot
    assert aot.loop_loads(text) == {"128": 1, "cp128": 1}
    row = dict(kernel="_attn_words_kernel", constexprs={"GROUP_K": "64"}, num_warps=4, **hot)
    assert aot.per_token(row) == 6 * 4 / 64
    assert aot.per_token(dict(row, kernel="_attn_combine_kernel")) is None

    body[14:14] = ["IADD3 R1, R2, R3, RZ", "FFMA R1, R2, R3, R4"]  # B grows to 7: now the hot loop, no STS
    body[-1] = "BRA 0x140"  # (the trailing self-branch moved)
    text = sass_text(body)
    assert aot.innermost(aot.loops(text)) == [(0x30, 0x80), (0xb0, 0x120)]
    hot = aot.hot_loop(text)
    assert hot == dict(loop_instr=7, inner_loop_instr=[6, 7], sts=0, lds=1, local=0, bar=0, smem_roundtrip=False), hot
    assert aot.hot_loop(text, "first")["loop_instr"] == 6  # (the attention kernel's pick: its first loop)
    assert aot.hot_loop(sass_text(["S2R R0, SR_TID.X", "EXIT", "BRA 0x20"])) == {}


def test_every_loop_named_and_counted_per_step(aot):
    """Each innermost loop takes its source loop's name and items per iteration; a step's count is the
    loop bodies x their iterations plus the straight-line code once per program (tools/kernel_cost.py)."""
    from tools import kernel_cost as kc
    body = ["LDC R1, c[0x0][0x28]", "IMAD R2, R0, 0x4, RZ",                   # 0x00, 0x10
            "LDG.E.128 R4, desc[UR4][R2.64]", "STS.128 [R3], R4", "@P0 BRA 0x20",  # 0x20-0x40: loop 1
            "LDS.64 R8, [R3+0x10]", "@P1 BRA 0x50",                              # 0x50-0x60: loop 2
            "FADD R1, R2, R3", "LDL R12, [R1+0x8]", "@P2 BRA 0x70",              # 0x70-0x90: loop 3
            "EXIT", "BRA 0xb0"]
    text = sass_text(body)
    every = aot.inner_loops(text)
    assert every == [dict(instr=3, sts=1, lds=0, local=0), dict(instr=2, sts=0, lds=1, local=0),
                     dict(instr=3, sts=0, lds=0, local=1)]
    row = dict(kernel="_attn_words_kernel", num_warps=2,
               constexprs={"GROUP_K": "64", "BLOCK_F": "32", "HAS_FETCH": "True"})
    loops = kc.loops_of(row, [x["instr"] for x in every])
    assert [(lp["name"], lp["per_item"]) for lp in loops] == [("quantized", 3 * 2 / 64), ("fetched", 2 * 2 / 32),
                                                             ("residual", 3 * 2 / 32)]
    step = kc.per_step(row, 12, loops)  # 12 instructions in all: 4 outside the loops
    s = kc.STEP
    programs = s["Hkv"] * (min(s["n_quant"] // 64, 4 * s["sms"] // s["Hkv"]) + 1)
    want = 4 * 2 * programs + (3 * s["n_quant"] // 64 + 2 * s["k"] // 32 + 3 * s["res_len"] // 32) * 2 * s["Hkv"]
    assert step["step_instr"] == want and step["programs"] == programs
    assert step["step_items"] == (s["n_quant"] + s["k"] + s["res_len"]) * s["Hkv"]
    row["loops"], row["step"] = loops, step
    assert kc.budget_check(row) == dict(budget=24.0, item="KV token", worst=3 * 2 / 32, met=True)
    # without fetched rows the second loop is the residual one; a loop too many leaves them unnamed
    row["constexprs"]["HAS_FETCH"] = "False"
    assert [lp["name"] for lp in kc.loops_of(row, [3, 2])] == ["quantized", "residual"]
    assert [lp["per_item"] for lp in kc.loops_of(row, [3, 2, 3])] == [None, None, None]


def test_the_cost_tools_name_kernels_and_constexprs_that_exist(aot):
    """tools/kernel_cost.py (and triton_aot.py's per-token rule) name kernels and their constexprs by
    strings: each named kernel is a Triton or Gluon kernel of the method, and each constexpr one of its
    parameters, so a rename fails here instead of leaving a report without its loops or budgets."""
    import ast
    import inspect

    from gpu import attention, attn_gluon, topk, transfer
    from siblings import attn_views
    from tools import kernel_cost

    def constexprs(name):
        found = [getattr(m, name) for m in (attention, attn_views, topk, transfer, attn_gluon) if hasattr(m, name)]
        assert len(found) == 1, f"kernel {name} is defined {len(found)} times"
        fn = getattr(found[0], "fn", found[0])
        return {p for p, v in inspect.signature(fn).parameters.items() if "constexpr" in str(v.annotation)}

    def names(x):  # a constexpr name, "!name", a number, or a tuple of those
        if isinstance(x, tuple):
            return {n for y in x for n in names(y)}
        return {x.lstrip("!")} if isinstance(x, str) else set()

    used = {k: set() for k in {**kernel_cost.LOOPS, **kernel_cost.BUDGETS}}
    for kern, loops in kernel_cost.LOOPS.items():
        for _, per, _, cond in loops:
            used[kern] |= names(per) | names(cond)
    # step_shape: `if kern == "K"` / `kern in (...)` branches read constexprs with _cx(row, "NAME")
    tree = ast.parse(inspect.getsource(kernel_cost.step_shape))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            kerns = {c.value for c in ast.walk(node.test) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            cx = {c.args[1].value for b in node.body for c in ast.walk(b)
                  if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "_cx"}
            for kern in kerns:
                used.setdefault(kern, set()).update(cx)
    for kern, per in aot.TOKENS_PER_ITERATION.items():
        used.setdefault(kern, set()).update(names(per))
    for kern, cx in used.items():
        missing = cx - constexprs(kern)
        assert not missing, f"{kern}: no constexpr {sorted(missing)}"
