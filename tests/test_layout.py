"""The repository's shape: the method's modules at the root, the Triton programs, the siblings, the baselines,
the integrations and the measuring tools each in a folder, imports that run one way between them, no import
cycle (lazy imports included), no module reaching into another's private names, and every `python X.py`
command of the README and docs naming a script that exists and answers --help."""
import ast
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# The design card's files, and the helpers a reader needs to run them.
CARD = {"generate", "model", "cache", "quant", "prefetch", "kernels", "convert_hf"}
HELPERS = {"tokenizer", "config", "decoding"}
METHOD = CARD | HELPERS
# Each folder's place: a module imports, at load time, only the root and folders of a lower rank or its own
# folder; the root may import a folder's module lazily (inside a function), for an optional part.
FOLDERS = {"gpu": 1, "siblings": 2, "baselines": 2, "integrations": 3, "tools": 4}



def project_modules() -> dict:
    """module name -> path: the root's modules by their names, a folder's (and its packages') as FOLDER.NAME, a
    package's __init__ by the package's name."""
    mods = {p.stem: p for p in ROOT.glob("*.py")}
    for folder in FOLDERS:
        for p in (ROOT / folder).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name != folder:
                mods[name] = p
    return mods


def place(module: str) -> str:
    """The folder a module lives in ("" for the root)."""
    return module.split(".")[0] if "." in module else ""


def rank(module: str) -> int:
    return FOLDERS.get(place(module), 0)


def imports(path, mods) -> list:
    """(imported project module, the imported name or None, line, lazy) for every import in the file,
    those inside functions included (lazy: a dependency too, for the cycle check)."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        lazy = id(node) not in top
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno, lazy) for a in node.names if a.name in mods]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:  # from gpu import tiles
                    out.append((f"{node.module}.{a.name}", None, node.lineno, lazy))
                elif node.module in mods:
                    out.append((node.module, a.name, node.lineno, lazy))
    return out


def test_the_root_holds_the_method_and_each_folder_its_part():
    assert {p.stem for p in ROOT.glob("*.py")} == METHOD
    for folder in FOLDERS:
        assert (ROOT / folder / "__init__.py").is_file(), folder
    code_dirs = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")}
    assert code_dirs - {"tests", "results"} - set(FOLDERS) <= {d for d in code_dirs if d.startswith(".")}, code_dirs


def test_every_module_is_a_few_hundred_lines():
    long = {str(p.relative_to(ROOT)): n for p in project_modules().values()
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_imports_run_one_way():
    """At load time a module imports only the root, folders of a lower rank and its own folder; the root
    imports a folder only inside a function; nothing outside tools/ imports a tool; no import cycle, lazy
    imports included (a folder the test did not scan would make this pass vacuously: every folder is scanned)."""
    mods = project_modules()
    assert any(m.startswith("siblings.") for m in mods) and any(m.startswith("gpu.") for m in mods)
    edges = {name: [(m, line, lazy) for m, _, line, lazy in imports(path, mods) if m != name] for name, path in mods.items()}
    wrong = []
    for name, deps in edges.items():
        for m, line, lazy in deps:
            if place(m) == "tools" and place(name) != "tools":
                wrong.append(f"{name}:{line} imports the tool {m}")
            elif lazy and place(name) == "":
                continue  # the root's optional parts
            elif rank(m) > rank(name) or (rank(m) == rank(name) and place(m) not in ("", place(name))):
                wrong.append(f"{name}:{line} imports {m}{' (lazily)' if lazy else ''}")
    assert not wrong, "\n".join(wrong)
    graph = {name: {m for m, _, _ in deps} for name, deps in edges.items()}
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


def test_importing_the_method_loads_no_optional_part():
    """`import generate` (and the model, caches and kernels' torch references) loads no sibling, baseline,
    integration or GPU program until a configuration or flag asks for one, and not Triton either."""
    code = ("import sys, generate, model, cache, kernels, prefetch, quant, convert_hf; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in %r or m == 'triton'))" % (set(FOLDERS),))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


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
        for mod, imported, line, _ in imports(path, mods):
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


CORE = ("kernels.py", "cache.py", "quant.py", "prefetch.py", "gpu/attention.py", "gpu/attn_gluon.py", "gpu/tiles.py",
        "gpu/topk.py", "gpu/transfer.py")
SIBLING_NAMES = re.compile(r"quantspec|zipcache|hier|views|viewkv|v_chan|k_ref|v_ref|ref_map|ref_bits|n_ref|codes_lo|"
                           r"salien|mixed", re.I)


def test_the_core_names_no_sibling():
    """KIVI and SpeCache's modules carry none of QuantSpec's or ZipCache's names, in code or comments:
    the siblings extend the core from their own folder (siblings/)."""
    found = [f"{name}:{i}: {m.group(0)}" for name in CORE
             for i, line in enumerate((ROOT / name).read_text().splitlines(), 1) for m in SIBLING_NAMES.finditer(line)]
    assert not found, "\n".join(found)
