"""The package's shape: no module imports, even lazily or for types only, one that imports it back (ARCHITECTURE.md's
layers); a package importing its own modules for re-export aside."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys

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


# ARCHITECTURE.md's layers, top to bottom: each imports only those below it.
LAYERS = ("cli", "control", "launch", "resilience", "train", "checkpoint", "data", "obs", "spec")


def test_no_layer_imports_one_above_it() -> None:
    def layer(module: str) -> int | None:
        top = module.split(".")[1] if "." in module else None
        return LAYERS.index(top) if top in LAYERS else None

    graph = _imports()
    upward = [
        f"{module} -> {imported}"
        for module, imports in sorted(graph.items())
        for imported in sorted(imports)
        if layer(module) is not None and layer(imported) is not None and layer(imported) < layer(module)
    ]
    assert "phalanx.obs.protocol" in graph["phalanx.launch.supervisor"]  # it sees the layers' imports
    assert upward == []


def test_the_cli_and_the_server_import_no_torch() -> None:
    """Every client command starts at once, and the server runs without torch: importing the CLI (all its
    command groups), the server, and checking a spec before it is queued (what the server does on submit)
    leave torch unimported; a worker's SDK still brings it."""
    check = (
        "import sys\n"
        "import phalanx.cli.main, phalanx.control.server.main\n"
        "from phalanx.launch.preflight import preflight\n"
        "from phalanx.spec import load_spec\n"
        "for job in ('examples/demo.yaml', 'examples/own_script.yaml'):\n"
        "    preflight(load_spec(job))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
        "import phalanx\n"
        "phalanx.init\n"
        "print('torch' in sys.modules)\n"
    )
    ran = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:2] == ["[]", "True"], ran.stdout
