"""The package's import graph has no cycles, and importing a component package registers it.

The graph is read from the source with ``ast`` (module-level *and* function-level imports: a
cycle hidden inside a function is still a cycle). An edge ``a -> b`` means module ``a`` imports
``b``; a module outside package ``P`` that imports ``P.x`` also depends on ``P/__init__.py``
(Python runs it first). The root ``fastvision/__init__.py`` is the notebook facade: its
function-level imports (``fastvision.train`` -> api) are left out, its module-level ones are not.
"""
from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fastvision

ROOT = Path(fastvision.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module name -> fastvision modules it imports (see the module docstring for the rules); a fresh
    copy of the graph parsed once per session (the tests add edges to theirs)."""
    return {mod: set(edges) for mod, edges in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if mod == "fastvision" else list(ast.walk(tree))
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    pkg = ".".join(base + ([node.module] if node.module else []))
                else:
                    pkg = node.module or ""
                for a in node.names:
                    targets.add(f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg)
        edges = set()
        for t in targets:
            if t not in mods:
                continue
            edges.add(t)
            parts = t.split(".")
            for i in range(2, len(parts)):  # enclosing packages, below the root facade
                parent = ".".join(parts[:i])
                if not (mod == parent or mod.startswith(parent + ".")):
                    edges.add(parent)
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_graph_reader_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]


@pytest.mark.parametrize("module, old_import", [
    ("fastvision.distributed.samplers", "fastvision.distributed"),  # the sampler asked dist for the rank
    ("fastvision.metrics.coco", "fastvision.tasks.base"),  # the COCO evaluator's base class
])
def test_the_former_cycles_would_be_seen(module, old_import):
    g = import_graph()
    assert g[module] and cycles(g) == []
    parts = old_import.split(".")
    g[module] |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    assert any(module in c for c in cycles(g))


def test_no_import_cycles():
    assert cycles(import_graph()) == []


PACKAGES = {  # package -> (registry, names it must register)
    "fastvision.models": ("MODELS", {"unet2d-seed001", "ssd320"}),
    "fastvision.tasks": ("TASKS", {"segmentation", "classification", "detection"}),
    "fastvision.data.formats": ("DATASETS", {"microscopy", "coco", "decathlon", "brats", "imagefolder", "pathology"}),
    "fastvision.losses": ("LOSSES", {"dice", "dice_ce", "focal", "ce"}),
}

# One interpreter imports torch and numpy (third-party, ~3 s of CPU each time), then forks one child per
# package; each child starts with no fastvision module loaded (it checks), imports only its package and
# prints that registry's names: the same isolation as an interpreter per package at a quarter of the cost.
FORKS = """
import json, os, sys
import numpy, torch  # noqa: F401
out = {}
for package, registry in json.loads(sys.argv[1]).items():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            before = sorted(m for m in sys.modules if m.split(".")[0] == "fastvision")
            __import__(package)
            from fastvision import registry as reg
            msg = json.dumps({"before": before, "names": getattr(reg, registry).names()})
        except BaseException as e:
            msg = json.dumps({"error": repr(e)})
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out[package] = json.loads(f.read())
    os.waitpid(pid, 0)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def registered():
    arg = json.dumps({p: reg for p, (reg, _) in PACKAGES.items()})
    res = subprocess.run([sys.executable, "-c", FORKS, arg], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", list(PACKAGES))
def test_importing_a_package_registers_its_components(package, registered):
    got = registered[package]
    assert "error" not in got, got
    assert got["before"] == []  # a fresh interpreter as far as fastvision goes: nothing else imported first
    assert PACKAGES[package][1] <= set(got["names"])
