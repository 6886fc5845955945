"""The shape of the code, checked so it cannot drift back: packages (folders) import one
another in one direction only, so do all modules (type-only imports included), no
service imports another, every module says why it exists, files and functions stay under
generous ceilings, and the
`custody` command parses its arguments and spawns services without loading torch.

Each check comes with a self-check on a known case, so a walker that silently sees
nothing cannot pass for clean code."""

from __future__ import annotations

import ast
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("services", "shared", "protocol", "fronts", "custody", "kernels")
MAX_FILE_LINES = 600  # a ceiling, not a target: files split by collaborator (issue 27)
MAX_FUNCTION_LINES = 100
DRIVERS = ("custody/bench/", "custody/soak/")  # benchmark and soak drivers: long by nature

Edges = dict[tuple[str, str], list[str]]  # (from package, to package) -> "file:line"


def product_files() -> Iterator[Path]:
    for top in OURS:
        yield from sorted((ROOT / top).rglob("*.py"))


def module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def package_of(path: Path) -> str:
    """A module's package is its folder; an `__init__.py` belongs to its own folder."""
    return ".".join(path.parent.relative_to(ROOT).parts)


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import of ours, at any level of the code:
    `import a.b` imports a.b; `from a.b import c` imports a.b.c when that is a module,
    else a.b (c is a name in it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {
                f"{node.module}.{alias.name}"
                if module_file(f"{node.module}.{alias.name}")
                else node.module
                for alias in node.names
            }
        else:
            continue
        for name in sorted(names):
            if name.split(".")[0] in OURS and module_file(name):
                yield node.lineno, name


def package_edges(files: Iterator[Path]) -> Edges:
    edges: Edges = {}
    for path in files:
        source = package_of(path)
        for line, module in imported_modules(ast.parse(path.read_text())):
            target = package_of(module_file(module))
            if target != source:
                where = f"{path.relative_to(ROOT)}:{line} imports {module}"
                edges.setdefault((source, target), []).append(where)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """One cycle per set of packages found on a cycle (depth-first back edges)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    found: dict[frozenset[str], list[str]] = {}
    state: dict[str, str] = {}  # "open" while on the path, then "done"
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt) :]
                found.setdefault(frozenset(cycle), [*cycle, nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return list(found.values())


def describe(cycle: list[str], edges: Edges) -> str:
    steps = [f"  {a} -> {b}: {'; '.join(edges[a, b])}" for a, b in itertools.pairwise(cycle)]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_packages_import_each_other_in_one_direction_only():
    """A package that imports one importing it back cannot be read, tested or moved alone."""
    edges = package_edges(product_files())
    found = cycles(edges)
    assert not found, "package import cycles:\n" + "\n".join(describe(c, edges) for c in found)


def test_the_graph_sees_known_edges_and_the_finder_finds_a_cycle():
    """The walk is not vacuous: it resolves `from a import module` and `from a.b import
    name`, and a planted cycle is reported with its imports."""
    edges = package_edges(product_files())
    assert ("services.executor", "services.executor.model") in edges  # runner -> nemotron_h
    assert ("custody.cli", "custody.soak") in edges  # `from custody import soak`
    assert ("custody.cli", "custody") in edges  # `from custody import up`
    assert ("custody.bench", "custody") in edges  # `from custody.up import Stack`
    planted = {("a", "b"): ["x.py:1"], ("b", "c"): ["y.py:2"], ("c", "a"): ["z.py:3"]}
    planted[("c", "d")] = ["w.py:4"]
    assert cycles(planted) == [["a", "b", "c", "a"]]
    assert "c -> a: z.py:3" in describe(cycles(planted)[0], planted)
    del planted[("c", "a")]
    assert cycles(planted) == []


def module_of(path: Path) -> str:
    return ".".join(path.with_suffix("").relative_to(ROOT).parts)


def module_edges(sources: dict[str, str]) -> Edges:
    """(module, module) -> "module:line", for every import between two of `sources`
    (module -> its text), those under `if TYPE_CHECKING:` and inside functions included:
    a cycle closed only for the type checker still ties two modules together."""
    edges: Edges = {}
    for source, text in sources.items():
        for line, module in imported_modules(ast.parse(text)):
            if module in sources and module != source:
                edges.setdefault((source, module), []).append(f"{source}:{line}")
    return edges


def product_sources() -> dict[str, str]:
    return {module_of(p): p.read_text() for p in product_files() if p.stem != "__init__"}


def test_modules_import_each_other_in_one_direction_only():
    """A collaborator that calls back into the object that built it (or two records that
    name each other) forms a cycle; a type both sides share moves below both, or becomes
    a `typing.Protocol` on the side that uses it. Every product module, not only the
    scheduler's."""
    edges = module_edges(product_sources())
    found = cycles(edges)
    assert not found, "module import cycles:\n" + "\n".join(describe(c, edges) for c in found)


def test_the_module_graph_sees_known_edges_and_type_only_cycles():
    """The module walk is not vacuous: it sees a known edge, and a cycle closed only
    under `TYPE_CHECKING` in a tiny synthetic graph is found."""
    assert ("services.scheduler.engine.core", "services.scheduler.engine.faults") in module_edges(
        product_sources()
    )
    core, faults = "services.scheduler.engine.core", "services.scheduler.engine.faults"
    planted = {
        core: "from services.scheduler.engine.faults import Faults\n",
        faults: "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from services.scheduler.engine.core import EngineCore\n",
    }
    edges = module_edges(planted)
    assert cycles(edges) == [[core, faults, core]]
    assert f"{faults} -> {core}: {faults}:4" in describe(cycles(edges)[0], edges)


SERVICES = (
    "services.scheduler",
    "services.executor",
    "services.session_store",
    "services.router",
    "services.epp",
)


def service_of(module: str) -> str | None:
    return next((s for s in SERVICES if module == s or module.startswith(s + ".")), None)


def cross_service_imports(edges: Edges) -> list[str]:
    """Imports from one service into another: services share only `shared/`, the wire
    contract, so each can be deployed, scaled and read alone."""
    return [
        f"{a} imports {b} ({'; '.join(where)})"
        for (a, b), where in sorted(edges.items())
        if service_of(a) and service_of(b) and service_of(a) != service_of(b)
    ]


def test_no_service_imports_another():
    found = cross_service_imports(module_edges(product_sources()))
    assert not found, "services importing each other:\n" + "\n".join(found)


def test_the_service_rule_flags_a_planted_import():
    planted = {
        "services.router.app": "from services.scheduler.http import tenancy\n",
        "services.scheduler.http.tenancy": "from shared import tenancy\n",
        "shared.tenancy": "",
    }
    found = cross_service_imports(module_edges(planted))
    assert len(found) == 1 and found[0].startswith("services.router.app imports")


# The fronts' own layer (fronts/): above the wire contract, below the two fronts. Only
# they (and the command line's drivers, custody/) may import it; it imports no service.
FRONTS = "fronts"
MAY_IMPORT_FRONTS = ("services.router", "services.epp", "custody")


def layer_violations(edges: Edges) -> list[str]:
    """Imports across the fronts' layer in the wrong direction."""
    found = []
    for (a, b), where in sorted(edges.items()):
        into_fronts = b.split(".")[0] == FRONTS and a.split(".")[0] != FRONTS
        if into_fronts and not a.startswith(MAY_IMPORT_FRONTS):
            found.append(f"{a} imports {b} ({'; '.join(where)})")
        if a.split(".")[0] == FRONTS and b.startswith("services"):
            found.append(f"{a} imports a service: {b} ({'; '.join(where)})")
    return found


def test_only_the_fronts_import_the_fronts_layer_and_it_imports_no_service():
    edges = module_edges(product_sources())
    assert ("services.router.main", "fronts.decision") in edges
    assert not layer_violations(edges)
    planted = {
        "shared.config": "from fronts.front import Routing\n",
        "fronts.front": "from services.router.proxy import Proxy\n",
        "services.router.proxy": "",
    }
    assert len(layer_violations(module_edges(planted))) == 2


# What the fronts may not touch outside the decision (fronts/decision.py): the router is
# that decision plus an HTTP proxy, the endpoint picker that decision plus ext_proc.
DECIDING = {"Directory", "Chooser", "Mover", "SessionLimits"}  # the classes
DECIDING_ATTRIBUTES = {"directory", "chooser", "mover", "limits"}  # Routing's fields


def decisions_outside(source: str, where: str) -> list[str]:
    """`where:line uses X` for each name of a deciding class, import of one, or access
    to one of Routing's deciding fields."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in DECIDING:
            found.append(f"{where}:{node.lineno} uses {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in DECIDING_ATTRIBUTES:
            found.append(f"{where}:{node.lineno} uses .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            found += [
                f"{where}:{node.lineno} imports {alias.name}"
                for alias in node.names
                if alias.name in DECIDING
            ]
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def test_the_fronts_decide_only_through_the_decision():
    files = sorted((ROOT / "services/router").glob("*.py")) + sorted(
        (ROOT / "services/epp").glob("*.py")
    )
    assert len(files) > 8
    found = [f for p in files for f in decisions_outside(p.read_text(), p.name)]
    assert not found, "routing decided outside fronts/decision.py:\n" + "\n".join(found)
    planted = (
        "from fronts.directory import Directory\n"
        "async def route(routing):\n"
        "    await routing.directory.place('s', 'a')\n"
        "    return routing.limits.refuse_open(None)\n"
    )
    assert decisions_outside(planted, "app.py") == [
        "app.py:1 imports Directory",
        "app.py:3 uses .directory",
        "app.py:4 uses .limits",
    ]


# The protocol's core (protocol/) is sans I/O: its transitions are run by production and
# by the model checker alike, so they may import nothing that waits, reads a clock or
# talks to anything, and of ours only the wire contract.
PURE_STDLIB = {"__future__", "collections", "dataclasses", "enum", "functools", "itertools"}
PURE_STDLIB |= {"typing"}


def impure_imports(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            allowed = top in PURE_STDLIB or top == "protocol" or name == "shared.placement"
            if not allowed:
                found.append(f"{where}:{node.lineno} imports {name}")
    return found


def test_the_protocol_core_imports_nothing_that_does_io():
    files = sorted((ROOT / "protocol").glob("*.py"))
    assert len(files) >= 3
    found = [f for p in files for f in impure_imports(p.read_text(), p.name)]
    assert not found, "the protocol's core must stay sans I/O:\n" + "\n".join(found)
    planted = "import asyncio\nfrom shared.streams import Keys\nfrom dataclasses import field\n"
    assert impure_imports(planted, "m.py") == [
        "m.py:1 imports asyncio",
        "m.py:2 imports shared.streams",
    ]


def undocumented_modules(sources: dict[str, str]) -> list[str]:
    """Modules with code but no docstring: a newcomer opens a file to learn why it exists."""
    return [
        m
        for m, text in sorted(sources.items())
        if text.strip() and not ast.get_docstring(ast.parse(text))
    ]


def test_every_product_module_says_why_it_exists():
    found = undocumented_modules(product_sources())
    assert not found, f"modules without a docstring: {found}"


def test_the_docstring_rule_flags_a_bare_module():
    planted = {"a": '"""Why a exists."""\nx = 1\n', "b": "x = 1\n", "c": ""}
    assert undocumented_modules(planted) == ["b"]


def line_counts() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in product_files()}


def test_every_product_file_is_short_enough_to_read():
    counts = line_counts()
    assert len(counts) > 100 and counts["services/executor/model/pools.py"] > 0
    long = {path: n for path, n in counts.items() if n > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def long_functions(source: str, where: str) -> list[str]:
    """`where:line name (n lines)` for each function, nested ones included, longer than
    MAX_FUNCTION_LINES from its `def` to its last line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_longer_than_a_hundred_lines_outside_the_drivers():
    found = []
    for path in product_files():
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(DRIVERS):
            found += long_functions(path.read_text(), rel)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_function_measure_flags_a_long_one():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    source = f"def fits():\n{body}\n\nasync def too_long():\n{body}    return 0\n"
    too_long = f"m.py:{MAX_FUNCTION_LINES + 3} too_long ({MAX_FUNCTION_LINES + 1} lines)"
    assert long_functions(source, "m.py") == [too_long]


PROBE = """
import json, sys
import custody.cli, custody.up
from shared.config import Settings
args = custody.cli.build_parser().parse_args(["up", "--port", "8321"])
assert Settings.resolve(args, environ={}).port == 8321
heavy = [m for m in sys.modules if m == "torch" or m.startswith(("torch.", "custody.bench."))]
print(json.dumps(sorted(heavy)))
"""


def heavy_modules(extra_import: str = "") -> list[str]:
    """What a fresh interpreter has loaded after parsing `custody up`'s arguments."""
    code = f"import {extra_import}\n{PROBE}" if extra_import else PROBE
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_cli_and_the_supervisor_load_neither_torch_nor_a_benchmark():
    assert heavy_modules() == []


def test_the_probe_sees_torch_when_it_is_loaded():
    assert "torch" in heavy_modules("services.executor.model.batch")


# What the HTTP edge may import of the scheduler: its own package, the front door, the
# records it reads, and the pure input and text rules. Never the engine core, sessions, cache,
# allocators or ownership: handlers go through the front door.
EDGE_MAY_IMPORT = (
    "services.scheduler.http.",
    "services.scheduler.runtime.front_door",
    "services.scheduler.records.",
    "services.scheduler.engine.validation",
    "services.scheduler.text.",  # pure text rules: chat templates, detokenizing
)


def edge_imports_past_the_front_door(files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(ast.parse(path.read_text()))
        if module.startswith("services.scheduler.") and not module.startswith(EDGE_MAY_IMPORT)
    ]


def test_http_handlers_reach_the_scheduler_only_through_its_front_door():
    edge = sorted((ROOT / "services/scheduler/http").glob("*.py"))
    assert len(edge) > 5
    assert not edge_imports_past_the_front_door(edge)
    # the check sees an import past the front door where there is one
    assert edge_imports_past_the_front_door([ROOT / "services/scheduler/main.py"])


# The README is the front page: the two commands, what custody is, a first try, the layout,
# the headline figures, an index of docs/ and what is not built. The manual is in docs/.
README_MAX_LINES = 200
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def too_long(text: str, limit: int = README_MAX_LINES) -> int | None:
    """The line count of `text` when it passes `limit`, else None."""
    n = len(text.splitlines())
    return n if n > limit else None


def test_the_readme_has_at_most_two_hundred_lines():
    assert too_long((ROOT / "README.md").read_text()) is None


def test_the_line_limit_flags_a_long_text():
    assert too_long("x\n" * README_MAX_LINES) is None
    assert too_long("x\n" * (README_MAX_LINES + 1)) == README_MAX_LINES + 1


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation
    but `-` and `_` dropped, spaces as `-` (a repeated heading gets `-1`, `-2`, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(text):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number, line) for the lines of a Markdown text outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield number, line


def broken_links(path: Path, text: str) -> list[str]:
    """`file:line target` for each relative link of `text` (a Markdown file at `path`)
    whose file does not exist, or whose `#anchor` names no heading of that file. Links
    with a scheme (http, https, mailto) are not checked."""
    broken = []
    for number, line in prose_lines(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            problem = link_problem(path, text, target)
            if problem is not None:
                broken.append(f"{path.name}:{number} {target}{problem}")
    return broken


def link_problem(path: Path, text: str, target: str) -> str | None:
    """None for a good link (or one with a scheme), else what is wrong with it."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None
    name, _, anchor = target.partition("#")
    where = (path.parent / name).resolve()
    if name and not where.exists():
        return ""
    if not anchor or (name and where.suffix != ".md"):
        return None
    return None if anchor in anchors(where.read_text() if name else text) else " (no heading)"


def test_every_relative_link_of_the_readme_and_docs_resolves():
    files = markdown_files()
    assert len(files) > 10
    found = [b for path in files for b in broken_links(path, path.read_text())]
    assert not found, f"broken links: {found}"


def test_the_link_check_flags_a_missing_file_and_a_missing_heading():
    page = ROOT / "docs" / "page.md"
    text = (
        "# A page\n## Two words, `code`\n"
        "[ok](api.md) [ok](#two-words-code) [web](https://example.com/none)\n"
        "[gone](nowhere.md) ![gone](../bench-results/none.png) [bad](api.md#no-such-heading)\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    assert broken_links(page, text) == [
        "page.md:4 nowhere.md",
        "page.md:4 ../bench-results/none.png",
        "page.md:4 api.md#no-such-heading (no heading)",
    ]


def up_flags() -> list[str]:
    """Every flag `custody up --help` prints, `--help` aside."""
    out = subprocess.run(
        [sys.executable, "-m", "custody.cli", "up", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout)) - {"--help"})


def undocumented(flags: list[str], docs: str) -> list[str]:
    """The flags whose literal name appears nowhere in `docs` (`--host` is not found in
    `--host-state-bytes`)."""
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", docs)]


def test_every_flag_of_custody_up_is_documented_in_docs():
    flags = up_flags()
    assert "--redis-url" in flags and "--tier-move-delay-seconds" in flags and len(flags) > 40
    docs = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    assert not undocumented(flags, docs), f"flags not in docs/: {undocumented(flags, docs)}"


def test_the_flag_check_flags_an_undocumented_one():
    docs = "`--host-state-bytes` (1 GiB) and `--port`."
    assert undocumented(["--port", "--host", "--host-state-bytes", "--no-such"], docs) == [
        "--host",
        "--no-such",
    ]
