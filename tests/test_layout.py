"""The repository's shape: the method's modules at the root, the measuring tools in tools/, imports
that run one way, no module reaching into another's private names, and every `python X.py` command
of the README and docs naming a script that exists and answers --help."""
import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

METHOD = {"attn_gluon", "attn_views", "cache", "cli", "config", "convert_hf", "decoding", "generate", "hf", "infllm",
          "kernels", "kvmemory", "lowbit", "methods", "model", "prefetch", "quant", "quantspec", "quest", "tiles", "tokenizer", "topk",
          "tp", "transfer", "zipcache"}


def project_modules() -> dict:
    """module name -> path: the root's modules by their names, the tools' as tools.NAME."""
    mods = {p.stem: p for p in ROOT.glob("*.py")}
    mods.update({f"tools.{p.stem}": p for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"})
    return mods


def imports(path, mods) -> list:
    """(imported project module, the imported name or None, line) for every import in the file,
    those inside functions included (a lazy import is a dependency too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name in mods or a.name == "tools"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:  # from tools import eval
                    out.append((f"{node.module}.{a.name}", None, node.lineno))
                elif node.module in mods:
                    out.append((node.module, a.name, node.lineno))
    return out


def test_the_root_holds_the_method_and_the_tools_live_in_tools():
    assert {p.stem for p in ROOT.glob("*.py")} == METHOD
    assert (ROOT / "tools" / "bench.py").exists() and (ROOT / "tools" / "eval.py").exists()


def test_imports_run_one_way():
    """No module at the root imports a tool, and the import graph has no cycle."""
    mods = project_modules()
    graph = {name: {m for m, _, _ in imports(path, mods) if m != name} for name, path in mods.items()}
    upward = [(name, m) for name, deps in graph.items() if name in METHOD for m in deps if m.startswith("tools")]
    assert not upward, f"the method imports the tools: {upward}"
    state = {}

    def visit(name, stack):
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(dep):] + [dep])}")
            if dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"
    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_no_module_uses_another_modules_private_names():
    """Neither `from m import _x` nor `m._x` across project modules (dunders aside); tests may."""
    mods = project_modules()
    bad = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                aliases |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in mods}
        for mod, imported, line in imports(path, mods):
            if imported and imported.startswith("_") and not imported.startswith("__") and mod != name:
                bad.append(f"{path.name}:{line}: from {mod} import {imported}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


# ---- the commands the README and the docs give ------------------------------------------------------------
COMMAND = re.compile(r"(?:\bpython3?|\.venv/bin/python|\btorchrun(?:\s+--[\w-]+(?:[ =]\S+)?)*)\s+((?:[\w.-]+/)*[\w-]+\.py)\b")


def documented_scripts() -> dict:
    found = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in COMMAND.finditer(doc.read_text()):
            found.setdefault(m.group(1), []).append(doc.name)
    return found


def test_every_documented_command_names_a_script_that_exists():
    found = documented_scripts()
    assert {"generate.py", "tools/bench.py", "tools/eval.py", "tools/triton_aot.py"} <= set(found)
    missing = {script: docs for script, docs in found.items() if not (ROOT / script).is_file()}
    assert not missing, missing


@pytest.mark.parametrize("script", sorted(documented_scripts()))
def test_every_documented_script_answers_help(script):
    env = dict(os.environ, TRITON_INTERPRET="0")  # (triton_aot.py compiles: it refuses the interpreter)
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, (r.stdout[-500:], r.stderr[-1500:])


CORE = ("lowbit.py", "kernels.py", "topk.py", "cache.py", "quant.py", "prefetch.py", "transfer.py")
SIBLING_NAMES = re.compile(r"quantspec|zipcache|hier|views|viewkv|v_chan|k_ref|v_ref|ref_map|ref_bits|n_ref|codes_lo|"
                           r"salien|mixed", re.I)


def test_the_core_names_no_sibling():
    """KIVI and SpeCache's modules carry none of QuantSpec's or ZipCache's names, in code or comments:
    the siblings extend the core from their own modules (zipcache.py, quantspec.py, attn_views.py)."""
    found = [f"{name}:{i}: {m.group(0)}" for name in CORE
             for i, line in enumerate((ROOT / name).read_text().splitlines(), 1) for m in SIBLING_NAMES.finditer(line)]
    assert not found, "\n".join(found)
