"""`--baseline REV` of `custody bench orchestration` and `e2e`: another revision's
services, measured by this revision's clients in the same run, runs alternating.

This machine's CPU figures drift with the hour (the same cell's scheduler CPU per
row-step read 58-62 us in one hour and 84-124 us in another), so a figure means little
beside one recorded earlier; beside another revision's measured minutes apart, by the
same measuring code, it does. Only the processes under test come from the baseline's
tree: its services (and its own stand-in executor), spawned with the tree on their
PYTHONPATH; the clients, the CPU sampling and the windows are this revision's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from custody.bench.harness import progress

REPO = Path(__file__).resolve().parents[2]

Item = TypeVar("Item", bound=Hashable)
Side = TypeVar("Side", bound=Hashable)
Run = TypeVar("Run")


def revision(rev: str, repo: Path = REPO) -> str:
    """The full commit id `rev` names in `repo`; ValueError, saying why, if none."""
    try:
        found = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        raise ValueError("--baseline needs git, which is not installed") from None
    if found.returncode == 0:
        return found.stdout.strip()
    inside = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--git-dir"], capture_output=True, text=True
    )
    if inside.returncode != 0:
        raise ValueError(f"--baseline needs a git checkout; {repo} is not one")
    raise ValueError(f"--baseline {rev!r}: no such revision in {repo}")


def tree_env(root: Path) -> dict[str, str]:
    """This environment with `root`'s packages first, and only its: a module missing from
    the tree must fail to import, not be found in this revision."""
    return {**os.environ, "PYTHONPATH": str(root)}


@contextlib.contextmanager
def tree(sha: str, modules: Iterable[str], repo: Path = REPO) -> Iterator[Path]:
    """The tracked files of revision `sha` in a temporary directory, removed on exit;
    checked to hold `modules` (the services a bench spawns from it), found there and not
    in this checkout: a revision without them fails here, not after minutes of a stack
    restarting what cannot start."""
    with tempfile.TemporaryDirectory(prefix=f"custody-{sha[:7]}-") as root:
        archive = subprocess.Popen(["git", "-C", str(repo), "archive", sha], stdout=subprocess.PIPE)
        assert archive.stdout is not None
        untar = subprocess.run(["tar", "-x", "-C", root], stdin=archive.stdout)
        archive.stdout.close()
        if archive.wait() or untar.returncode:
            raise RuntimeError(f"could not extract revision {sha} of {repo}")
        _check_modules(Path(root), sha, ["custody", "services", "shared", *modules])
        yield Path(root)


def _check_modules(root: Path, sha: str, modules: list[str]) -> None:
    """The editable install maps custody's packages to this checkout; PYTHONPATH comes
    before it, but a measurement of the wrong tree would be silent, so it is checked."""
    code = (
        "import importlib.util, sys\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        spec = importlib.util.find_spec(m)\n"
        "    except ImportError:\n"
        "        spec = None\n"
        "    print(spec and spec.origin or '')"
    )
    found = dict(zip(modules, run_in_tree(root, code, *modules).splitlines(), strict=True))
    missing = [m for m, origin in found.items() if not origin]
    if missing:
        raise RuntimeError(f"revision {sha[:7]} has no {', '.join(missing)}")
    outside = [o for o in found.values() if not Path(o).resolve().is_relative_to(root.resolve())]
    if outside:
        raise RuntimeError(f"the baseline's modules resolve outside its tree {root}: {outside}")


def run_in_tree(root: Path, code: str, *args: str) -> str:
    """`python -c code args` run on `root`'s packages; its standard output."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=root,
        env=tree_env(root),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"in the baseline's tree, {code!r} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def alternate(
    repeats: int,
    items: Sequence[Item],
    sides: Sequence[Side],
    measure: Callable[[int, Item, Side], Run],
    label: str,
) -> dict[Side, dict[Item, list[Run]]]:
    """Every item measured on every side `repeats` times, in the order: repeat, item,
    side. The sides of one item are then measured back to back, minutes apart rather than
    a sweep apart, and each repeat sees every item again later in the hour."""
    runs: dict[Side, dict[Item, list[Run]]] = {s: {i: [] for i in items} for s in sides}
    total, done = repeats * len(items) * len(sides), 0
    for repeat in range(repeats):
        for item in items:
            for side in sides:
                runs[side][item].append(measure(repeat, item, side))
                done += 1
                progress(label, done, total)
    return runs
