"""The fault campaign's load: client threads that each hold one session at a time through
the router and take greedy turns on it, recording every turn for the history checker
(history.py), and the probes that look for a second live copy of a session.

A turn refused cleanly (503: the replica is fenced, the session moving or rebuilding, no
replica ready) changed nothing and is tried again, but a session refused so for longer
than `stuck_seconds` is stuck (counted, and given up). A session ended `session_lost`
(410: its records could not be proven after a fault) is counted lost and given up. A
turn without an answer (connection lost, timeout) may or may not have run: its session is
abandoned (closed, best effort) and a new one opened, so the checker never has to guess a
history."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time

import redis

from custody.soak.history import Turn
from shared import streams
from shared.placement import Placement

INPUT, OUTPUT = 4, 4  # tokens in and out per turn
TURNS_PER_SESSION = (2, 6)
TIMEOUT = 30.0  # a client's patience for one answer (longer than any fault's window)


def post(port: int, path: str, body: dict, timeout: float = TIMEOUT) -> tuple[int, object]:
    """(status, JSON body), or (0, why) when no answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as err:
        return 0, repr(err)
    finally:
        conn.close()


def turn_body(sid: str, ids: list[int], max_new: int = OUTPUT) -> dict:
    return {
        "input_ids": ids,
        "session_params": {"id": sid},
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0},
    }


class SessionLoad:
    def __init__(self, port: int, workers: int, context_len: int, stuck_seconds: float) -> None:
        self.port, self.workers, self.context_len = port, workers, context_len
        self.stuck_seconds = stuck_seconds
        self.stuck: list[str] = []  # sessions refused 503 for longer than stuck_seconds
        self.lost: list[str] = []  # sessions ended `session_lost`
        self.turns: list[Turn] = []  # every turn and probe, in the order they ended
        self.held: dict[str, int] = {}  # session -> acknowledged tokens, while a client holds it
        self.lock = threading.Lock()
        self.abandoned = 0  # sessions given up after a turn without an answer
        self.unclosed: list[str] = []  # closes given up, with the last refusal's body
        self.stop = threading.Event()

    def record(self, turn: Turn) -> None:
        with self.lock:
            self.turns.append(turn)

    def worker(self, k: int) -> None:
        rng = random.Random(k)
        while not self.stop.is_set():
            status, sid = post(self.port, "/open_session", {})
            if status != 200 or not isinstance(sid, str):
                time.sleep(0.3)
                continue
            with self.lock:
                self.held[sid] = 0
            turns, outcome = rng.randint(*TURNS_PER_SESSION), "ok"
            refused_since: float | None = None
            while turns and not self.stop.is_set():
                outcome = self.one_turn(sid, [rng.randrange(1, 250) for _ in range(INPUT)])
                if outcome == "retry":
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since > self.stuck_seconds:
                        with self.lock:
                            self.stuck.append(sid)
                        outcome = "gone"
                        break
                    time.sleep(0.3)
                    continue
                refused_since = None
                if outcome == "lost":
                    with self.lock:
                        self.lost.append(sid)
                if outcome != "ok":
                    break
                turns -= 1
            with self.lock:
                self.held.pop(sid, None)
                self.abandoned += outcome == "gone"
            self.close(sid)

    def one_turn(self, sid: str, ids: list[int]) -> str:
        """ "ok", "retry" (refused cleanly), "lost" (410 `session_lost`), or "gone" (no
        answer, or another refusal)."""
        started = time.monotonic()
        status, body = post(self.port, "/generate", turn_body(sid, ids))
        turn = Turn(sid, ids, status, started, time.monotonic())
        if status == 200 and isinstance(body, dict):
            turn.output_ids = list(body["output_ids"])
            turn.prompt_tokens = body["meta_info"]["prompt_tokens"]
            with self.lock:
                self.held[sid] = turn.prompt_tokens + len(turn.output_ids)
        self.record(turn)
        if status == 200:
            return "ok"
        if status == 410:
            return "lost"
        return "retry" if status == 503 else "gone"

    def close(self, sid: str) -> None:
        """Close `sid`, waiting out clean refusals for a while; one still refused then
        is named in `unclosed` with why (what a leaked placement's cause is)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            status, body = post(self.port, "/close_session", {"session_id": sid})
            if status in (200, 404):
                return
            if time.monotonic() > deadline:
                with self.lock:
                    self.unclosed.append(f"{sid}: {status} {body}")
                return
            time.sleep(0.3)

    def probe(self, client: redis.Redis, replicas: dict[str, int]) -> None:
        """Ask every replica the directory does not give a held session to whether it
        serves that session: a turn whose history plus input would exceed the context,
        so a replica that serves the session refuses it 400 after finding it (nothing
        runs), one without it answers 404, one fenced 503. A 400 is a twin copy, unless
        the placement moved to that replica meanwhile (read again after)."""
        with self.lock:
            held = [sid for sid, tokens in self.held.items() if tokens]
        for sid in held:
            before = _placement(client, sid)
            if before is None:
                continue  # closed meanwhile
            for rid, port in replicas.items():
                if before.names(rid):
                    continue
                started = time.monotonic()
                status, _ = post(port, "/generate", turn_body(sid, [1] * (self.context_len - 1), 1))
                after = _placement(client, sid)
                if status == 400 and (after is None or after.names(rid)):
                    continue  # moved there (or closed) meanwhile: no verdict
                turn = Turn(sid, [], 200 if status == 400 else status, started, time.monotonic())
                turn.kind, turn.replica = "probe", rid
                self.record(turn)


def _placement(client: redis.Redis, sid: str) -> Placement | None:
    try:
        return Placement.decode(client.get(streams.placement_key(sid)))
    except (redis.RedisError, ValueError):
        return None
