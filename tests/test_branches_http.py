"""Sessions as trees through the HTTP API of the real services: SGLang's branching fields
and `/fork_session` (docs/api.md, "Sessions"), each answer equal to a one-shot
generation of the same prompt, `cached_tokens` showing the kept boundary it resumed
from, a branch and a fork on the disk tier through an executor kill; then the same tree
after a move to another replica and a scheduler restart, with both replicas' ledgers
clean (branching header sessions: tests/test_header_branches_http.py).

What it can catch: a branch or fork run from the wrong history or state (its tokens
differ from the one-shot's), a kept boundary lost (`cached_tokens` below the bound), a
tree or fork the record did not carry (a 400 naming the turn after the move or the
restart), a fork placed away from its parent by the router, a leak or a double owner
(the store's ledger). What it cannot: branching under faults (the chaos soak)."""

from __future__ import annotations

import time
import urllib.error

from tests.services_harness import (
    POOLS,
    assert_clean,
    call,
    kill_executor_during,
    metric_sum,
    one_shot,
    stack_settings,
    start_stack,
)
from tests.test_migration import ledgers_clean
from tests.test_replicas import home

PAGE, TRACK = POOLS["page_size"], POOLS["track_interval"]
N = 6  # tokens a turn generates
GREEDY = {"max_new_tokens": N, "ignore_eos": True}


def turn(port: int, sid: str, ids: list[int], **options) -> dict:
    body = {"input_ids": ids, "sampling_params": GREEDY, "session_params": {"id": sid, **options}}
    return call(port, "/generate", body)


def tokens(reply: dict, prompt: list[int]) -> list[int]:
    return prompt + reply["output_ids"]


def checked(port: int, sid: str, prompt: list[int], ids: list[int], **options) -> dict:
    """A turn whose prompt must be `prompt` (its `ids` last) and whose answer is the
    one-shot's. Unless an `offset` cut inside a turn (where no state need be kept), it
    resumed from a kept boundary within a track interval and a page of the tokens it
    shares with the turn it continues (`prompt` less `ids`)."""
    reply = turn(port, sid, ids, **options)
    meta = reply["meta_info"]
    assert meta["prompt_tokens"] == len(prompt), (options, meta)
    assert reply["output_ids"] == one_shot(prompt, N), options
    shared = len(prompt) - len(ids)
    if "offset" not in options:
        assert meta["cached_tokens"] >= shared - shared % PAGE - TRACK - PAGE, (options, meta)
    return reply


def refused(port: int, path: str, body: dict) -> tuple[int, str]:
    try:
        call(port, path, body)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    raise AssertionError("accepted")


