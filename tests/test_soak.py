"""The chaos soak: many concurrent sessions with aborts, over-long inputs, closes,
timeouts, shared prefixes and hostile inputs, under two API keys, on state tiers small
enough that hibernates and spills are routine, while the executor (often during a tier
move, and at least once during each of a hibernate, a spill and a restore), the scheduler
and the session store are SIGKILLed and Redis restarted. With every session closed and
the cache flushed, no slot of any pool (device, host, disk) may be held in the
independent ledger, the ledger must have seen no violation, every greedy output must be a
fault-free greedy continuation, every reply must carry its expected status, and every
restart must follow an injected kill (a blob file left on disk is reported; see below).
CUSTODY_SOAK_SECONDS sets the load's length (CI: 90; the tier drill runs inside it)."""

import json
import os

import pytest

from custody.soak import Soak
from custody.soak.client import NO_ANSWER, Reply
from custody.soak.tiers import MoveCount, TierWatch
from custody.soak.verdict import MUST_HIT, failures
from shared import streams

pytestmark = pytest.mark.solo
SECONDS = float(os.environ.get("CUSTODY_SOAK_SECONDS", "90"))


def test_chaos_soak_loses_nothing():
    result = Soak(SECONDS, chaos=True).run()
    assert result["turns"] > 0 and result["finished"] > 0, result
    assert sum(result["service_restarts"]["injected"].values()) > 0, result
    assert result["hostile_requests"], result
    assert result["ledger_ready"], result
    assert {"host_kv", "host_mamba", "disk"} <= set(result["ledger_pools"]), result
    for kind in MUST_HIT:
        assert result["kills_during_tier_moves"][kind] >= 1, (kind, result["tier_drill"])
    moved = result["tier_moves_completed"]
    assert all(moved[kind] > 0 for kind in ("hibernate", "spill", "load", "restore")), moved
    assert result["leaked_slots"] == 0, result["leaked_by_pool"]
    assert result["ledger_violations"] == 0, result["violations"]
    assert result["wrong_outputs"] == 0, result
    assert result["unexpected_statuses"] == 0, result["unexpected_examples"]
    assert sum(result["service_restarts"]["unexplained"].values()) == 0, result
    assert result["leftover_blobs"] == {}, result["leftover_blobs"]
    assert result["failed"] == [], result


def clean(**changes: object) -> dict:
    """A passing tiered result, with `changes`."""
    result = {
        "leaked_slots": 0,
        "ledger_violations": 0,
        "wrong_outputs": 0,
        "unexpected_statuses": 0,
        "service_restarts": {"unexplained": {"executor": 0}},
        "ledger_ready": True,
        "leftover_blobs": {},
        "tiers": True,
        "ledger_pools": ["disk", "host_kv", "host_mamba", "kv", "mamba", "req"],
        "kills_during_tier_moves": {"hibernate": 1, "spill": 2, "load": 0, "restore": 1},
    }
    return result | changes


def test_the_verdict_needs_a_kill_in_each_move_and_every_tier_pool():
    assert failures(clean()) == []
    kills = {"hibernate": 3, "spill": 0, "load": 5, "restore": 0}
    assert failures(clean(kills_during_tier_moves=kills)) == [
        "no_kill_during_spill",
        "no_kill_during_restore",
    ]
    assert failures(clean(ledger_pools=["kv", "mamba", "req"])) == ["tier_pools_not_in_ledger"]
    assert failures(clean(leftover_blobs={"3.blob": 12.5})) == ["leftover_blobs"]
    assert failures(clean(tiers=False, kills_during_tier_moves=kills)) == []


def test_the_watch_reads_only_kinds_with_moves_in_flight(redis_url, redis_client):
    watch = TierWatch(redis_url)
    assert watch.in_flight() == set()
    redis_client.hset(
        streams.SINGLE.tier_in_flight, mapping={"spill": 1, "hibernate": 2, "load": 0, "restore": 0}
    )
    assert watch.in_flight() == {"spill", "hibernate"}
    assert watch.wait_for(lambda kinds: "restore" in kinds, 0.05, lambda: False) == set()
    assert watch.wait_for(lambda kinds: "spill" in kinds, 1, lambda: False) == {
        "spill",
        "hibernate",
    }
    watch.clear()
    assert watch.in_flight() == set()


def test_moves_are_summed_over_executor_lives(monkeypatch):
    count = MoveCount(0, every=0)
    pages = iter(["2", "5", "1", "3"])  # the executor restarted after the second sample

    class Reply:
        status = 200

        @property
        def text(self) -> str:
            n = next(pages)
            return f'custody_tier_moves_total{{kind="spill"}} {n}.0\n'

    monkeypatch.setattr("custody.soak.tiers.call", lambda *a, **k: Reply())
    for _ in range(4):
        count.sample()
    assert count.total() == {"hibernate": 0, "spill": 8, "load": 0, "restore": 0}


def test_an_edge_worker_saying_its_core_died_counts_as_no_answer():
    def edge(status: int, kind: str) -> Reply:
        body = {"error": {"message": "...", "type": kind}}
        return Reply(status, body, json.dumps(body))

    assert edge(502, "core_lost").outcome == NO_ANSWER  # sent: it may have run
    assert edge(503, "core_gone").outcome == NO_ANSWER  # not sent; no answer is weaker
    assert edge(503, "queue_full").outcome == "503"  # any other 5xx stays a failure
