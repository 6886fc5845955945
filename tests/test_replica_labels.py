"""Two replicas as processes, one session store: the store keeps a ledger for each, finds a
session's record on the replica it was placed on, and every service's metrics name their
replica, so one Prometheus can tell the replicas apart."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from custody.up import Stack
from tests.services_harness import call, stack_settings, start_stack
from tests.test_replicas import home


@pytest.fixture
def two(redis_url: str, redis_client: redis.Redis) -> Stack:
    running = start_stack(stack_settings(redis_url, replicas=2))
    yield running
    running.stop()


def labels_of(port: int) -> list[dict[str, str]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples]


def both_ready(store_port: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        ledgers = call(store_port, "/ledger/replicas")["replicas"]
        if set(ledgers) == {"0", "1"} and all(v["ready"] for v in ledgers.values()):
            return ledgers
        assert time.monotonic() < deadline, ledgers
        time.sleep(0.2)


def session_record(store_port: int, sid: str, timeout: float = 30) -> dict:
    """The record once the store has applied the turn (it replays behind the scheduler)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            record = call(store_port, f"/sessions/{sid}")
            if record["history_tokens"] >= 3:
                return record
        except urllib.error.HTTPError as err:
            assert err.code == 404
        assert time.monotonic() < deadline, f"no record of {sid}"
        time.sleep(0.2)


def test_one_store_serves_both_replicas_and_every_sample_names_its_replica(two, redis_client):
    s = two.settings
    sid = call(s.port, "/open_session", {})  # through the router: placed on one replica
    body = {"input_ids": [5, 6, 7], "session_params": {"id": sid}}
    call(s.port, "/generate", body | {"sampling_params": {"max_new_tokens": 3}})
    placed = home(redis_client, sid)
    ledgers = both_ready(s.store_port)
    assert all(v["violations"] == [] for v in ledgers.values()), ledgers
    assert ledgers["0"]["epoch"] != ledgers["1"]["epoch"]  # each its own scheduler's
    assert call(s.store_port, f"/ledger?replica={placed}")["epoch"] == ledgers[placed]["epoch"]
    assert session_record(s.store_port, sid)["session_id"] == sid
    for i in ("0", "1"):
        own = two.layout[f"scheduler-{i}"][1]
        for port in (own.port, own.executor_metrics_port):
            found = labels_of(port)
            assert found and all(labels.get("replica") == i for labels in found), (i, port)
    store = labels_of(s.store_port)
    assert {labels["replica"] for labels in store} == {"0", "1"}
    assert all("replica" in labels for labels in store)