def test_branches_and_forks_answer_as_one_shots(stack):
    port = stack.settings.port
    sid = call(port, "/open_session", {"session_id": "tree"})
    a, b, c = list(range(1, 41)), list(range(50, 57)), list(range(60, 65))
    t1 = turn(port, sid, a)
    h1 = tokens(t1, a)
    t2 = turn(port, sid, b)
    h2 = tokens(t2, h1 + b)
    r1, r2 = t1["meta_info"]["id"], t2["meta_info"]["id"]
    checked(port, sid, h1 + c, c, rid=r1)
    checked(port, sid, h1 + b + c, c, rid=r2, drop_previous_output=True)
    checked(port, sid, h2[:30] + c, c, rid=r2, offset=30)
    t6 = checked(port, sid, h2[:-2] + c, c, rid=r2, offset=-2)
    # without rid: the latest turn, from the session's own state
    after = tokens(t6, h2[:-2] + c)
    t7 = turn(port, sid, [7])
    assert t7["meta_info"]["cached_tokens"] == len(after) - 1
    assert t7["output_ids"] == one_shot([*after, 7], N)
    # replace forgets the named turn's other branches
    t8 = checked(port, sid, [*h1, 9], [9], rid=r1, replace=True)
    code, message = refused(
        port, "/generate", {"input_ids": [1], "session_params": {"id": sid, "rid": r2}}
    )
    assert code == 400 and "session_params.rid" in message
    # a fork of turn 1: a session of its own, resuming from the parent's kept boundary
    child = call(port, "/fork_session", {"session_id": sid, "rid": r1, "new_session_id": "kid"})
    assert child == "kid"
    k1 = checked(port, child, h1 + c, c)
    code, message = refused(port, "/fork_session", {"session_id": sid, "rid": "nope"})
    assert code == 400 and "session_params.rid" in message
    code, _ = refused(port, "/fork_session", {"session_id": "absent"})
    assert code == 404
    # a streaming session is append-only
    flat = call(port, "/open_session", {"streaming": True})
    first = turn(port, flat, a)["meta_info"]["id"]
    turn(port, flat, b)
    code, message = refused(
        port, "/generate", {"input_ids": [1], "session_params": {"id": flat, "rid": first}}
    )
    assert code == 400 and "latest turn" in message
    assert metric_sum(port, "custody_session_forks_total") == 1
    assert metric_sum(port, "custody_session_branch_turns_total") >= 5
    # the latest turn named while its state is on disk: it continues from there
    assert call(port, "/place_session", {"session_id": sid, "tier": "disk"})["tier"] == "disk"
    h8 = tokens(t8, [*h1, 9])
    t9 = checked(port, sid, [*h8, 5], [5], rid=t8["meta_info"]["id"])
    assert t9["meta_info"]["cached_tokens"] >= len(h8) - PAGE
    # the fork's state on disk when the executor dies: it comes back from there
    assert call(port, "/place_session", {"session_id": child, "tier": "disk"})["tier"] == "disk"
    # an executor killed under a branch turn: run again after the loss, still exact
    body = {
        "input_ids": [3],
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
        "session_params": {"id": sid, "rid": r1},
    }
    last = kill_executor_during(stack, port, "/generate", body)
    assert last["output_ids"] == one_shot([*h1, 3], 24)
    assert turn(port, sid, [2])["output_ids"] == one_shot([*h1, 3, *last["output_ids"], 2], N)
    forked = tokens(k1, h1 + c)
    k2 = turn(port, child, [4])
    assert k2["output_ids"] == one_shot([*forked, 4], N)
    assert k2["meta_info"]["cached_tokens"] >= len(forked) - PAGE  # its blob on disk survived
    for name in (sid, child, flat):
        call(port, "/close_session", {"session_id": name})
    assert_clean(stack)


def test_a_tree_and_a_fork_survive_a_move_and_a_restart(redis_url, redis_client):
    stack = start_stack(stack_settings(redis_url, replicas=2))
    try:
        port = stack.settings.port
        sid = call(port, "/open_session", {})
        a, b = list(range(1, 33)), list(range(40, 48))
        t1 = turn(port, sid, a)
        h1 = tokens(t1, a)
        t2 = turn(port, sid, b)
        r1, r2 = t1["meta_info"]["id"], t2["meta_info"]["id"]
        child = call(port, "/fork_session", {"session_id": sid, "rid": r1})
        parent_home = home(redis_client, sid)
        assert home(redis_client, child) == parent_home  # placed beside its parent
        c1 = checked(port, child, [*h1, 5], [5])
        call(port, "/admin/drain", {"replica": parent_home})
        other = "1" if parent_home == "0" else "0"
        assert home(redis_client, sid) == home(redis_client, child) == other
        reply = turn(port, sid, [6, 7], rid=r1)  # the tree travelled with the record
        assert reply["output_ids"] == one_shot([*h1, 6, 7], N)
        stack.kill(f"scheduler-{other}")
        stack.start(f"scheduler-{other}")
        deadline = time.monotonic() + 60
        while True:  # the restarted scheduler takes its sessions back from the store (503);
            try:  # the router's connection to the killed one may still be pooled (502)
                reply = turn(port, sid, [8], rid=r2, drop_previous_output=True)
                break
            except urllib.error.HTTPError as err:
                assert err.code in (502, 503) and time.monotonic() < deadline, err
                time.sleep(0.5)
        assert reply["output_ids"] == one_shot(h1 + b + [8], N)
        forked = tokens(c1, [*h1, 5])  # the fork's own history came back with its record
        assert turn(port, child, [9])["output_ids"] == one_shot([*forked, 9], N)
        for name in (sid, child):
            call(port, "/close_session", {"session_id": name})
        ledgers_clean(stack)
    finally:
        stack.stop()
