"""A gap in the ownership stream that no live scheduler can fill ends in a decision the
client sees, never in a wait without end (issue 43, finding 3), as processes on a real
Redis.

The store is paused while the scheduler writes more ownership entries than the stream
keeps unconsumed (twice `stream_maxlen`, 50): the scheduler trims what the store has not
read, counts it and marks it. Then the scheduler is killed and the store goes on: it
finds the gap, and the life that could have filled it (with a full set of records) is
gone. Before, the new life waited for the store's proof, the store for a full set, and
the full set for the new life's sessions to be taken back: every session answered 503
for ever. Now the store decides (its sessions are lost), each turn of them answers 410
`session_lost`, its close ends it, and new sessions are served."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error

from tests.services_harness import call, metric_sum, stack_settings, start_stack
from tests.test_replicas import turn


def status(port: int, sid: str) -> tuple[int, dict]:
    try:
        return 200, turn(port, sid, [4, 5, 6])
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError as err:  # not listening yet
        return 0, {"error": repr(err)}


def test_sessions_whose_records_a_dead_life_left_unprovable_end_lost_not_refused_for_ever(
    redis_url, redis_client
):
    stack = start_stack(stack_settings(redis_url, stream_maxlen=50))
    try:
        port = stack.settings.port
        sids = [call(port, "/open_session", {}) for _ in range(3)]
        for sid in sids:
            turn(port, sid, [1, 2, 3])
        store = stack.children["session-store"]
        os.kill(store.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 120
            while metric_sum(port, "custody_ownership_trimmed_unread_total") == 0:
                assert time.monotonic() < deadline, "the scheduler never trimmed unread entries"
                for sid in sids:
                    turn(port, sid, [7, 8])
            stack.kill("scheduler")
        finally:
            os.kill(store.pid, signal.SIGCONT)
        stack.start("scheduler")
        deadline = time.monotonic() + 60
        answers = {}
        while len(answers) < len(sids):
            for sid in sids:
                code, body = status(port, sid)
                assert code != 200, "a session was served from a record a turn short"
                if code == 410:
                    answers[sid] = body["error"]["type"]
            assert time.monotonic() < deadline, f"sessions refused for good: {code} {body}"
            time.sleep(0.3)
        assert set(answers.values()) == {"session_lost"}
        ledger = call(stack.settings.store_port, "/ledger")
        assert ledger["sessions_lost"] == len(sids), ledger
        assert call(port, "/close_session", {"session_id": sids[0]}) is True  # ends it
        assert status(port, sids[0])[0] == 404
        assert status(port, sids[1])[0] == 410  # the others stay lost until closed
        fresh = call(port, "/open_session", {})
        assert len(turn(port, fresh, [1, 2, 3])["output_ids"]) > 0
    finally:
        stack.stop()
