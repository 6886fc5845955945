"""Prefix state where prefixes diverge (docs/ownership.md, "Shared prefixes"): requests
and sessions that share a prefix, each with its own suffix, reuse the shared part less at
most one page from the third on, whatever the suffix length or the prefix's alignment to
chunks, with outputs equal to a one-shot run; a session's first turn leaves its prompt
in the cache for the next; periodic checkpoints cache a state every N positions; and a
restarted scheduler takes shared prefixes back as cache paths its sessions borrow.

Each run ends with the engine's integrity check (Driver), which includes the borrow rule
(cache/borrowers.py); what these tests cannot see is the real model's numerics (the data
model's next token is a function of the whole history, so a wrong state or a wrong page
changes the output, which is what they compare)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from services.scheduler.sessions.records import conflicting_claims
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver

PAGE, CHUNK = 4, 32


def text(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, VOCAB, size=n).tolist()


def engine(**kw) -> Driver:
    return Driver(page_size=PAGE, chunk=CHUNK, **kw)


def aligned(n: int) -> int:
    return n - n % PAGE


@pytest.mark.parametrize("shared", [CHUNK * 2, 50, 93])
def test_requests_sharing_a_prefix_reuse_it_whatever_their_suffix(shared):
    """SGLang #22935's table, small: a shared prefix and suffixes of several lengths; the
    state existed only at chunk ends before, so a prefix off a chunk boundary was reused
    only up to the last chunk end inside it."""
    d = engine()
    prefix = text(shared, 1)
    reqs = []
    for i, suffix in enumerate([7, 19, 45, 70, 3, 30]):
        prompt = prefix + text(suffix, 100 + i)
        req = d.generate(prompt, max_new=4)
        d.run()
        assert req.output == reference(prompt, 4, VOCAB)
        reqs.append(req)
    for req in reqs[2:]:  # the shared part less at most one page
        assert req.cached_tokens >= aligned(shared)
    on_a_chunk_end = shared % CHUNK == 0  # the state was there already
    assert (d.engine.endings.checkpoints["junction"] == 0) == on_a_chunk_end
    d.assert_idle_clean()


def test_without_junctions_a_prefix_is_reused_to_the_last_chunk_end_inside_it():
    """What `--junction-checkpoints false` keeps (the field's behaviour, for comparison):
    the state only at chunk ends, so a 50-token shared prefix serves 32."""
    d = engine(junctions=False)
    prefix = text(50, 1)
    reqs = []
    for i in range(4):
        reqs.append(d.generate(prefix + text(9, 100 + i), max_new=2))
        d.run()
    assert [r.cached_tokens for r in reqs[2:]] == [CHUNK, CHUNK]
    assert d.engine.admission.state_gap_tokens >= 2 * (48 - CHUNK)  # counted, and lost
    d.assert_idle_clean()


def test_a_prefix_whose_length_wobbles_is_reused_from_the_third_request():
    """SGLang #37198: the shared part wobbles by a few tokens around a page boundary."""
    d = engine()
    base = text(60, 2)
    reqs = []
    for i, length in enumerate([58, 61, 59, 62, 57, 60]):
        prompt = base[:length] + text(12, 200 + i)
        req = d.generate(prompt, max_new=3)
        d.run()
        assert req.output == reference(prompt, 3, VOCAB)
        reqs.append(req)
    for req in reqs[2:]:
        assert req.cached_tokens >= aligned(57) - PAGE
    d.assert_idle_clean()


def test_sessions_opened_on_one_system_prompt_share_it():
    """An agent fleet: eight sessions open on one system prompt, each with its own first
    message. A session's first turn now leaves its prompt in the cache (it kept all of it
    before, so every session recomputed the system prompt), and keeps its own state."""
    d = engine()
    system = text(90, 3)
    turns = []
    for i in range(8):
        sid = d.engine.sessions.open().sid
        first = system + text(11 + i, 300 + i)
        turn = d.run_turn(sid, first, max_new=4)
        assert turn.output == reference(first, 4, VOCAB)
        turns.append((sid, first + turn.output))
    for sid, _ in turns[2:]:
        session = d.engine.sessions.get(sid)
        assert session.slots.borrowed >= aligned(len(system))
    for sid, history in turns:  # each session's own state is its own
        more = text(5, 999)
        again = d.run_turn(sid, more, max_new=3)
        assert again.output == reference(history + more, 3, VOCAB)
        assert again.cached_tokens >= len(history) - 1
    for sid, _ in turns:
        d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_a_first_turn_that_ends_at_its_first_token_still_shares_its_prompt():
    """A first turn of one token ends on the row of its last prefill chunk; that chunk's
    state goes to the cache too (the session keeps its own), so the third session on
    the system prompt reuses it from admission on, less at most one page."""
    d = engine()
    system = text(50, 6)  # the last chunk (32..) holds the end of the system prompt
    cached = []
    for i in range(4):
        sid = d.engine.sessions.open().sid
        first = system + text(9 + i, 400 + i)
        turn = d.run_turn(sid, first, max_new=1)
        assert turn.output == reference(first, 1, VOCAB)
        cached.append(turn.cached_tokens)
    assert cached[0] == 0 and all(c >= aligned(len(system)) for c in cached[2:])
    for sid in list(d.engine.sessions.sessions):
        d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_periodic_checkpoints_cache_a_state_every_interval():
    d = engine(checkpoint_interval=8)
    long = text(70, 4)
    d.generate(long, max_new=2)
    d.run()
    ends = sorted(n.end for n in d.engine.cache.nodes() if n.mamba)
    assert {8, 16, 24, 40, 48, 56} <= set(ends)  # besides the chunk end (32) and the last
    other = long[:21] + text(30, 5)
    req = d.generate(other, max_new=2)
    d.run()
    assert req.cached_tokens == 16 and req.output == reference(other, 2, VOCAB)
    assert d.engine.endings.checkpoints["interval"] >= 6
    d.assert_idle_clean()


def test_a_restart_gives_shared_prefixes_back_to_the_cache_for_their_sessions():
    """Records name the pages a session borrows from the cache (`shared_pages`); a
    restarted scheduler, whose cache starts empty, adopts them as one path both sessions
    borrow again, takes back each session's own pages, and the next turns resume from
    the device state."""
    d = engine()
    system = text(40, 6)
    histories = {}
    for i in range(3):
        sid = d.engine.sessions.open().sid
        prompt = system + text(9, 600 + i)
        histories[sid] = prompt + d.run_turn(sid, prompt, max_new=3).output
    records = d.engine.sessions.records.all_records()
    assert sum(r.shared_pages > 0 for r in records) >= 2
    again = Driver(page_size=PAGE, chunk=CHUNK)
    again.model = d.model  # the same executor: device contents survive
    again.model.sequence_of = again._sequence
    again.engine.sessions.rebuild(records, state_valid=True)
    sessions = again.engine.sessions
    assert sessions.conflicting_records == 0
    assert all(s.slots is not None for s in sessions.sessions.values())
    report = again.engine.check()
    assert report.ok, report.problems
    for sid, history in histories.items():
        more = text(4, 700)
        turn = again.run_turn(sid, more, max_new=3)
        assert turn.output == reference(history + more, 3, VOCAB)
        assert turn.cached_tokens == len(history) - 1
    for sid in histories:
        sessions.close(sid)
    again.assert_idle_clean()
    nodes = list(again.engine.cache.nodes())
    assert all(n.kv_lock == 0 for n in nodes)  # the adopted path went with its locks
    assert all(n.mamba or n.children for n in nodes)  # a tombstone stays above kept states


def test_the_borrow_rule_sees_a_stray_lock_and_a_borrower_without_one():
    """The integrity check's borrow rule can fail: a lock no holder accounts for, and a
    session that borrows cached pages with no lock on their path, are both named."""
    d = engine()
    system = text(40, 8)
    sids = [d.engine.sessions.open().sid for _ in range(2)]
    for i, sid in enumerate(sids):
        d.run_turn(sid, system + text(6, 800 + i), max_new=2)
    session = d.engine.sessions.get(sids[1])
    node = session.cache_node
    assert node is not None and session.slots.borrowed == node.end
    d.engine.cache.lock(node)
    assert any("borrowers through it" in p for p in d.engine.check().problems)
    d.engine.cache.unlock(node)
    session.cache_node = None
    assert any("with no cache node" in p for p in d.engine.check().problems)
    session.cache_node = node
    assert d.engine.check().ok
    for sid in sids:
        d.engine.sessions.close(sid)
    d.assert_idle_clean()


def test_a_record_that_does_not_add_up_costs_its_session_the_state_not_the_start():
    """Records the store kept wrongly (pages past the pool, a page named twice, more
    shared pages than the history covers) are each taken back from history only; the
    rest start as usual. A shared page one record names differently from the others
    costs every session sharing it the state: which record is right cannot be known."""
    d = engine()
    system = text(40, 9)
    sids = [d.engine.sessions.open().sid for _ in range(6)]
    histories = {}
    for i, sid in enumerate(sids):
        prompt = system + text(6, 900 + i)
        histories[sid] = prompt + d.run_turn(sid, prompt, max_new=2).output
    records = {r.sid: r for r in d.engine.sessions.records.all_records()}
    assert all(records[s].shared_pages for s in sids[2:])
    bad = msgspec.structs.replace
    a, b, c, e, kept, kept2 = sids
    pages = records[a].kv_pages().copy()
    pages[-1] = 10**6
    records[a] = bad(records[a], pages=pages)
    pages = records[b].kv_pages().copy()
    pages[-1] = pages[-2]
    records[b] = bad(records[b], pages=pages)
    records[c] = bad(records[c], history=records[c].tokens()[:4], cached_len=4)
    pages = records[e].kv_pages().copy()
    pages[0] = 1000
    other = bad(records[e], pages=pages)
    doubtful = conflicting_claims([*records.values(), other], True, PAGE)
    assert doubtful >= {e, kept, kept2}  # and every other session of that prefix
    again = Driver(page_size=PAGE, chunk=CHUNK)
    again.model = d.model
    again.model.sequence_of = again._sequence
    again.engine.sessions.rebuild(list(records.values()), state_valid=True)
    sessions = again.engine.sessions
    assert [sessions.sessions[s].slots is None for s in sids] == [True] * 3 + [False] * 3
    assert again.engine.check().ok
    for sid in (e, kept, kept2):
        more = text(3, 990)
        turn = again.run_turn(sid, more, max_new=2)
        assert turn.output == reference(histories[sid] + more, 2, VOCAB)
    for sid in sids:
        sessions.close(sid)
    again.assert_idle_clean()
