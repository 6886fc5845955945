"""The session store checks the scheduler, so it must not share its code: nothing of
`services.scheduler` may be imported by the store, directly or through another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = ("services", "shared", "custody", "kernels")


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imports_of(module: str) -> set[str]:
    """Every module of this repository `module` imports, at any level of its code."""
    path = module_file(module)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c`: c may be a module (a.b.c) or a name in a.b
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in OURS and module_file(n)}
    return found


def import_graph(roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports_of(module)
    return seen


def test_the_session_store_imports_nothing_of_the_scheduler():
    store = [
        f"services.session_store.{p.stem}"
        for p in (ROOT / "services/session_store").glob("*.py")
        if p.stem != "__init__"
    ]
    graph = import_graph(store)
    assert "services.session_store.write_checker" in graph and "shared.owners" in graph
    assert not [m for m in graph if m.startswith("services.scheduler")], sorted(graph)


def test_the_graph_sees_a_scheduler_import():
    """The walk is not vacuous: the scheduler's own modules reach the owner encoding."""
    graph = import_graph(["services.scheduler.ownership.ledger"])
    assert {"services.scheduler.ownership.owners", "shared.owners"} <= graph
