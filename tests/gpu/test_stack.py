"""The three services with the executor on CUDA (`--device cuda --compile false`, float32
so outputs can be compared token for token), as `custody up` runs them: three sessions
take three turns each, concurrently; after the first turn one session's state is moved
to the host tier and one to disk (and come back for their next turn); after the second,
one is moved to disk and the executor is killed and restarted by the supervisor. Every
turn's output equals a one-shot generation of the whole history on the same stack
(sharing no cached prefix); the cached prefix says no turn recomputed its history, but
the third turns of the sessions whose state the restart lost (device state dies with
the executor's process; a disk blob does not); and the ledgers end clean.

What it cannot catch: a fault of the CUDA graphs (this runs eagerly; the compiled decode
step has its own device test) or of the pinned host copies under load (three sessions
move one state at a time)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from tests.services_harness import assert_clean, call, health, stack_settings, start_stack
from tests.test_dtype_stack import OUT, generate

pytestmark = pytest.mark.stack

SESSIONS, TURNS = 3, 3
SALTS = itertools.count()


def one_shot(port: int, tokens: list[int]) -> list[int]:
    """A plain generation of `tokens` that shares no cached prefix with anything (a salt
    of its own), so its state is computed from the first token."""
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": OUT, "ignore_eos": True},
        "cache_salt": f"one-shot-{next(SALTS)}",
    }
    return call(port, "/generate", body)["output_ids"]


def restart_executor(stack) -> None:
    """SIGKILL the executor and supervise until the replica serves with a new one."""
    before = health(stack.settings.port)["executor"]
    stack.kill("executor")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stack.supervise_once()
        now = health(stack.settings.port)
        if now.get("status") == "ok" and now.get("executor") != before:
            return
        time.sleep(0.2)
    raise AssertionError("the executor did not come back within 60 s")


def test_sessions_across_tiers_and_an_executor_restart_equal_one_shot(redis_url, redis_client):
    stack = start_stack(stack_settings(redis_url, device="cuda", dtype="float32", compile=False))
    try:
        port = stack.settings.port
        sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
        histories: dict[str, list[int]] = {sid: [] for sid in sids}
        for k in range(TURNS):
            replies: dict[str, dict] = {}
            texts = {
                sid: [(11 * k + 17 * i + j) % 250 + 3 for j in range(5 + k)]
                for i, sid in enumerate(sids)
            }

            def turn(sid: str, replies: dict = replies, texts: dict = texts) -> None:
                replies[sid] = generate(port, texts[sid], sid)

            threads = [threading.Thread(target=turn, args=(sid,)) for sid in sids]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for sid in sids:
                prompt = histories[sid] + texts[sid]
                reply = replies[sid]
                assert reply["output_ids"] == one_shot(port, prompt), (sid, k)
                cached = reply["meta_info"]["cached_tokens"]
                if k < 2 or sid == sids[0]:  # the restart lost the others' device state
                    assert cached >= len(histories[sid]) - stack.settings.page_size, (sid, k)
                histories[sid] = prompt + reply["output_ids"]
            if k == 0:
                for sid, tier in zip(sids, ("host", "disk"), strict=False):
                    assert (
                        call(port, "/place_session", {"session_id": sid, "tier": tier})["tier"]
                        == tier
                    )
            if k == 1:  # a disk blob outlives the executor; device and host state do not
                placed = call(port, "/place_session", {"session_id": sids[0], "tier": "disk"})
                assert placed["tier"] == "disk"
                restart_executor(stack)
        for sid in sids:
            call(port, "/close_session", {"session_id": sid})
        assert_clean(stack)
    finally:
        stack.stop()
