"""The branching workload of `custody bench sessions`: agents that retry their last step
one time in four and fork two sub-agents from their third turn, run twice on one stack,
each request's reuse compared with what the workload alone says it could reuse.

With branching, a retry names the turn before the step it retries (`session_params.rid`,
`replace`) and a sub-agent is a `/fork_session` of turn 3. Without it (a client of a
server whose sessions cannot branch, as custody's were), a retry or a sub-agent opens a
session of its own and sends the whole history as its first turn, on append-only
(`streaming`) sessions, which keep no boundaries in the prefix cache.

A request's reusable tokens are the longest prefix of its prompt equal to the start of
an earlier request's tokens (prompt and output) of the same agent, its sub-agents
included, page-aligned down and short of its last token (a match must leave one to
compute): counted from the workload alone, whatever the server did. `branch_reuse_share`
is the cached tokens the replies report over those reusable tokens, summed over the
branching requests (the retries and each sub-agent's first turn); the appends, which
resume from their session's own state either way, are reported apart."""

from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass, field

AGENTS, TURNS, SYSTEM, STEP, REPLY = 4, 7, 512, 64, 32
SUB_TURNS = 2
GREEDY = {"max_new_tokens": REPLY, "ignore_eos": True}


def _post(port: int, path: str, body: dict) -> object:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


@dataclass
class Tally:
    """Cached and reusable tokens of one kind of request."""

    cached: int = 0
    reusable: int = 0
    requests: int = 0

    def add(self, cached: int, reusable: int) -> None:
        self.cached, self.reusable, self.requests = (
            self.cached + cached,
            self.reusable + reusable,
            self.requests + 1,
        )

    @property
    def share(self) -> float:
        return self.cached / self.reusable if self.reusable else 1.0


@dataclass
class Agent:
    """One agent's conversation as the workload sees it: the tokens of each request it
    (or a sub-agent) sent, for the reusable count."""

    page_size: int
    seen: list[list[int]] = field(default_factory=list)

    def reusable(self, prompt: list[int]) -> int:
        best = 0
        for earlier in self.seen:
            n = 0
            for a, b in zip(prompt, earlier, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(prompt) - 1)
        return best - best % self.page_size


class Workload:
    def __init__(self, port: int, page_size: int, branching: bool) -> None:
        self.port, self.page_size, self.branching = port, page_size, branching
        self.branches, self.appends = Tally(), Tally()
        self.rng = random.Random(11)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(n)]

    def open(self) -> str:
        return str(_post(self.port, "/open_session", {"streaming": not self.branching}))

    def send(
        self, agent: Agent, sid: str, new: list[int], prompt: list[int], tally: Tally, **options
    ) -> tuple[str, list[int]]:
        """A turn of `new` tokens whose whole prompt is `prompt`: its id and output."""
        body = {
            "input_ids": new,
            "sampling_params": GREEDY,
            "session_params": {"id": sid, **options},
        }
        reply = _post(self.port, "/generate", body)
        meta = reply["meta_info"]
        if meta["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"a turn's prompt was {meta['prompt_tokens']}, not {len(prompt)}")
        tally.add(meta["cached_tokens"], agent.reusable(prompt))
        agent.seen.append(prompt + reply["output_ids"])
        return meta["id"], reply["output_ids"]

    def branch_session(self, sid: str, rid: str) -> tuple[str, bool]:
        """A session whose next turn continues `sid`'s tokens through turn `rid`: a fork,
        or (without branching) a new session, whose first turn sends them itself."""
        if self.branching:
            return str(_post(self.port, "/fork_session", {"session_id": sid, "rid": rid})), False
        return self.open(), True

    def run_agent(self) -> None:
        agent = Agent(self.page_size)
        sid = self.open()
        history = self.tokens(SYSTEM)
        first, ids = True, []  # each turn's id
        for turn in range(TURNS):
            new = self.tokens(STEP)
            sent = history + new if first else new
            rid, output = self.send(agent, sid, sent, history + new, self.appends)
            first = False
            ids.append(rid)
            retry = turn >= 1 and self.rng.random() < 0.25
            if retry:  # the same step again, from the turn before it
                if self.branching:
                    options = {"rid": ids[-2], "replace": True}
                    rid, output = self.send(
                        agent, sid, new, history + new, self.branches, **options
                    )
                else:
                    _post(self.port, "/close_session", {"session_id": sid})
                    sid = self.open()
                    rid, output = self.send(agent, sid, history + new, history + new, self.branches)
                ids[-1] = rid
            history = history + new + output
            if turn == 2:
                for _ in range(2):
                    self.run_sub_agent(agent, sid, ids[-1], history)
        _post(self.port, "/close_session", {"session_id": sid})

    def run_sub_agent(self, agent: Agent, parent: str, rid: str, base: list[int]) -> None:
        sid, whole = self.branch_session(parent, rid)
        history = base
        for k in range(SUB_TURNS):
            new = self.tokens(STEP)
            sent = history + new if whole and k == 0 else new
            tally = self.branches if k == 0 else self.appends
            _, output = self.send(agent, sid, sent, history + new, tally)
            history = history + new + output
        _post(self.port, "/close_session", {"session_id": sid})

    def run(self) -> dict:
        for _ in range(AGENTS):
            self.run_agent()
        return {
            "branch_reuse_share": round(self.branches.share, 4),
            "branch_requests": self.branches.requests,
            "branch_cached_tokens": self.branches.cached,
            "branch_reusable_tokens": self.branches.reusable,
            "append_reuse_share": round(self.appends.share, 4),
            "append_requests": self.appends.requests,
        }


def measure(port: int, page_size: int) -> dict:
    """The workload with branching, then without, the cache flushed between them (their
    sessions all closed first, so the flush empties it)."""
    on = Workload(port, page_size, branching=True).run()
    _post(port, "/flush_cache", {})
    off = Workload(port, page_size, branching=False).run()
    return {"on": on, "off": off}
