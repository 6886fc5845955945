"""The clients whose every output is checked: greedy sessions with random turn lengths,
disconnects mid-stream, over-long inputs, closes, idle timeouts, and plain requests that
share a prefix, and sessions whose first turn starts with one of a few system prompts
(an agent fleet: those sessions borrow the prompt from the prefix cache, docs/ownership.md
"Shared prefixes"). Sessions branch too (docs/api.md, "Sessions"): a turn may name an
earlier turn of its session (`rid`, alone or with `drop_previous_output` or an `offset`),
and a lane may start as a `/fork_session` of another lane's turn; the client computes
the prompt each should run on. Each finished output is kept with that exact prompt for
the teacher-forced replay, which disowns an output run on any other history; a session
whose turn did not finish normally is abandoned (closed), so a replay never has to guess
a history."""

from __future__ import annotations

import contextlib
import http.client
import random
import threading
import time

from custody.soak.client import NO_ANSWER, Reply, Stream, call
from custody.soak.tally import OK, REFUSED, Tally

PREFIX = [(7 * j) % 250 + 1 for j in range(48)]
# system prompts sessions fork from: lengths off the chunk and page grids, so junctions form
SYSTEMS = [[(11 * j + s) % 250 + 1 for j in range(n)] for s, n in ((3, 61), (5, 98))]
CLOSE_PATIENCE = 30.0  # seconds a client keeps retrying a close whose answer was lost
CLOSED = frozenset({"200", "404"})  # a close of what already ended (expiry, a fault) is a 404


class Lane:
    """One session a worker takes turns on: its id, its latest history, and each
    finished turn's id, prompt and tokens (prompt and output), which a branch names."""

    def __init__(self) -> None:
        self.reset(None, [])

    def reset(self, sid: str | None, history: list[int]) -> None:
        self.sid, self.history = sid, history
        self.turns: list[tuple[str, list[int], list[int]]] = []


