"""The dashboard and the alerts against a real Prometheus scraping a live stack.

A panel whose query returns nothing, or an alert whose expression errors, only shows up
when Prometheus itself evaluates them on what the services really export: label sets that
never match, a metric that was renamed. The alerts are shown firing with promtool's rule
fixtures (deploy/alerts_test.yml).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from custody.up import Stack
from shared.redis_server import free_port
from tests.services_harness import call

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana/dashboards/custody-pool-health.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = "no prometheus binary on PATH (scripts/test.sh installs Debian's as root)"
NO_PROMTOOL = "no promtool binary on PATH (scripts/test.sh installs Debian's as root)"


def panel_targets() -> list[tuple[str, str, str]]:
    """(panel title, legendFormat, expression) of every dashboard query."""
    dash = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target.get("legendFormat", ""), target["expr"])
        for panel in dash["panels"]
        for target in panel.get("targets", [])  # a row groups panels, queries nothing
    ]


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def promtool(*args: str) -> str:
    done = subprocess.run(
        [PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_every_alert_fires_in_the_promtool_fixtures():
    out = promtool("check", "config", "deploy/prometheus.yml")
    assert "1 rule files found" in out
    promtool("test", "rules", "deploy/alerts_test.yml")
    fixtures = yaml.safe_load((DEPLOY / "alerts_test.yml").read_text())
    fired = {
        case["alertname"]
        for test in fixtures["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert fired == {rule["alert"] for rule in alert_rules()}


class Prometheus:
    """A prometheus process with its own storage, scraping the stack every second."""

    def __init__(self, workdir: Path, stack: Stack) -> None:
        s = stack.settings
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [
            {"targets": [f"127.0.0.1:{p}" for p in (s.port, s.store_port, s.executor_metrics_port)]}
        ]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.job = job["job_name"]
        self.port = free_port()
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"prometheus exited: {self.log.name}"
            try:
                if ready():
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.25)

    def scrapes(self) -> int:
        """The fewest samples of `up` any target has in the last minute."""
        series = self.query(f'count_over_time(up{{job="{self.job}"}}[1m])')
        return min((int(r["value"][1]) for r in series), default=0) if len(series) == 3 else 0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def prometheus(stack: Stack, tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path, stack)
    try:
        yield prom
    finally:
        prom.stop()


def drive_traffic(stack: Stack) -> None:
    """Requests enough for every rate and latency histogram: repeated prompts (prefix
    cache hits), several tokens each (inter-token latency), and a session placed in each
    tier (every kind of tier move)."""
    port = stack.settings.port
    for i in range(4):
        prompt = [1 + (i % 2), 2, 3, 4, 5, 6, 7, 8, 9]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
        call(port, "/generate", body)
    sid = call(port, "/open_session", {})  # a session through every tier: each kind of move
    call(port, "/generate", {"input_ids": [5, 6, 7], "session_params": {"id": sid}})
    for tier in ("host", "disk", "device"):
        assert call(port, "/place_session", {"session_id": sid, "tier": tier})["tier"] == tier


@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
def test_every_panel_and_alert_query_answers_from_a_live_stack(stack, prometheus):
    prometheus.wait_for("a scrape of every target", lambda: prometheus.scrapes() >= 1)
    up = prometheus.query(f'up{{job="{prometheus.job}"}}')
    assert sorted(float(r["value"][1]) for r in up) == [1.0, 1.0, 1.0], up
    drive_traffic(stack)
    scraped = prometheus.scrapes()
    prometheus.wait_for("two scrapes after traffic", lambda: prometheus.scrapes() >= scraped + 2)
    empty, not_numbers, unlabelled, fallbacks = [], [], [], []
    for title, legend, expr in panel_targets():
        series = prometheus.query(expr)
        if not series:
            empty.append((title, expr))
        # No fallback (`or vector(0)`, absent(), ...): without any one of its metrics, as
        # when it is renamed or its service is down, the query shows nothing.
        for metric in set(re.findall(r"custody_\w+", expr)):
            gone = re.sub(rf"\b{metric}\b", f"{metric}_gone", expr)
            if prometheus.query(gone):
                fallbacks.append((title, expr, metric))
        for r in series:
            if not math.isfinite(float(r["value"][1])):
                not_numbers.append((title, expr, r))
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                if label not in r["metric"]:
                    unlabelled.append((title, expr, label))
    assert not empty, f"panel queries with no series: {empty}"
    assert not not_numbers, f"panel queries without a number after traffic: {not_numbers}"
    assert not unlabelled, f"legends naming a label the series lack: {unlabelled}"
    assert not fallbacks, f"panel queries showing data without a metric: {fallbacks}"

    rules = alert_rules()
    for rule in rules:
        prometheus.query(rule["expr"])  # status "success": it evaluates

    # Prometheus evaluates the loaded rule group itself; every rule must come out healthy.
    def evaluated() -> list[dict]:
        (group,) = prometheus.get("/api/v1/rules", type="alert")["groups"]
        done = [r for r in group["rules"] if r.get("lastEvaluation", "").startswith("2")]
        return group["rules"] if len(done) == len(group["rules"]) else []

    prometheus.wait_for("an evaluation of the alert rules", lambda: bool(evaluated()))
    loaded = evaluated()
    assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
    assert all(r["health"] == "ok" for r in loaded), [
        (r["name"], r.get("lastError")) for r in loaded
    ]
    # A healthy stack: every metric the alerts read is there and nothing is wrong. Only the
    # leak alert may be pending: the ledger replays the ownership stream a little behind.
    active = {r["name"]: r["state"] for r in loaded if r["state"] != "inactive"}
    assert active in ({}, {"CustodyLeakedSlots": "pending"}), active
