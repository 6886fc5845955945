"""A header session whose conversation branches (an agent that edits its last message or
retries a step), on the NemotronH template that renders a reply otherwise once a message
follows it (its reasoning is emptied), behind the router with two replicas: each branch
answers what the same request without the header answers, and resumes from the kept
boundary of the prefix it shares with the turns before (docs/ownership.md, "Kept
boundaries"), not from the first turn's states; then the same after its state went to
disk, after its executor was killed, after a drain moved it to the other replica and
after that replica's scheduler restarted, with both ledgers clean.

What it can catch: a branch run from the wrong state (its answer differs from the
stateless one), a turn's kept boundary not kept (`cached_tokens` no deeper than the
first turn's prompt), a session that a fault lost or twinned (a 4xx/5xx, or the store's
ledger), a leak. What it cannot: kept boundaries across a restart or a move (the prefix
cache is a replica's and starts empty, so only the answers are checked there)."""

from __future__ import annotations

import time
import urllib.error
from pathlib import Path

import redis

from shared.redis_server import PrivateRedis
from tests.services_harness import POOLS, agent_settings, call, start_stack
from tests.test_migration import ledgers_clean
from tests.test_replicas import home

PAGE = POOLS["page_size"]
HEADER = {"X-Session-ID": "agent-tree"}
SID = "agent-tree"  # keys off: the session's id is its name


def ask(port: int, messages: list[dict], headers: dict[str, str]) -> dict:
    """A greedy chat turn that reasons (the template's default) for a few tokens, then
    answers."""
    body = {"messages": messages, "max_tokens": 10, "temperature": 0.0, "thinking_budget": 4}
    return call(port, "/v1/chat/completions", body, headers=headers)


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def parted(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def answered(port: int, messages: list[dict]) -> dict:
    """The header turn of `messages`, checked against the stateless answer; retried while
    a restarted scheduler takes its sessions back (503) or the router's pooled connection
    to a killed one fails (502)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            bound = ask(port, messages, HEADER)
            break
        except urllib.error.HTTPError as err:
            assert err.code in (502, 503) and time.monotonic() < deadline, err.read()
            time.sleep(0.5)
    assert bound["choices"][0]["message"] == ask(port, messages, {})["choices"][0]["message"]
    return bound


def then(messages: list[dict], reply: dict, follow: str) -> list[dict]:
    message = reply["choices"][0]["message"]
    said = {"role": "assistant", "content": message["content"]}
    if message.get("reasoning_content"):
        said["reasoning_content"] = message["reasoning_content"]
    return [*messages, said, {"role": "user", "content": follow}]


def test_a_branching_header_session_resumes_from_its_kept_boundaries_through_faults(
    agent_checkpoint: Path,
):
    with PrivateRedis(appendonly=False) as server:
        stack = start_stack(agent_settings(server.url, agent_checkpoint, replicas=2))
        try:
            port, client = stack.settings.port, redis.Redis.from_url(server.url)
            messages = [{"role": "user", "content": "Plane eine Reise"}]
            prompts = []
            for step in range(3):
                reply = answered(port, messages)
                prompts.append(call(port, "/tokenize", {"messages": messages})["tokens"])
                if step < 2:
                    messages = then(messages, reply, f"und dann {step}")
            # the agent edits its last message: the branch shares turn 2's kept boundary
            edited = [*messages[:-1], {"role": "user", "content": "lieber ans Meer"}]
            branch = answered(port, edited)
            mine = call(port, "/tokenize", {"messages": edited})["tokens"]
            shared = parted(prompts[1], mine)
            assert cached(branch) > len(prompts[0]), (cached(branch), len(prompts[0]))
            assert cached(branch) >= shared - shared % PAGE - PAGE, (cached(branch), shared)
            # its state on disk: the next branch still resumes from the cache
            assert (
                call(port, "/place_session", {"session_id": SID, "tier": "disk"})["tier"] == "disk"
            )
            retried = answered(port, messages)  # a retry of the step before the edit
            assert cached(retried) >= shared - shared % PAGE - PAGE
            replica = home(client, SID)
            stack.kill(f"executor-{replica}")  # the device and host tiers are lost
            stack.start(f"executor-{replica}")
            answered(port, then(messages, retried, "weiter"))
            call(port, "/admin/drain", {"replica": replica})
            other = "1" if replica == "0" else "0"
            assert home(client, SID) == other
            answered(port, edited)  # moved with its conversation, branched there
            stack.kill(f"scheduler-{other}")
            stack.start(f"scheduler-{other}")
            answered(port, then(edited, branch, "noch etwas"))
            call(port, "/close_session", {"session_id": SID})
            ledgers_clean(stack)
        finally:
            stack.stop()
