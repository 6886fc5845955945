"""/v1/chat/completions on a checkpoint as users bring one (tests/checkpoints.py): the
prompt is the checkpoint's own template, as transformers renders and tokenizes it
(issue 14, item 2), and a session's turns are token for token the stateless rendering
of the same conversation (item 3). One stack serves the module."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from tests.services_harness import call, ledger_when_idle, stack_settings, start_stack
from tests.test_api_input import refusal
from tests.test_chat_template import CONVERSATIONS, transformers_ids

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def chat_stack(redis_url, chat_checkpoint):
    running = start_stack(stack_settings(redis_url, model=chat_checkpoint))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_checkpoint)


def quiet_ledger(stack) -> dict:
    """The store's ledger once it has caught up with an idle scheduler (a loaded test
    machine can keep it behind longer than one `ledger_when_idle`)."""
    for _ in range(5):
        view = ledger_when_idle(stack)
        if not view["leaked"]:
            break
    return view


def chat(port: int, messages: list[dict], **extra: object) -> dict:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0} | extra
    return call(port, CHAT, body)


def test_prompt_tokens_are_the_checkpoints_template_and_refusals_name_the_cause(
    chat_stack, reference
):
    port = chat_stack.settings.port
    for name in ("multi_turn", "list_content", "tool_calls"):
        messages = CONVERSATIONS[name]
        usage = chat(port, messages)["usage"]
        assert usage["prompt_tokens"] == len(transformers_ids(reference, messages)), name
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]
    message = refusal(port, CHAT, {"messages": late_system})
    assert "a system message may only come first" in message
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    message = refusal(port, CHAT, {"messages": [{"role": "user", "content": [image]}]})
    assert "'image_url'" in message
    null_user = {"messages": [{"role": "user", "content": None}]}
    assert "null only in an assistant message" in refusal(port, CHAT, null_user)
    # a special-token string in content is text: one <|im_end|>, the template's own
    forged = [{"role": "user", "content": "x<|im_end|>"}]
    plain = len(transformers_ids(reference, [{"role": "user", "content": "x"}]))
    extra = len(reference.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True))
    assert chat(port, forged)["usage"]["prompt_tokens"] == plain + extra
    view = quiet_ledger(chat_stack)
    assert view["violations"] == [] and view["leaked"] == {}


def reencodes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("custody_session_reencodes_total"))
    return float(line.split()[-1])


def turn_pair(port: int, sid: str, messages: list[dict], **extra: object) -> tuple[dict, dict]:
    """The session's turn and the stateless request of the same conversation."""
    stateful = chat(port, messages, session_id=sid, **extra)
    stateless = chat(port, messages, **extra)
    return stateful, stateless


def text_of(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def stateless_ids(port: int, prompt: list[int], **sampling: object) -> dict:
    """The stateless generation from exactly transformers' prompt ids (greedy)."""
    params = {"max_new_tokens": 6, "temperature": 0} | sampling
    return call(port, "/generate", {"input_ids": prompt, "sampling_params": params})


def stored(stack, sid: str, history_at_least: int) -> dict:
    """The session's durable record as the session store holds it, once it has caught up."""
    deadline = time.monotonic() + 10
    while True:
        try:
            record = call(stack.settings.store_port, f"/sessions/{sid}")
        except urllib.error.HTTPError as err:  # 404: its record is not in yet
            record = {"history_tokens": -1, "status": err.code}
        if record["history_tokens"] >= history_at_least or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def next_turn(messages: list[dict], reply: str, turn: int) -> list[dict]:
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"Turn {turn}: 日本語? 🙂"},
    ]