class Greedy:
    def __init__(
        self, port: int, context_len: int, tally: Tally, key: str | None, lanes: int = 1
    ) -> None:
        """`key`: tenant A's. Tenant B's abort_all may end B's own requests, so B, the
        hostile tenant, has none that must finish. `lanes`: sessions each worker keeps
        open and takes turns on at random, so open sessions outnumber the device."""
        self.port, self.context_len, self.tally, self.key = port, context_len, tally, key
        self.lanes = lanes
        self.finished: list[tuple[list[int], list[int]]] = []  # (prompt, output)
        self.opened: dict[str, str | None] = {}  # every session id handed out, by its key
        self.turns = 0
        self.lock = threading.Lock()

    def worker(self, k: int, deadline: float) -> None:
        rng = random.Random(k)
        key = self.key
        lanes = [Lane() for _ in range(self.lanes)]
        while time.monotonic() < deadline:
            if rng.random() < 0.25:
                self.plain(rng, key)
                continue
            lane = lanes[rng.randrange(self.lanes)]
            if lane.sid is None:
                parent = rng.choice(lanes)
                if parent.turns and rng.random() < 0.3:
                    lane.reset(*self.fork(rng, parent, key))
                else:
                    lane.reset(self.open(rng, key), [])
                continue
            if lane.turns and rng.random() < 0.15:
                history = self.branch(rng, lane, key)
            else:
                history = self.turn(rng, lane, lane.history, {}, key)
            if history is None or len(history) > 700 or rng.random() < 0.1:
                lane.reset(self.close(lane.sid, key), [])
            else:
                lane.history = history
        for lane in lanes:
            self.close(lane.sid, key)

    def branch(self, rng: random.Random, lane: Lane, key: str | None) -> list[int] | None:
        """A turn naming an earlier turn of the lane's session: after its output, after
        its prompt alone, or cut at a random offset of that."""
        rid, prompt, tokens = rng.choice(lane.turns)
        roll = rng.random()
        if roll < 0.4:
            options, base = {"rid": rid}, tokens
        elif roll < 0.7:
            options, base = {"rid": rid, "drop_previous_output": True}, prompt
        else:
            cut = rng.randint(1, len(tokens))
            options, base = {"rid": rid, "offset": cut}, tokens[:cut]
        self.tally.note("branch_turn")
        return self.turn(rng, lane, base, options, key)

    def fork(self, rng: random.Random, parent: Lane, key: str | None) -> tuple[str | None, list]:
        """A new session forked from a turn of `parent`'s: its id and its history (None
        and nothing when the fork did not answer 200: it may have opened, and close_all
        closes every id handed out)."""
        rid, _, tokens = rng.choice(parent.turns)
        name = f"fork-{rng.getrandbits(64):016x}"
        with self.lock:
            self.opened[name] = key
        body = {"session_id": parent.sid, "rid": rid, "new_session_id": name}
        reply = self.call("/fork_session", body, key)
        self.tally.judge("fork_session", reply, OK)
        if reply.status != 200 or reply.body != name:
            return None, []
        self.tally.note("fork")
        return name, list(tokens)

    def turn(
        self, rng: random.Random, lane: Lane, history: list[int], options: dict, key: str | None
    ) -> list[int] | None:
        """One turn of the lane's session continuing `history` (its session_params
        `options` say where that is in its tree): the history after it, or None when the
        session's history is now uncertain (an abort, a disconnect) and it must be
        abandoned."""
        new = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        if not history and rng.random() < 0.5:
            new = [*rng.choice(SYSTEMS), *new]
            self.tally.note("shared_prefix_first_turn")
        n = rng.randint(1, 24)
        body = {
            "input_ids": new,
            "session_params": {"id": lane.sid, **options},
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True},
        }
        roll = rng.random()
        if roll < 0.05:  # over-long whatever `new` is: a clean 400 that changes nothing
            body["input_ids"] = new * (self.context_len // len(new) + 1)
            self.tally.judge("over_long", self.call("/generate", body, key), REFUSED)
            return lane.history  # the session's, not the branch's it did not take
        if roll < 0.15:
            self.disconnect_midway(body, key)
            return None
        reply = self.call("/generate", body, key)
        self.tally.judge("turn", reply, OK)
        output = self.record(history + new, reply)
        if reply.status != 200 or reply.aborted:
            return None
        with self.lock:
            self.turns += 1
        lane.turns.append((reply.body["meta_info"]["id"], history + new, history + new + output))
        return history + new + output

    def plain(self, rng: random.Random, key: str | None) -> None:
        n = rng.randint(1, 12)
        prompt = [*PREFIX, *(rng.randrange(256) for _ in range(rng.randint(1, 8)))]
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}
        reply = self.call("/generate", body, key)
        self.tally.judge("plain", reply, OK)
        self.record(prompt, reply)

    def open(self, rng: random.Random, key: str | None) -> str | None:
        timeout = 1.0 if rng.random() < 0.1 else None  # some expire while idle
        reply = self.call("/open_session", {"timeout": timeout} if timeout else {}, key)
        self.tally.judge("open_session", reply, OK)
        if reply.status != 200 or not isinstance(reply.body, str):
            return None
        with self.lock:
            self.opened[reply.body] = key
        return None if timeout else reply.body

    def close(self, sid: str | None, key: str | None) -> None:
        """Close `sid`, retrying for a while a close whose answer was lost (a restart) or
        refused for now (503), as a real client would: abandoned, the session would hold
        its slot until its idle timeout."""
        if sid is None:
            return None
        deadline = time.monotonic() + CLOSE_PATIENCE
        while True:
            reply = self.call("/close_session", {"session_id": sid}, key)
            lost = reply.outcome == NO_ANSWER or reply.status == 503
            if not lost or time.monotonic() > deadline:
                break
            self.tally.note("close_retried")
            time.sleep(0.2)
        self.tally.judge("close_session", reply, CLOSED)
        return None

    def close_all(self) -> None:
        """Close every session ever opened: a close lost to a fault is retried here."""
        for sid, key in sorted(self.opened.items()):
            self.close(sid, key)

    def record(self, prompt: list[int], reply: Reply) -> list[int]:
        """Keep a 200's output (an aborted one too: what it produced is still greedy)."""
        output = reply.body.get("output_ids", []) if reply.status == 200 and reply.is_dict else []
        if output:
            with self.lock:
                self.finished.append((list(prompt), list(output)))
        return output

    def call(self, path: str, body: dict, key: str | None) -> Reply:
        reply = call(self.port, path, body, key)
        if reply.outcome == NO_ANSWER:
            time.sleep(0.3)  # the scheduler is restarting: do not spin
        return reply

    def disconnect_midway(self, body: dict, key: str | None) -> None:
        stream = Stream(self.port, body, key, timeout=60)
        with contextlib.suppress(OSError, http.client.HTTPException):
            next(stream.events(), None)
        stream.conn.close()
        self.tally.note("client_disconnect")
