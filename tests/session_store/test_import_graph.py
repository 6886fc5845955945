"""The session store checks the scheduler, so it must not share its code: nothing of
`services.scheduler` may be imported by the store, directly or through another module."""

from __future__ import annotations

import ast

from tests.test_structure import ROOT, imported_modules, module_file


def imports_of(module: str) -> set[str]:
    """Every module of this repository `module` imports, at any level of its code."""
    source = module_file(module).read_text()
    return {name for _, name in imported_modules(ast.parse(source))}


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
