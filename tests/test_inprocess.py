"""Scheduler core and the real executor together, in one process: a session's turns
give exactly the tokens of one-shot greedy generations over the whole history (S11 with
real tensors), an aborted turn keeps the cache (S4), and the ledger is clean at idle.
Scenario ids are those of docs/scenarios.md."""

import numpy as np

from custody.inprocess import InProcess
from services.scheduler.records.request import Request, Status
from services.scheduler.records.sampling import SamplingParams
from shared.config import Settings

SMALL = Settings(
    compile=False,
    page_size=4,
    kv_pages=256,
    mamba_slots=16,
    max_running_requests=4,
    context_len=1024,
    chunk_size=32,
    max_step_tokens=64,
    track_interval=8,
)


def one_shot(prompt: list[int], n: int) -> list[int]:
    local = InProcess(SMALL)
    req = local.engine.submit(Request("one", np.asarray(prompt), SamplingParams(max_new_tokens=n)))
    local.run_until_idle()
    return req.output


def turn(local: InProcess, sid: str, text: str, n: int, rid: str) -> Request:
    session = local.engine.sessions.get(sid)
    tokens = np.asarray(local.tokenizer.encode(text, not session.history.size))
    return local.engine.submit_turn(session, tokens, rid, SamplingParams(max_new_tokens=n))


def test_session_turns_equal_one_shot_generation_over_the_history():
    local = InProcess(SMALL)
    sid = local.engine.sessions.open("chat").sid
    history: list[int] = []
    for k, text in enumerate(["Hello there, model.", " Tell me more.", " And once more!"]):
        t = turn(local, sid, text, 7, f"t{k}")
        local.run_until_idle()
        prompt = history + local.tokenizer.encode(text, not history)
        assert t.prompt.tolist() == prompt
        assert t.cached_tokens == (len(history) - 1 if history else 0)
        assert t.output == one_shot(prompt, 7)
        history = prompt + t.output
    local.engine.sessions.close(sid)
    local.run_until_idle()
    assert local.engine.check(idle=True).ok


def test_an_aborted_turn_keeps_the_cache_with_real_state():
    local = InProcess(SMALL)
    sid = local.engine.sessions.open("s").sid
    first = turn(local, sid, "The first turn of the session.", 6, "a")
    local.run_until_idle()
    aborted = turn(local, sid, " This one is cut short.", 40, "b")
    for _ in range(4):
        local.step()
    local.engine.abort("b", "client disconnected")
    assert aborted.status is Status.ABORTED
    third = turn(local, sid, " Third.", 6, "c")
    local.run_until_idle()
    history = first.prompt.tolist() + first.output
    assert third.cached_tokens >= len(history) - 1
    assert third.output == one_shot(history + local.tokenizer.encode(" Third.", False), 6)
    local.engine.sessions.close(sid)
    local.run_until_idle()
    assert local.engine.check(idle=True).ok
