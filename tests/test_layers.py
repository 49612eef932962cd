"""The package's shape: no module imports, even lazily or for types only, one that imports it back (ARCHITECTURE.md's
layers); a package importing its own modules for re-export aside."""

from __future__ import annotations

import ast
import graphlib

from conftest import REPO

SRC = REPO / "src"


def _imports() -> dict[str, set[str]]:
    """Each phalanx module, and the phalanx modules it imports anywhere in its text."""
    modules = {
        ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p for p in SRC.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {m for m in named if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def test_no_import_cycles() -> None:
    graph = _imports()
    assert len(graph) > 100 and "phalanx.launch.lifetime" in graph["phalanx.launch.zygote"]  # it sees imports
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the modules of a cycle
