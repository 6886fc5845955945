"""A chat turn whose reply the template renders otherwise once a message follows it
(NemotronH's reasoning): the session keeps the turn's state at the reply's start
(docs/chat.md), whatever else holds the pools when the turn ends."""

import numpy as np

from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.records.session import Session
from shared.messages.ownership import ChatEntry
from tests.engine.data_model import reference
from tests.engine.driver import VOCAB, Driver
from tests.engine.test_sessions import close_all, text


def truncating_turn(prompt: list[int], reply_start: int, base: int = 0, seen: int = 0) -> ChatTurn:
    """A chat turn whose canonical history keeps the prompt up to `reply_start` and
    renders the rest (the generation prompt's opened reasoning, say) otherwise."""

    def reply(req: Request) -> tuple[ChatEntry, np.ndarray, bool]:
        canonical = np.asarray([*prompt[:reply_start], 7, 7, *req.output], dtype=np.int64)
        return ChatEntry("reply", len(canonical)), canonical, False

    return ChatTurn(base, seen, (), reply, reply_start)


def run_chat_turn(d: Driver, session: Session, new: list[int], chat: ChatTurn) -> None:
    """`new` as a chat turn of `session`, three tokens out, run to its end."""
    params = SamplingParams(max_new_tokens=3)
    d.engine.submit_turn(session, np.asarray(new), d.rid(), params, chat=chat)
    d.run()


def two_reply_start_turns(d: Driver, session: Session) -> list[int]:
    """A first chat turn keeping its reply start at 13, then a second at 30 (inside the
    page from 28); returns the second turn's prompt."""
    first = text(18, 1)
    run_chat_turn(d, session, first, truncating_turn(first, 13))
    assert session.cached_len == 13
    prompt = [*session.history[:13].tolist(), *text(20, 2)]
    later = truncating_turn(prompt, 30, base=13, seen=len(session.history))
    run_chat_turn(d, session, text(20, 2), later)
    return prompt


def test_the_reply_start_is_kept_when_the_cache_holds_every_free_state():
    """The session takes the turn's snapshot at its reply start, and the track refills
    the slot it gives. With the cache holding every free Mamba slot (the turn's admission
    and its chunk's donation to the cache each evict just enough), the cache gives way
    again, as for a donation to it, rather than the session losing that state (a loaded
    CI run once saw it lost: the next turn re-prefilled from the cache's page)."""
    d = Driver(page_size=4, mamba_slots=12, chunk=8)
    for seed in range(20):  # distinct prompts: their states fill the pool
        d.generate(text(16, 100 + seed), max_new=2)
        d.run()
    assert d.pools.mamba.free_count == 4  # what the turn takes: then the cache holds the rest
    sid = d.engine.sessions.open().sid
    session = d.engine.sessions.get(sid)
    prompt = text(18, 1)
    run_chat_turn(d, session, prompt, truncating_turn(prompt, 13))
    assert d.engine.sessions.reply_starts == 1
    assert session.cached_len == 13 and session.history[:13].tolist() == prompt[:13]
    close_all(d)


def test_the_chunk_ending_at_a_reply_start_waits_for_a_track_slot():
    """A later turn's chunks keep their snapshots (none goes to the cache: the turn
    began from its session's state), so pipelined, both track entries can be busy when
    the chunk ending at the reply start is planned: the latest snapshot, and the one the
    step in flight writes. That chunk waits for the step rather than run without the
    snapshot its session must keep."""
    d = Driver(page_size=4, chunk=4)
    sid = d.engine.sessions.open().sid
    session = d.engine.sessions.get(sid)
    two_reply_start_turns(d, session)
    assert d.engine.sessions.reply_starts == 2 and session.cached_len == 30
    close_all(d)


def test_a_later_turn_keeps_the_page_before_its_reply_start_for_a_branch():
    """The state at a reply start lies inside a page, where no cache node ends; the turn
    also stops its prefill at the page boundary before it, and that snapshot becomes the
    turn's kept boundary in the prefix cache (docs/ownership.md, "Kept boundaries"). A
    branch of the conversation past it (a header session re-seeded by an edited message)
    resumes there, not from what the first turn's chunks left. Pipelined and not."""
    for depth in (1, 2):
        d = Driver(page_size=4, chunk=8, depth=depth)
        sid = d.engine.sessions.open().sid
        session = d.engine.sessions.get(sid)
        prompt = two_reply_start_turns(d, session)
        assert session.cached_len == 30 and session.slots.borrowed == 28
        assert any(n.end == 28 and n.mamba for n in d.engine.cache.nodes())
        d.engine.sessions.reseed(sid)
        forked = [*prompt[:29], *text(5, 3)]
        req = d.turn(sid, forked, 6)
        d.run()
        assert req.cached_tokens == 28, depth
        assert req.output == reference(forked, 6, VOCAB)
        close_all(d)


def test_a_session_closed_during_a_turn_that_keeps_its_reply_start_ends_clean():
    """Closed while its turn runs: the turn's end gives the session its state at the
    reply start, and the close that then completes releases it; the turn's slots are
    the session's by then, never released a second time (the engine machine found it)."""
    d = Driver(page_size=16, chunk=128)
    sid = d.engine.sessions.open().sid
    session = d.engine.sessions.get(sid)
    prompt = text(26, 1)
    chat = truncating_turn(prompt, 26)
    d.engine.submit_turn(
        session, np.asarray(prompt), d.rid(), SamplingParams(max_new_tokens=0), chat=chat
    )
    d.engine.sessions.close(sid)
    d.run()
    assert sid not in d.engine.sessions.sessions
    d.assert_idle_clean()
