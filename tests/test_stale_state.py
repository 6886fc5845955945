"""A restarted scheduler never answers from stale records (docs/architecture.md,
"Scheduler restarted").

With the session store paused (SIGSTOP), the records of the last turn are on the
ownership stream but not applied. A scheduler SIGKILLed and restarted then cannot prove
its records current: it answers that session's turns 503 with Retry-After, never from the
older record. Once the store goes on, the turn runs on the whole acknowledged history
and equals a one-shot generation over it. Real processes, a real Redis."""

from __future__ import annotations

import os
import signal
import time
import urllib.error

import pytest

from custody.up import Stack
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
            return err.code, dict(err.headers)
        except OSError:  # the scheduler is restarting
            assert time.monotonic() < deadline, "the scheduler did not come back"
            time.sleep(0.2)


def test_a_restart_while_the_store_lags_answers_503_never_stale_history(paused_store_stack):
    stack = paused_store_stack
    port = stack.settings.port
    sid = call(port, "/open_session", {})
    history: list[int] = []
    first = [5, 6, 7, 8, 9, 10, 11, 12]
    history += first + turn(port, sid, first)["output_ids"]
    os.kill(stack.children["session-store"].pid, signal.SIGSTOP)
    second = [21, 22, 23, 24, 25, 26, 27, 28]
    history += second + turn(port, sid, second)["output_ids"]  # acknowledged, not applied

    stack.kill("scheduler")
    third = [31, 32, 33, 34]
    # past the old 10 s wait, after which the scheduler used to rebuild from stale records
    deadline = time.monotonic() + 14
    while time.monotonic() < deadline:
        status, answer = supervised_turn(stack, sid, third, 60)
        assert status == 503, (status, answer)  # never a turn on the older history
        assert answer.get("Retry-After") == "1", answer
        time.sleep(1.0)

    os.kill(stack.children["session-store"].pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        status, answer = supervised_turn(stack, sid, third, 60)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert status == 200, answer
    assert answer["meta_info"]["prompt_tokens"] == len(history) + len(third), answer
    assert answer["output_ids"] == one_shots([history + third])[0]
    assert len(answer["output_ids"]) == OUTPUT