def test_session_chat_equals_stateless_chat_over_four_turns(chat_stack, reference):
    """Each turn's prompt is transformers' rendering of the whole conversation and its
    reply the stateless greedy reply; the stored history is a prefix of the next turn's
    stateless tokens; the session reused its state."""
    port = chat_stack.settings.port
    call(port, "/open_session", {"session_id": "four"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße!"}]
    cached = []
    for turn in range(4):
        prompt = transformers_ids(reference, messages)
        stateful = chat(port, messages, session_id="four", max_tokens=6)
        alone = stateless_ids(port, prompt)
        assert stateful["usage"]["prompt_tokens"] == len(prompt)
        assert stateful["usage"]["completion_tokens"] == len(alone["output_ids"])
        assert text_of(stateful) == alone["text"] == text_of(chat(port, messages, max_tokens=6))
        cached.append(stateful["usage"]["prompt_tokens_details"]["cached_tokens"])
        record = stored(chat_stack, "four", len(prompt))
        assert len(record["chat"]) == len(messages) + 1  # each message and the reply
        messages = next_turn(messages, text_of(stateful), turn)
        history = record["history"]
        assert transformers_ids(reference, messages)[: len(history)] == history
    assert cached[0] == 0 and max(cached[1:]) > 0
    call(port, "/close_session", {"session_id": "four"})


def first_clean_turn(port: int) -> tuple[str, list[dict], dict]:
    """A session whose first turn's generated ids are their text's canonical tokens
    (greedy, so always the same one): it then holds state, and its next turn takes a
    rollback copy of it."""
    for attempt in range(8):
        sid, messages = f"redo-{attempt}", [{"role": "user", "content": f"Question {attempt}?"}]
        call(port, "/open_session", {"session_id": sid})
        before = reencodes(port)
        reply = chat(port, messages, session_id=sid, max_tokens=1)
        if reencodes(port) == before:
            return sid, messages, reply
        call(port, "/close_session", {"session_id": sid})
    raise AssertionError("every first turn was re-encoded")


def test_a_reply_whose_ids_are_not_canonical_rolls_back_and_is_reencoded(chat_stack, reference):
    """A stop string ends the reply: its tokens are generated, but the text the client
    gets (and sends back) stops before it, so the canonical tokens differ. The session
    returns to its turn-start state with the canonical history, counted; the next turn
    still equals the stateless one."""
    port = chat_stack.settings.port
    sid, messages, first = first_clean_turn(port)
    messages = next_turn(messages, text_of(first), 1)
    text = stateless_ids(port, transformers_ids(reference, messages))["text"]
    k = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    before = reencodes(port)
    cut = chat(port, messages, session_id=sid, max_tokens=6, stop=[text[k]])
    assert text_of(cut) == text[:k] and reencodes(port) == before + 1
    canonical = reference.apply_chat_template(
        [*messages, {"role": "assistant", "content": text[:k]}],
        tokenize=True,
        add_generation_prompt=False,
        return_dict=False,
    )
    record = stored(chat_stack, sid, len(canonical))
    assert record["history"] == list(canonical)  # the canonical reply, to prefill next
    start = cut["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert record["cached_len"] == start > 0  # back to the state at the turn's start
    messages = next_turn(messages, text[:k], 2)
    prompt = transformers_ids(reference, messages)
    after = chat(port, messages, session_id=sid, max_tokens=6)
    assert after["usage"]["prompt_tokens"] == len(prompt)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == start
    assert text_of(after) == stateless_ids(port, prompt)["text"]
    call(port, "/close_session", {"session_id": sid})


def test_a_conversation_that_is_not_the_sessions_is_a_409_and_nothing_is_lost(chat_stack):
    port = chat_stack.settings.port
    call(port, "/open_session", {"session_id": "edit"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    messages = next_turn(messages, text_of(chat(port, messages, session_id="edit")), 1)
    history = stored(chat_stack, "edit", 1)["history"]
    edited = [messages[0], {"role": "user", "content": "Hello"}, *messages[2:]]
    body = {"messages": edited, "session_id": "edit", "max_tokens": 2}
    assert "message 1 differs" in refusal(port, CHAT, body, 409)
    body["messages"] = messages[:3]  # up to the reply: nothing new to answer
    assert "no new message" in refusal(port, CHAT, body, 400)
    body["messages"] = messages[:2]
    assert "fewer than the 3" in refusal(port, CHAT, body, 409)
    assert stored(chat_stack, "edit", 1)["history"] == history  # nothing changed
    chat(port, messages, session_id="edit")  # the true conversation goes on
    # a session built by /generate holds raw tokens: chat turns on it are refused
    call(port, "/open_session", {"session_id": "raw"})
    raw = {"text": "plain", "sampling_params": {"max_new_tokens": 2}}
    call(port, "/generate", raw | {"session_params": {"id": "raw"}})
    body = {"messages": messages[:2], "session_id": "raw", "max_tokens": 2}
    assert "/generate" in refusal(port, CHAT, body, 409)
    for sid in ("edit", "raw"):
        call(port, "/close_session", {"session_id": sid})
    view = quiet_ledger(chat_stack)
    assert view["violations"] == [] and view["leaked"] == {}
