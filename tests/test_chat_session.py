"""Session chat's refusals that need no model (docs/chat.md): a template that renders
earlier messages differently once more follow (not prefix-stable) cannot continue a
session, and a session holding raw tokens is no conversation. Both are a 409 that
changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.http.chat_session import MAX_NEW_MESSAGES, digest, plan_turn
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.session import Session, SessionError
from services.scheduler.text.chat_template import ChatTemplate
from services.scheduler.text.chat_tokens import ChatEncoder
from shared.messages.ownership import ChatEntry
from shared.tokenizer import ByteTokenizer

# Hides every reply but the last, as templates that strip earlier reasoning do.
UNSTABLE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and not loop.last %}[earlier reply]"
    "{% else %}{{ m.content }}{% endif %}\n"
    "{% endfor %}"
)
USER, REPLY = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}


def session_after_one_turn(encoder: ChatEncoder) -> Session:
    session = Session("s", None, None, 0.0)
    canonical = encoder.tokens([USER, REPLY], False)
    session.history = np.asarray(canonical, dtype=np.int64)
    session.chat = (ChatEntry(digest(USER), 3), ChatEntry(digest(REPLY), len(canonical)))
    return session


def test_a_template_that_is_not_prefix_stable_cannot_continue_a_session():
    """Not where the session's state lies: a difference within it is a 409; one past it
    (the state at the reply's start, docs/chat.md step 4) is rendered anew."""
    encoder = ChatEncoder(ChatTemplate(UNSTABLE, {}), ByteTokenizer())
    session = session_after_one_turn(encoder)
    session.cached_len = len(session.history)  # its state covers the reply
    messages = [USER, REPLY, {"role": "user", "content": "more"}]
    with pytest.raises(SessionError, match="not prefix-stable") as refused:
        plan_turn(encoder, session, messages, None, lambda req: "")
    assert refused.value.kind == "conflict"
    session.cached_len = 2  # its state at the reply's start ("hi", then "ok")
    tokens, turn = plan_turn(encoder, session, messages, None, lambda req: {})
    assert turn.base == 2 and bytes(tokens) == b"[earlier reply]more"
    stable = ChatEncoder(ChatTemplate.load(None), ByteTokenizer())
    tokens, turn = plan_turn(stable, session_after_one_turn(stable), messages, None, str)
    assert bytes(tokens) == b"<|user|>\nmore\n<|assistant|>\n"
    assert [e.end for e in turn.messages][-1] == len(stable.tokens(messages, False))


def test_a_session_of_raw_tokens_is_no_conversation():
    encoder = ChatEncoder(ChatTemplate.load(None), ByteTokenizer())
    session = Session("raw", None, None, 0.0)
    session.history = np.arange(5, dtype=np.int64)  # from /generate: chat is None
    with pytest.raises(SessionError, match="/generate") as refused:
        plan_turn(encoder, session, [USER], None, str)
    assert refused.value.kind == "conflict"


def test_a_session_turn_adds_a_bounded_number_of_messages():
    """Each new message's token end costs a render of the conversation up to it, on the
    event loop: thousands of tiny messages in one turn would block every other request
    for seconds. More than MAX_NEW_MESSAGES is a 400 that changes nothing."""
    encoder = ChatEncoder(ChatTemplate.load(None), ByteTokenizer())
    session = Session("many", None, None, 0.0)
    many = [USER] * (MAX_NEW_MESSAGES + 1)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_NEW_MESSAGES} messages"):
        plan_turn(encoder, session, many, None, str)
    assert session.chat is None and session.history.size == 0
    _, turn = plan_turn(encoder, session, many[:MAX_NEW_MESSAGES], None, str)
    assert len(turn.messages) == MAX_NEW_MESSAGES
