"""A stored Responses conversation behind the router with two replicas, through every
fault a session meets: its executor killed (its state lost), a drain that moves it to
the other replica, and that replica's scheduler killed and restarted. Each response
equals the stateless answer to the same conversation (`store: false` with the same
`previous_response_id`, greedy), every stored id stays retrievable and continuable, a
fork from an older response answers its own branch, and both ledgers end clean.

What it can catch: an id the router sends to the wrong replica (404), a response tree
lost by a move or a restart (404 on an older id), a turn resumed from the wrong state or
branch (an answer that differs from the stateless one), a leak or a twin (the ledgers).
What it cannot: cached-token depths across a restart or a move (a replica's prefix
cache starts empty there; tests/agent_apis/test_responses_http.py measures them on one stack)."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

import redis

from shared.redis_server import PrivateRedis
from shared.session_ids import response_session
from tests.services_harness import agent_settings, call, start_stack
from tests.test_migration import ledgers_clean
from tests.test_replicas import home

TURN = {"max_output_tokens": 6, "temperature": 0.0, "reasoning": {"effort": "none"}}


def respond(port: int, text: str, previous: str | None = None, store: bool = True) -> dict:
    """A response, retried while a restarted scheduler takes its sessions back (503) or
    the router's pooled connection to a killed one fails (502)."""
    body = TURN | {"input": text, "previous_response_id": previous, "store": store}
    deadline = time.monotonic() + 60
    while True:
        try:
            return call(port, "/v1/responses", body)
        except urllib.error.HTTPError as err:
            assert err.code in (502, 503) and time.monotonic() < deadline, err.read()
            time.sleep(0.5)


def text(response: dict) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def continued(port: int, previous: str, said: str) -> dict:
    """The stored response continuing `previous`, checked against the stateless one."""
    stored = respond(port, said, previous)
    assert stored["previous_response_id"] == previous
    assert text(stored) == text(respond(port, said, previous, store=False))
    return stored


def test_a_stored_conversation_lives_through_kills_a_drain_and_a_restart(
    agent_checkpoint: Path,
):
    with PrivateRedis(appendonly=False) as server:
        stack = start_stack(agent_settings(server.url, agent_checkpoint, replicas=2))
        try:
            port, client = stack.settings.port, redis.Redis.from_url(server.url)
            first = respond(port, "Plane eine Reise")
            sid = response_session(first["id"])  # keys off: the session's id is its name
            replica = home(client, sid)  # the router named and placed it
            second = continued(port, first["id"], "und dann?")
            stack.kill(f"executor-{replica}")  # its state is lost, its record is not
            stack.start(f"executor-{replica}")
            third = continued(port, second["id"], "weiter")
            call(port, "/admin/drain", {"replica": replica})
            other = "1" if replica == "0" else "0"
            assert home(client, sid) == other
            assert call(port, f"/v1/responses/{first['id']}")["id"] == first["id"]
            fourth = continued(port, third["id"], "noch etwas")
            stack.kill(f"scheduler-{other}")
            stack.start(f"scheduler-{other}")
            continued(port, fourth["id"], "und zuletzt")
            fork = continued(port, second["id"], "lieber ans Meer")  # a branch of turn 2
            assert fork["id"] != fourth["id"]
            items = call(port, f"/v1/responses/{fork['id']}/input_items")
            assert [i["content"][0]["text"] for i in items["data"]] == ["lieber ans Meer"]
            call(port, "/close_session", {"session_id": sid})
            ledgers_clean(stack)
        finally:
            stack.stop()
