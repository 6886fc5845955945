"""The distributed fault campaign (docs/faults.md): its history checker can fail, its
proxy really partitions, slows and cuts a real Redis connection, and a run of
CUSTODY_FAULT_SECONDS (CI: 165) over two replicas injects every kind of fault with every
invariant holding."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import redis

from custody.inprocess import InProcess
from custody.soak import Campaign, campaign_held
from custody.soak.fault_kinds import KINDS
from custody.soak.history import Turn, judge, wrong_outputs
from custody.soak.redis_proxy import RedisProxy
from custody.soak.verdict import disowned
from services.scheduler.records.request import Request
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings

pytestmark = pytest.mark.solo
SECONDS = float(os.environ.get("CUSTODY_FAULT_SECONDS", "165"))


def turn(sid: str, ids: list[int], out: list[int], prompt: int, status: int = 200) -> Turn:
    return Turn(sid, ids, status, 0.0, 1.0, out, prompt)


def test_a_clean_history_passes_and_each_kind_of_harm_is_counted():
    clean = [
        turn("a", [1, 2], [3], 2),
        turn("b", [7], [8, 9], 1),
        turn("a", [4], [5], 4, status=503),  # refused: not part of the history
        turn("a", [4], [5], 4),
    ]
    assert (judge(clean).stale, judge(clean).twins) == ([], [])
    stale = [*clean, turn("a", [6], [7], 4)]  # ran on 3 tokens less than acknowledged
    assert judge(stale).stale == [stale[-1]]
    lost = [*clean, turn("a", [6], [], 0, status=404)]  # the acknowledged history is gone
    assert judge(lost).stale == [lost[-1]]
    probe = Turn("b", [], 200, 2.0, 3.0, kind="probe", replica="1")
    assert judge([*clean, probe]).twins == [probe]
    refused = Turn("b", [], 404, 2.0, 3.0, kind="probe", replica="1")
    assert judge([*clean, refused]).twins == []


def test_wrong_outputs_are_judged_against_the_acknowledged_history():
    turns = [turn("a", [1, 2], [3], 2), turn("a", [4], [5], 4)]
    seen: list[tuple[list[int], list[int]]] = []

    def disowned_by_judge(pairs: list[tuple[list[int], list[int]]]) -> list[bool]:
        seen.extend(pairs)
        return [False, True]

    assert wrong_outputs(turns, disowned_by_judge) == [turns[1]]
    assert seen == [([1, 2], [3]), ([1, 2, 3, 4], [5])]


def test_the_judge_disowns_a_wrong_token_and_owns_the_model_s_own():
    """The real judge (teacher-forced, the built-in model): the model's own greedy
    continuation passes, the same with one token changed fails."""
    prompt = [5, 9, 14, 3, 7]
    local = InProcess(Settings(compile=False))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    req = local.engine.submit(Request("x", np.asarray(prompt), params))
    local.run_until_idle()
    own = list(req.output)
    changed = [*own[:2], (own[2] + 1) % 250 + 1, own[3]]
    assert disowned([(prompt, own), (prompt, changed)]) == [False, True]


def test_the_proxy_partitions_slows_and_cuts_a_real_redis_connection(redis_url: str):
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = RedisProxy(port)
    try:
        client = redis.Redis.from_url(proxy.url, socket_timeout=0.5)
        assert client.ping()
        proxy.partition()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        proxy.heal()
        healed = redis.Redis.from_url(proxy.url, socket_timeout=2)
        assert healed.ping()
        proxy.slow(0.3)
        started = time.monotonic()
        assert healed.ping()
        assert time.monotonic() - started >= 0.5  # both ways
        proxy.heal()
        lasting = redis.Redis.from_url(proxy.url, retry_on_timeout=False)
        lasting.connection_pool.connection_kwargs["retry"] = None
        conn = lasting.connection_pool.get_connection()
        conn.send_command("PING")
        assert conn.read_response() in (b"PONG", "PONG", True)
        proxy.cut()
        with pytest.raises(redis.ConnectionError):
            conn.send_command("PING")
            conn.read_response()
        assert redis.Redis.from_url(proxy.url).ping()  # new connections pass
    finally:
        proxy.close()


def test_every_kind_of_fault_with_every_invariant_holding():
    campaign = Campaign(SECONDS, replicas=2, dead_seconds=3.0)
    result = campaign.run()
    table = [(r["kind"], r["hit"], r["stale_turns"], r["twin_copies"]) for r in campaign.rows]
    assert set(result["faults"]) == set(KINDS), result
    assert all(result["faults"].values()), (result["faults"], table)
    assert campaign.turns_acked > 50, campaign.turns_acked
    assert result["stale_turns"] == 0, (campaign.examples, table)
    assert result["twin_copies"] == 0, (campaign.examples, table)
    assert result["wrong_outputs"] == 0, table
    assert not any(result["leaked_slots"].values()), result
    assert result["leaked_placements"] == 0, (campaign.left_behind, campaign.load.unclosed[:5])
    assert campaign_held(result)


def test_campaign_threads_are_not_left_behind():
    """The proxies' threads end with the campaign (they would pile up across runs)."""
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("proxy")]:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.1)
