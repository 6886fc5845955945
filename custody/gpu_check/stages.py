"""The GPU check's stages, in order, each with its time box: the commands it runs and
where its figures come from.

The whole check is held to `TOTAL_SECONDS`: a stage gets its own budget or what is left
of the total, whichever is less, so the last stages are the ones cut short. A stage
that runs out of time is killed with every process it started (its own session), and
the next one starts; each stage runs whatever the ones before it gave (a failed install
shows up as failures after it, named in the summary).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from custody.gpu_check.wheels import ROOT, WHEELS_DIR

TOTAL_SECONDS = 300
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
BENCH = [sys.executable, "-m", "custody.cli", "bench"]
RESULTS = ROOT / "bench-results"


@dataclass(frozen=True)
class Stage:
    name: str
    budget: int  # seconds
    what: str
    commands: Callable[[Path], list[list[str]]]  # the work folder -> commands, in order
    figures: Callable[[Path], dict] = lambda work: {}  # read after it ran, even cut short
    # removed first, so an earlier run's are never read: the work folder -> files
    outputs: Callable[[Path], list[Path]] = lambda work: []


@dataclass
class Outcome:
    name: str
    status: str = "not run"  # passed, failed, timed out, skipped tests, not run
    seconds: float = 0.0
    budget: int = 0
    returncodes: list[int] = field(default_factory=list)
    tail: str = ""  # the end of its output
    figures: dict = field(default_factory=dict)


def _install(work: Path) -> list[list[str]]:
    wheels = sorted(str(w) for w in WHEELS_DIR.glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    return [
        [*pip, "--no-compile", *wheels],
        [*pip, "--no-build-isolation", "-e", str(ROOT)],
        [sys.executable, "-m", "custody.gpu_check", "--verify"],
    ]


def _tests(name: str, budget: int, what: str, marker: str) -> Stage:
    """A pytest selection of tests/gpu, its outcomes read from its JUnit XML."""
    return Stage(
        name,
        budget,
        what,
        lambda work: [[*PYTEST, "-m", marker, "tests/gpu", f"--junitxml={work / name}.xml"]],
        lambda work: read_junit(work / f"{name}.xml"),
        lambda work: [work / f"{name}.xml"],
    )


def _bench(name: str, budget: int, what: str) -> Stage:
    """`custody bench NAME --device cuda`, its figures read from its result file."""
    return Stage(
        name,
        budget,
        what,
        lambda work: [[*BENCH, name, "--device", "cuda"]],
        lambda work: read_json(RESULTS / f"{name}-cuda.json"),
        lambda work: [RESULTS / f"{name}-cuda.json", RESULTS / f"{name}-cuda.md"],
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def read_junit(path: Path) -> dict:
    """Each test's outcome and the properties it recorded (record_property)."""
    if not path.exists():
        return {}
    tests, properties = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        outcome = "passed"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (found.get("message") or "")[:300]
                outcome += f": {message}" if message else ""
        tests[name] = outcome
        for prop in case.iter("property"):
            properties[prop.get("name", "?")] = _number(prop.get("value", ""))
    counts: dict[str, int] = {}
    for outcome in tests.values():
        key = outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    return {"counts": counts, "tests": tests, "properties": properties}


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


MARKERS = {"tests": "gpu and not stack", "stack": "gpu and stack"}
STAGES = (
    Stage(
        "install",
        30,
        "custody and the carried wheels, offline, then the installed packages checked "
        "against what the check imports",
        _install,
    ),
    _tests(
        "tests",
        90,
        "pytest -m gpu: the slot kernels, the deferred ops' order on the compute stream, "
        "logits against transformers, the compiled decode step",
        MARKERS["tests"],
    ),
    _tests(
        "stack",
        60,
        "custody up --compile false with the executor on CUDA: sessions, a tier move, an "
        "executor restart; outputs equal to one-shot, every ledger clean",
        MARKERS["stack"],
    ),
    _bench(
        "executor",
        90,
        "custody bench executor --device cuda: the 8B shape's decode step at batch 1, 8, "
        "64, 256 against the weight-read bound, transformers beside",
    ),
    _bench(
        "orchestration",
        60,
        "custody bench orchestration --device cuda: the real executor serving the 8B "
        "shape to 64 and 256 clients, each process on its own cores",
    ),
)
TEST_FILES = {  # the stages' test selections must hold these modules (the dry run checks)
    "tests": {
        "test_kernels.py",
        "test_stream_order.py",
        "test_logits.py",
        "test_compiled_decode.py",
    },
    "stack": {"test_stack.py"},
}


def run_stage(stage: Stage, work: Path, seconds: float, log: Path) -> Outcome:
    """The stage's commands in order, all within `seconds`; output appended to `log`."""
    outcome = Outcome(stage.name, budget=int(seconds))
    for path in stage.outputs(work):
        path.unlink(missing_ok=True)
    start = time.monotonic()
    offset = log.stat().st_size if log.exists() else 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    status = "passed"
    with log.open("a") as out:
        out.write(f"\n===== {stage.name} ({int(seconds)} s) =====\n")
        out.flush()
        for command in stage.commands(work):
            left = seconds - (time.monotonic() - start)
            out.write("$ " + " ".join(command) + "\n")
            out.flush()
            child = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                outcome.returncodes.append(child.wait(timeout=max(left, 1)))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                status = "timed out"
                break
            if outcome.returncodes[-1] != 0:
                status = "failed"
    outcome.seconds = round(time.monotonic() - start, 1)
    with log.open() as written:
        written.seek(offset)
        outcome.tail = written.read()[-3000:]
    try:
        outcome.figures = stage.figures(work)
    except Exception as err:  # a stage cut short may leave half a file
        outcome.figures = {"unreadable": f"{type(err).__name__}: {err}"}
    counts = outcome.figures.get("counts")
    if status == "passed" and counts is not None and (counts.get("skipped") or not counts):
        status = "skipped tests"  # on the GPU machine a skip means CUDA was not seen
    outcome.status = status
    return outcome
