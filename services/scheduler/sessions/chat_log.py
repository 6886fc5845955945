"""A chat turn's end (docs/chat.md): the session's conversation gains the reply, and a
reply whose generated ids are not the canonical encoding of its text is re-encoded.

The client sends a reply back as text, and the template renders that text with its
end-of-turn suffix; the ids the model generated need not be what the tokenizer makes of
that text (a stop string's tokens, a special token the text leaves out, a different BPE
split). If the session kept them, turn N's tokens would differ from the stateless
rendering of the same conversation. So when the turn's history is not a prefix of the
canonical tokens, the session returns to its state at the turn's start (the rollback copy
every turn takes), its history becomes the canonical tokens, and the next turn prefills
what lies past that state, the canonical reply included (`SessionManager` does that).
"""

from __future__ import annotations

import logging

import numpy as np

from services.scheduler.records.request import Request
from services.scheduler.records.session import Session

log = logging.getLogger("custody.scheduler.chat")


def turn_history(req: Request) -> np.ndarray:
    """What the turn would leave as its session's history: prompt and committed output."""
    return np.concatenate([req.prompt, np.asarray(req.committed_output(), dtype=np.int64)])


def settle(req: Request) -> tuple[np.ndarray, bool] | None:
    """Record the turn's conversation in its session; returns the canonical history when
    the turn's own history is not a prefix of it (the reply must be re-encoded), or when
    the reply renders otherwise once a message follows it (a template that empties an
    earlier reply's reasoning, NemotronH's `truncate_history_thinking`): then the state
    past the turn's start would not match the next turn's rendering. With the canonical
    history: whether the turn's state at its reply start (`Request.reply_start`) is a
    state of it (the canonical history agrees with the prompt up to there)."""
    session: Session = req.session
    session.last_rid = req.name or req.rid  # the turn a later one may name (session_params.rid)
    if req.chat is None:
        session.chat = None  # raw tokens (/generate): the history is no conversation now
        return None
    stored = None if req.chat.stored is None else req.chat.stored(req)
    if stored is not None and not session.responses.add(stored):
        log.warning(
            "session %s: response %s continued one deleted meanwhile", session.sid, stored.id
        )
    settled = req.chat.reply(req)
    if settled is None:
        session.chat = None
        return None
    entry, canonical, stable = settled
    session.chat = (*req.chat.messages, entry)
    history = turn_history(req)
    start = req.reply_start
    at_start = 0 < start <= len(canonical) and np.array_equal(canonical[:start], req.prompt[:start])
    if not stable:
        return canonical, at_start
    if len(history) <= len(canonical) and np.array_equal(canonical[: len(history)], history):
        return None
    return canonical, at_start
