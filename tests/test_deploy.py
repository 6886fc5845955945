"""The compose stack, the Grafana dashboard and the alert rules refer only to things that
exist: files, modules, ports, and metrics that the running services really export."""

from __future__ import annotations

import importlib.util
import json
import re
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/custody-pool-health.json"


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_ports_volumes_and_provisioning_exist():
    spec = compose()
    services = spec["services"]
    assert set(services) == {
        "redis",
        "session-store",
        "executor",
        "scheduler",
        "prometheus",
        "grafana",
    }
    defaults = Settings()
    ports = {
        "scheduler": defaults.port,
        "session-store": defaults.store_port,
        "executor": defaults.executor_metrics_port,
    }
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        if name in ports:
            assert (ROOT / service["build"] / "Dockerfile").exists()
            module = service["command"][-1]
            assert importlib.util.find_spec(module) is not None, module
            if name == "scheduler":  # the API is the only port published on the host
                assert service["ports"] == [f"{ports[name]}:{ports[name]}"]
            else:  # the store's operator routes and the metrics: the compose network only
                assert "ports" not in service and service["expose"] == [str(ports[name])]
            assert service["environment"]["CUSTODY_REDIS_URL"].startswith("redis://redis:")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in spec["volumes"], (name, source)
    assert services["session-store"]["environment"]["CUSTODY_STORE_HOST"] == "0.0.0.0"
    assert "--appendonly" in services["redis"]["command"]
    assert services["executor"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"
    ] == ["gpu"]
    targets = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    scraped = set(targets["scrape_configs"][0]["static_configs"][0]["targets"])
    assert scraped == {f"{name}:{port}" for name, port in ports.items()}
    # The alert rules: next to prometheus.yml here, and mounted next to it in compose.
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    config_dir = Path(mounts["./deploy/prometheus.yml"]).parent
    assert targets["rule_files"] == ["alerts.yml"]
    assert (ROOT / "deploy/alerts.yml").exists()
    assert mounts["./deploy/alerts.yml"] == str(config_dir / "alerts.yml")
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/custody.yml").read_text()
    )
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    dashboards_dir = ROOT / mounted[provider["providers"][0]["options"]["path"]]
    assert DASHBOARD.parent == dashboards_dir.resolve()
    datasource = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def exported(port: int) -> set[str]:
    """The sample names a service exports. Every sample names its replica, "0" in a
    single-replica stack (shared/metrics_labels.py), so one dashboard serves any number."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    unlabelled = [(s.name, s.labels) for s in samples if s.labels.get("replica") != "0"]
    assert samples and not unlabelled, (port, unlabelled)
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_the_dashboard_uses_only_metrics_the_services_export(stack):
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "custody pool health"
    call_body = json.dumps(
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    ).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.settings.port}/generate", data=call_body)
    urllib.request.urlopen(req, timeout=60).read()
    s = stack.settings
    names = exported(s.port) | exported(s.store_port) | exported(s.executor_metrics_port)
    exprs = [target["expr"] for panel in dash["panels"] for target in panel.get("targets", [])]
    # No fallback: a missing or renamed metric must show as no data, never as a reassuring 0.
    assert not [e for e in exprs if "vector(" in e or "absent" in e]
    used = {m for e in exprs for m in re.findall(r"custody_[a-z0-9_]+", e)}
    assert used and used <= names, sorted(used - names)
    groups = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())["groups"]
    alerted = {
        m
        for group in groups
        for rule in group["rules"]
        for m in re.findall(r"custody_[a-z0-9_]+", rule["expr"])
    }
    assert alerted and alerted <= names, sorted(alerted - names)
    pool_panels = [p for p in dash["panels"] if "occupancy by owner kind" in p["title"]]
    assert len(pool_panels) == 3
    assert all(
        p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal" for p in pool_panels
    )
