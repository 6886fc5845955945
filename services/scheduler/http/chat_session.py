"""A chat turn on a session (docs/chat.md): it appends exactly what the template renders
after the stored conversation, so a session's turn N has the tokens of the stateless
rendering of the same messages.

The client sends the whole conversation every time. Its messages must begin with the
session's stored conversation (compared by digest: a 409 names the first message that
differs); the turn's tokens are the rendering of all of them with a generation prompt,
of which the session's history must be a prefix (else the template is not prefix-stable
for this conversation: a 409, nothing changes); the turn appends the rest. At the turn's
end the session re-encodes the reply if its generated ids are not canonical
(sessions/chat_log.py), with what `reply` here computes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

import numpy as np

from services.scheduler.records.request import ChatTurn, Request
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session, SessionError
from services.scheduler.text.chat_tokens import ChatEncoder, template_message
from shared.messages.ownership import ChatEntry

log = logging.getLogger("custody.scheduler.chat")

# Each new message's token end costs a render of the conversation up to it, on the
# scheduler's event loop: a turn adding k messages to n costs k renders of up to n+k
# messages, so k is bounded (agent loops add one to three a turn).
MAX_NEW_MESSAGES = 32


def digest(message: dict) -> str:
    """A message as the template sees it, hashed (key order and spacing do not count)."""
    text = json.dumps(message, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check_conversation(session: Session, digests: list[str]) -> int:
    """How many of the messages the session holds already; a 409 if they are not the
    start of its conversation, or if its history is not a conversation at all."""
    stored = session.chat
    if stored is None:
        if session.history.size:
            raise SessionError(
                f"session {session.name} holds tokens that are not a chat conversation "
                "(from /generate); continue it with /generate, or chat in a new session",
                "conflict",
            )
        return 0
    if len(digests) < len(stored):
        raise SessionError(
            f"{len(digests)} messages are fewer than the {len(stored)} of session "
            f"{session.name}'s conversation: send them all, then the new ones",
            "conflict",
        )
    for i, entry in enumerate(stored):
        if digests[i] != entry.digest:
            raise SessionError(
                f"message {i} differs from session {session.name}'s conversation: send "
                f"its {len(stored)} stored messages unchanged, then the new ones",
                "conflict",
            )
    if len(digests) == len(stored):
        raise InvalidRequest(f"no new message after session {session.name}'s conversation")
    return len(stored)


def plan_turn(
    encoder: ChatEncoder,
    session: Session,
    messages: list[dict],
    variables: dict,
    reply_message: Callable[[Request], dict],
) -> tuple[list[int], ChatTurn]:
    """The turn's new tokens and what its session keeps of it; `messages` as the
    template sees them, `reply_message` the reply as the client gets it."""
    digests = [digest(m) for m in messages]
    known = check_conversation(session, digests)
    if len(messages) - known > MAX_NEW_MESSAGES:
        raise InvalidRequest(
            f"a chat turn on a session adds at most {MAX_NEW_MESSAGES} messages, not "
            f"{len(messages) - known}; send a longer conversation without session_id"
        )
    full = encoder.tokens(messages, True, variables)
    base = kept_history(session, full)
    entries = [
        e
        if e.end <= base
        else ChatEntry(e.digest, len(encoder.tokens(messages[: j + 1], False, variables)))
        for j, e in enumerate(session.chat or ())
    ]
    for j in range(known, len(messages)):
        end = len(encoder.tokens(messages[: j + 1], False, variables))
        entries.append(ChatEntry(digests[j], end))
    entries = ordered(entries)

    def reply(req: Request) -> tuple[ChatEntry, np.ndarray, bool] | None:
        """Run by the engine at the turn's end; it must not raise."""
        try:
            message = template_message(reply_message(req), encoder.template.takes_lists)
            canonical = encoder.tokens([*messages, message], False, variables)
        except Exception:
            log.exception("session %s: its reply has no canonical rendering", session.sid)
            return None
        try:
            followed = encoder.tokens([*messages, message, FOLLOWER], False, variables)
        except Exception:  # a template that refuses this follower: nothing to compare
            followed = canonical
        stable = followed[: len(canonical)] == canonical
        entry = ChatEntry(digest(message), len(canonical))
        return entry, np.asarray(canonical, dtype=np.int64), stable

    turn = ChatTurn(base, len(session.history), tuple(entries), reply)
    turn.reply_start = reply_start(encoder, messages, variables, full)
    return full[base:], turn


def ordered(entries: list[ChatEntry]) -> list[ChatEntry]:
    """Each message's end no later than the next one's. A template that renders a reply
    otherwise once a message follows it (NemotronH's `truncate_history_thinking` empties
    its reasoning) ends that reply, rendered last, past where the next message ends in
    the conversation as it stands; the reply then ends where that message does (the
    record's ends must be ordered, shared/messages/ownership.py)."""
    out = list(entries)
    for j in range(len(out) - 2, -1, -1):
        if out[j].end > out[j + 1].end:
            out[j] = ChatEntry(out[j].digest, out[j + 1].end)
    return out


# what follows a reply when the session asks whether the template renders it the same
# with a message after it; and a reply with reasoning, to ask it of the template at all
FOLLOWER = {"role": "user", "content": "."}
PROBE = {"role": "assistant", "content": ".", "reasoning_content": "."}


def reply_start(
    encoder: ChatEncoder, messages: list[dict], variables: dict, full: list[int]
) -> int:
    """Where the turn's state must be kept, if its template renders a reply otherwise once
    a message follows it (NemotronH's `truncate_history_thinking`): the end of what the
    prompt `full` shares with the conversation rendered with a reply and a message after
    it (the assistant's header, say). 0 for a template that renders replies the same."""
    try:
        alone = encoder.tokens([*messages, PROBE], False, variables)
        followed = encoder.tokens([*messages, PROBE, FOLLOWER], False, variables)
    except Exception:  # a template that refuses the probe: nothing learnt
        return 0
    if followed[: len(alone)] == alone:
        return 0
    shared = next((i for i, (a, b) in enumerate(zip(full, followed, strict=False)) if a != b), None)
    return min(len(full), len(followed)) if shared is None else shared


def kept_history(session: Session, full: list[int]) -> int:
    """How much of the session's history the turn keeps: all of it when it is a prefix of
    the conversation's rendering `full`; else, when the difference lies past the
    session's state (a reply the template renders otherwise now that a message follows
    it), the history up to the state, the rest rendered anew; else a 409, nothing
    changes."""
    history, state = session.history, session.cached_len
    if len(full) >= len(history) and np.array_equal(full[: len(history)], history):
        return len(history)
    if len(full) >= state and np.array_equal(full[:state], history[:state]):
        return state
    raise SessionError(
        f"the chat template renders session {session.name}'s conversation differently "
        "once these messages follow (it is not prefix-stable here), so the session "
        "cannot continue it; send the conversation without session_id",
        "conflict",
    )
