"""Sessions as trees on the scheduling core: a turn that names an earlier turn, cuts,
drops output or replaces resumes from the deepest state the prefix cache kept on its
path (each turn's latest snapshot is kept when it finishes, `Endings.finish`), computes
only the rest, and answers what a one-shot generation of the same prompt answers.

What it can catch: a branch run from the wrong state or the wrong history (its tokens
then differ from the data model's reference, which hashes the whole context), a kept
boundary not kept (`cached_tokens` below the bound), a replaced branch still named, an
aborted branch that changed the tree, a leak or a lock left behind (the idle check).
What it cannot: HTTP, restarts of real processes (tests/test_branches_http.py)."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import SessionError
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver

PAGE, CHUNK, TRACK = 4, 32, 16


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def engine(**kw) -> Driver:
    return Driver(page_size=PAGE, chunk=CHUNK, track_interval=TRACK, **kw)


def branch(d: Driver, sid: str, tokens: list[int], max_new: int = 6, **options) -> tuple:
    """A turn of `sid` with `session_params` `options`, run to its end, and the prompt it
    was given."""
    req = d.turn(sid, tokens, max_new, session_params=options)
    d.run()
    report = d.engine.check()
    assert report.ok, report.problems
    return req, req.prompt.tolist()


def two_turns(d: Driver) -> tuple[str, object, object]:
    """A session that may branch, with two finished turns (12 tokens, then 5)."""
    sid = d.engine.sessions.open().sid
    t1, _ = branch(d, sid, text(12, 1))
    t2, _ = branch(d, sid, text(5, 2))
    return sid, t1, t2


def closed(d: Driver, sid: str) -> None:
    d.engine.sessions.close(sid)
    d.assert_idle_clean()


def history(req) -> list[int]:
    return [*req.prompt.tolist(), *req.output]


def kept_bound(base: int) -> int:
    """The least a branch from `base` tokens resumes from: the turn that ended there kept
    its latest snapshot, taken every TRACK positions while it decoded."""
    return max(0, base - base % PAGE - TRACK)


def test_a_turn_naming_an_earlier_turn_resumes_from_its_kept_boundary():
    d = engine()
    sid = d.engine.sessions.open().sid
    t1, _ = branch(d, sid, text(30, 1), max_new=10)
    t2, _ = branch(d, sid, text(7, 2), max_new=10)
    h1, h2 = history(t1), history(t2)
    t3, prompt = branch(d, sid, text(5, 3), rid=t1.rid)
    assert prompt == h1 + text(5, 3)
    assert t3.output == reference(prompt, 6, VOCAB)
    # t1 decoded from 30 to 40 and kept its snapshot at 32; t2's states lie past 40
    assert t3.cached_tokens == 32
    t4, prompt = branch(d, sid, text(4, 4), rid=t2.rid, drop_previous_output=True)
    assert prompt == t2.prompt.tolist() + text(4, 4)
    assert t4.output == reference(prompt, 6, VOCAB)
    assert t4.cached_tokens >= kept_bound(len(t2.prompt))
    t5, prompt = branch(d, sid, text(3, 5), rid=t2.rid, offset=21)
    assert prompt == h2[:21] + text(3, 5)
    assert t5.output == reference(prompt, 6, VOCAB)
    t6, prompt = branch(d, sid, text(3, 6), rid=t2.rid, offset=-3)
    assert prompt == h2[:-3] + text(3, 6) and t6.output == reference(prompt, 6, VOCAB)
    # without rid a turn continues the latest, from the session's own state
    t7, prompt = branch(d, sid, text(2, 7))
    assert prompt == history(t6) + text(2, 7)
    assert t7.cached_tokens == len(history(t6)) - 1
    assert t7.output == reference(prompt, 6, VOCAB)
    closed(d, sid)


def test_replace_forgets_the_named_turn_s_other_branches():
    d = engine()
    sid, t1, t2 = two_turns(d)
    t3, _ = branch(d, sid, text(5, 3), rid=t1.rid)
    t4, prompt = branch(d, sid, text(5, 4), rid=t1.rid, replace=True)
    assert prompt == history(t1) + text(5, 4) and t4.output == reference(prompt, 6, VOCAB)
    for gone in (t2, t3):
        with pytest.raises(InvalidRequest, match="names no turn"):
            d.turn(sid, [1], session_params={"rid": gone.rid})
    _, prompt = branch(d, sid, text(2, 5), rid=t1.rid)  # t1 itself stays
    assert prompt == history(t1) + text(2, 5)
    closed(d, sid)


def test_an_aborted_branch_changes_nothing():
    d = engine()
    sid, t1, t2 = two_turns(d)
    session = d.engine.sessions.get(sid)
    before = (session.history.copy(), session.last_rid, len(session.turns.nodes))
    req = d.turn(sid, text(3, 3), 20, session_params={"rid": t1.rid, "replace": True})
    for _ in range(4):
        d.step()
    d.engine.abort(req.rid, "client disconnected")
    d.run()
    assert np.array_equal(session.history, before[0])
    assert (session.last_rid, len(session.turns.nodes)) == before[1:]
    t3, prompt = branch(d, sid, text(2, 4))  # still continues t2, recomputed from the cache
    assert prompt == history(t2) + text(2, 4) and t3.output == reference(prompt, 6, VOCAB)
    assert t3.cached_tokens >= kept_bound(len(history(t2)))
    closed(d, sid)


def test_a_streaming_session_never_branches_and_keeps_nothing_in_the_cache():
    d = engine()
    sid = d.engine.sessions.open(streaming=True).sid
    t1, _ = branch(d, sid, text(12, 1))
    branch(d, sid, text(5, 2))
    with pytest.raises(SessionError, match=r"session_params\.rid"):
        d.turn(sid, [1], session_params={"rid": t1.rid})
    assert not any(n.mamba for n in d.engine.cache.nodes() if n.end > 16)
    closed(d, sid)


def test_the_tree_survives_a_restart_and_branches_resume_there():
    d = engine()
    sid = d.engine.sessions.open().sid
    t1, _ = branch(d, sid, text(20, 1), max_new=8)
    branch(d, sid, text(5, 2))
    records = d.engine.sessions.records.all_records()
    again = engine()
    again.model = d.model  # the same executor: device contents survive
    again.model.sequence_of = again._sequence
    again.engine.sessions.rebuild(records, state_valid=True)
    t3, prompt = branch(again, sid, text(4, 3), rid=t1.rid)
    assert prompt == history(t1) + text(4, 3)
    assert t3.output == reference(prompt, 6, VOCAB)
    again.engine.sessions.close(sid)
    again.assert_idle_clean()
