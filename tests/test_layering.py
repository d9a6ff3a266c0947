"""House rule: imports point one way down the layers, and no module imports itself back through
another. Every import counts, at the top of a file, inside a function or under TYPE_CHECKING: a lazy
import that hides a circle is still a circle. Read from the source with `ast` (nothing is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tailserve"
# Top to bottom: a package may import its own modules and those of the packages below it.
LAYERS = [
    ("cli", "integrations"),  # integrations: scale-out engines' glue (Ray Serve), above the server
    ("server",),
    ("router", "bench", "plan"),  # clients and arithmetic: HTTP only (tests/test_import_isolation.py)
    ("http",),  # the HTTP plumbing the server and the router share
    ("engine",),
    ("quality",),  # the weight-format gate: runs runners, before the engine builds its own
    ("executor",),
    ("model",),
    ("weights",),
    ("kernels",),
    ("config", "errors", "user_cache"),
]
ALLOWED = {("plan", "tailserve.model.tp_split")}  # the runtime owns the rule, the planner reads it


def _package(module: str) -> str:
    return module.split(".")[1]


def _rank(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each tailserve module -> the tailserve modules it imports anywhere in its source."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("tailserve."))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tailserve"):
                for alias in node.names:  # `from tailserve.kernels import cpu` imports a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[name] = {m for m in found if m in modules and m not in (name, "tailserve")}
    return graph


def test_every_import_points_down_the_layers() -> None:
    wrong = []
    for module, targets in imports().items():
        if module == "tailserve":
            continue
        here = _package(module)
        for target in targets:
            there = _package(target)
            if there != here and _rank(there) < _rank(here) and (here, target) not in ALLOWED:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
