"""The compose stack, the Grafana dashboard and the alert rules refer only to things that
exist: files, modules, ports, and metrics that the running services really export."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from custody.replica import one_replica, replica_settings
from custody.up import Stack
from shared.config import Settings
from shared.redis_server import free_port, server_binary

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
        "replica",
        "router",
        "prometheus",
        "grafana",
    }
    defaults = Settings()
    exposed = {  # the compose network only: the store's operator routes, metrics, the API
        "session-store": [defaults.store_port],
        "replica": [defaults.port, defaults.executor_metrics_port],
    }
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        if name in ("session-store", "replica", "router"):
            assert (ROOT / service["build"] / "Dockerfile").exists()
            module = service["command"][-1]
            assert importlib.util.find_spec(module) is not None, module
            url = service["environment"]["CUSTODY_REDIS_URL"]
            assert re.fullmatch(r"redis://\w+:\$\{\w+:\?[^}]+\}@redis:6379/0", url), url
            assert service["environment"]["CUSTODY_HOST"] == "0.0.0.0"
        if name in exposed:
            assert "ports" not in service, name
            assert service["expose"] == [str(p) for p in exposed[name]], name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in spec["volumes"], (name, source)
    # The router's API is the only custody port published on the host.
    assert services["router"]["command"][-1] == "services.router.main"
    assert services["router"]["ports"] == [f"{defaults.port}:{defaults.port}"]
    assert services["session-store"]["environment"]["CUSTODY_STORE_HOST"] == "0.0.0.0"
    assert "--appendonly" in services["redis"]["command"]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
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


def test_the_replica_service_scales():
    """`docker compose up --scale replica=N`: nothing in the service may name one
    container (a container name, a hostname, a published port would collide), each
    container finds its own id, and every replica sees every replica's blobs."""
    replica = compose()["services"]["replica"]
    assert replica["command"] == ["python", "-m", "custody.replica"]
    assert not {"container_name", "hostname", "ports"} & set(replica)
    env = replica["environment"]
    assert env["CUSTODY_REPLICA"] == "auto"
    assert replica["init"] is True  # its children's orphans are reaped, SIGTERM forwarded
    mounts = dict(v.split(":")[:2] for v in replica["volumes"])
    assert mounts["session-state"] == env["CUSTODY_STATE_DIR"]  # the same path in each
    assert mounts["compile-cache"] == env["TORCHINDUCTOR_CACHE_DIR"]
    devices = replica["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == 1


def test_prometheus_scrapes_the_router_the_store_and_every_replica():
    services = compose()["services"]
    defaults = Settings()
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "custody"  # the alerts name it
    (static,) = job["static_configs"]
    assert set(static["targets"]) == {
        f"router:{defaults.port}",
        f"session-store:{defaults.store_port}",
    }
    # One A record per container of the scaled service: its scheduler and its executor.
    found = {(tuple(sd["names"]), sd["type"], sd["port"]) for sd in job["dns_sd_configs"]}
    assert found == {
        (("replica",), "A", defaults.port),
        (("replica",), "A", defaults.executor_metrics_port),
    }
    assert {str(port) for *_, port in found} == set(services["replica"]["expose"])
    # The alert rules: next to prometheus.yml here, and mounted next to it in compose.
    mounts = dict(v.split(":")[:2] for v in services["prometheus"]["volumes"])
    config_dir = Path(mounts["./deploy/prometheus.yml"]).parent
    assert config["rule_files"] == ["alerts.yml"]
    assert (ROOT / "deploy/alerts.yml").exists()
    assert mounts["./deploy/alerts.yml"] == str(config_dir / "alerts.yml")
    # Its syntax: promtool check config, tests/test_prometheus.py.


def test_a_replica_id_auto_is_the_hostname(monkeypatch, tmp_path):
    """A compose replica container's id is its hostname, resolved once for both of its
    children; an explicit id still wins, and `custody up` keeps replica 0."""
    monkeypatch.setattr(socket, "gethostname", lambda: "3f2a9c1b7d4e")
    env = {"CUSTODY_REDIS_URL": "redis://redis:6379/0", "CUSTODY_STATE_DIR": str(tmp_path)}
    assert Settings.resolve(environ={"CUSTODY_REPLICA": "auto"}).replica == "3f2a9c1b7d4e"
    assert Settings.resolve(environ={}).replica == "0"
    for unset in ({}, {"CUSTODY_REPLICA": ""}, {"CUSTODY_REPLICA": "auto"}):
        settings = replica_settings([], {**env, **unset})
        assert settings.replica == "3f2a9c1b7d4e"
        assert settings.blob_dir == tmp_path / "replica-3f2a9c1b7d4e"
    assert replica_settings([], {**env, "CUSTODY_REPLICA": "7"}).replica == "7"
    assert replica_settings(["--replica", "8"], env).replica == "8"
    stack = Stack(settings, plan=one_replica)  # no private Redis, no private state dir
    assert stack.redis is None and stack.state_dir is None
    assert {name: module for name, (module, _) in stack.layout.items()} == {
        "executor": "services.executor.service",
        "scheduler": "services.scheduler.main",
    }
    assert {own.to_env()["CUSTODY_REPLICA"] for _, own in stack.layout.values()} == {"3f2a9c1b7d4e"}
    for bad in ("x" * 65, "bad host"):
        monkeypatch.setattr(socket, "gethostname", lambda bad=bad: bad)
        with pytest.raises(ValueError, match="hostname"):
            replica_settings([], env)
    for missing in ("CUSTODY_REDIS_URL", "CUSTODY_STATE_DIR"):
        others = {k: v for k, v in env.items() if k != missing}
        with pytest.raises(ValueError, match=missing):
            replica_settings(["--replica", "1"], others)


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


def substituted(text: str, env: dict[str, str]) -> str:
    """Compose's `${NAME:?message}`, from `env` (a name it lacks is an error, as there)."""
    return re.sub(r"\$\{(\w+):\?[^}]*\}", lambda m: env[m.group(1)], text)


def test_compose_redis_takes_only_its_services_users_and_fsyncs_every_write(tmp_path: Path):
    """The compose Redis command, run: the default user is off, each custody service
    connects as its own ACL user with the URL compose gives it, and every write is
    fsynced (an acknowledged record survives a Redis crash)."""
    env = {
        name: f"pw-{name.lower()}"
        for name in (
            "CUSTODY_REDIS_STORE_PASSWORD",
            "CUSTODY_REDIS_REPLICA_PASSWORD",
            "CUSTODY_REDIS_ROUTER_PASSWORD",
        )
    }
    services = compose()["services"]
    port = free_port()
    command = [substituted(arg, env) for arg in services["redis"]["command"]]
    args = [server_binary(), *command[1:], "--port", str(port), "--dir", str(tmp_path)]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    try:
        anonymous = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                anonymous.ping()
                raise AssertionError("the default user was let in")
            except redis.AuthenticationError:
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the compose Redis did not start"
                time.sleep(0.1)
        for name in ("session-store", "replica", "router"):
            url = substituted(services[name]["environment"]["CUSTODY_REDIS_URL"], env)
            client = redis.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}"))
            assert client.set(f"written-by-{name}", 1)
        wrong = redis.Redis(port=port, username="router", password="not-it")
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
    finally:
        server.terminate()
        server.wait(10)


def test_every_custody_service_has_a_readiness_check_and_waits_for_what_it_needs():
    services = compose()["services"]
    for name, port in (("session-store", 30001), ("replica", 30000), ("router", 30000)):
        probe = " ".join(services[name]["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/health" in probe, name
    assert services["replica"]["depends_on"]["session-store"] == {"condition": "service_healthy"}
    assert services["router"]["depends_on"]["replica"] == {"condition": "service_healthy"}
