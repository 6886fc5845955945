"""A restarted scheduler never answers from stale records, nor forgets a session whose
records the store has not applied (docs/architecture.md, "Scheduler restarted").

With the session store paused (SIGSTOP), one session's last turn is on the ownership
stream but not applied (its record is older than its history), and another session's
every record is (the store never heard of it). A scheduler SIGKILLed and restarted then
cannot prove its records current: it answers both sessions' turns 503 with Retry-After,
never from the older record and never 404. Once the store goes on, each turn runs on its
whole acknowledged history and equals a one-shot generation over it. Real processes, a
real Redis."""

from __future__ import annotations

import os
import signal
import time
import urllib.error

import pytest
import redis

from custody.up import Stack
from shared import records_proof, streams
from tests.services_harness import call, stack_settings, start_stack
from tests.test_replicas import OUTPUT, one_shots, turn


@pytest.fixture
def paused_store_stack(redis_url: str, redis_client) -> Stack:
    stack = start_stack(stack_settings(redis_url))
    store = stack.children["session-store"]
    yield stack
    if store.poll() is None:
        os.kill(store.pid, signal.SIGCONT)
    stack.stop()


def supervised_turn(stack: Stack, sid: str, ids: list[int], seconds: float) -> tuple[int, dict]:
    """A turn tried until it is answered other than by a refused connection, supervising
    the stack meanwhile: (status, body or headers)."""
    deadline = time.monotonic() + seconds
    while True:
        stack.supervise_once()
        try:
            return 200, turn(stack.settings.port, sid, ids)
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers) | {"body": err.read().decode()}
        except OSError:  # the scheduler is restarting
            assert time.monotonic() < deadline, "the scheduler did not come back"
            time.sleep(0.2)


def store_caught_up(client: redis.Redis, replica: str, seconds: float = 10) -> None:
    """Until the store has applied every record on `replica`'s stream as it is now."""
    keys = streams.Keys(replica)
    tail = client.xrevrange(keys.ownership, count=1)
    target = records_proof.entry_id(tail[0][0]) if tail else (0, 0)
    deadline = time.monotonic() + seconds
    while True:
        through = client.hget(keys.checkpoint, records_proof.THROUGH) or b"0-0"
        if records_proof.entry_id(through) >= target:
            return
        assert time.monotonic() < deadline, "the store did not catch up"
        time.sleep(0.05)


def test_a_restart_while_the_store_lags_answers_503_never_stale_history(
    paused_store_stack, redis_client
):
    stack = paused_store_stack
    port = stack.settings.port
    recorded = call(port, "/open_session", {})
    histories: dict[str, list[int]] = {recorded: []}
    first = [5, 6, 7, 8, 9, 10, 11, 12]
    histories[recorded] += first + turn(port, recorded, first)["output_ids"]
    store_caught_up(redis_client, stack.settings.replica)
    os.kill(stack.children["session-store"].pid, signal.SIGSTOP)
    second = [21, 22, 23, 24, 25, 26, 27, 28]
    histories[recorded] += second + turn(port, recorded, second)["output_ids"]  # not applied
    unknown = call(port, "/open_session", {})  # the store never applies its opening
    histories[unknown] = second + turn(port, unknown, second)["output_ids"]

    stack.kill("scheduler")
    third = [31, 32, 33, 34]
    # past the old 10 s wait, after which the scheduler used to rebuild from stale records
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        for sid in histories:
            status, answer = supervised_turn(stack, sid, third, 60)
            assert status == 503, (sid == recorded, status, answer)  # never older, never 404
            assert answer.get("Retry-After") == "1", answer
        time.sleep(1.0)

    os.kill(stack.children["session-store"].pid, signal.SIGCONT)
    for sid, history in histories.items():
        deadline = time.monotonic() + 30
        while True:
            status, answer = supervised_turn(stack, sid, third, 60)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert status == 200, (sid == recorded, answer.get("body"))
        assert answer["meta_info"]["prompt_tokens"] == len(history) + len(third), answer
        assert answer["output_ids"] == one_shots([history + third])[0]
        assert len(answer["output_ids"]) == OUTPUT
