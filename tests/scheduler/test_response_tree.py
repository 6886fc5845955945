"""A session's stored responses as a tree (records/response_tree.py): the conversation a
response ends, what a delete leaves, the bounds, and the record's round trip; and how a
response id names its session for the fronts (shared/session_ids.py,
fronts/addressing.py)."""

from __future__ import annotations

import json

from fronts.addressing import new_conversation, session_of
from services.scheduler.records import response_tree
from services.scheduler.records.response_tree import ResponseTree
from shared.messages.ownership import ResponseEntry
from shared.session_ids import response_id, response_session, scoped_session_id


def entry(rid: str, parent: str, said: str, body: bytes = b"{}") -> ResponseEntry:
    messages = [{"role": "user", "content": said}, {"role": "assistant", "content": "."}]
    return ResponseEntry(rid, parent, json.dumps(messages).encode(), body)


def chain() -> ResponseTree:
    """a <- b <- c, and a fork d of a."""
    tree = ResponseTree()
    for rid, parent in (("a", ""), ("b", "a"), ("c", "b"), ("d", "a")):
        assert tree.add(entry(rid, parent, rid))
    return tree


def said(tree: ResponseTree, rid: str) -> list[str]:
    return [m["content"] for m in tree.conversation(rid) if m["role"] == "user"]


def test_a_response_ends_the_conversation_of_its_branch():
    tree = chain()
    assert said(tree, "c") == ["a", "b", "c"]
    assert said(tree, "d") == ["a", "d"]
    assert not tree.add(entry("e", "nosuch", "e"))  # a parent not held: nothing stored
    assert not tree.add(entry("c", "b", "again"))  # an id once
    assert tree.live == 4


def test_a_deleted_response_goes_unnamed_but_its_children_keep_their_conversation():
    tree = chain()
    assert tree.delete("b")
    assert tree.get("b") is None and not tree.delete("b")
    assert said(tree, "c") == ["a", "b", "c"]  # b's messages stay part of c's
    assert tree.delete("c")  # the last below b: both go
    assert set(tree.nodes) == {"a", "d"}
    assert tree.delete("a") and said(tree, "d") == ["a", "d"]
    assert tree.delete("d") and not tree.nodes and tree.live == 0 and tree.bytes == 0


def test_the_tree_is_bounded_by_forgetting_old_leaves_never_the_newest(monkeypatch):
    monkeypatch.setattr(response_tree, "MAX_RESPONSES", 3)
    tree = ResponseTree()
    tree.add(entry("r0", "", "0"))
    for i in range(1, 6):  # each continues the one before: a chain has one leaf
        tree.add(entry(f"r{i}", f"r{i - 1}", str(i)))
    assert tree.get("r5") is not None and said(tree, "r5") == ["0", "1", "2", "3", "4", "5"]
    tree.add(entry("x", "r0", "x"))  # a second leaf: the older leaf goes, never the newest
    assert tree.get("x") is not None and len(tree.nodes) <= 7


def test_the_record_carries_the_tree_back():
    tree = chain()
    tree.delete("b")
    back = ResponseTree.of(tree.entries())
    assert back.entries() == tree.entries() and back.bytes == tree.bytes
    assert said(back, "c") == ["a", "b", "c"] and back.get("b") is None


def test_a_response_id_names_its_session_for_every_front():
    rid = response_id("conv.1", "00ff")
    assert response_session(rid) == "conv.1"
    for bad in ("resp_", "resp__1", "nonsense", "resp_a~b_1", None, 7):
        assert response_session(bad) is None
    tenant = "ab" * 32
    mine = scoped_session_id(tenant, "conv.1")
    assert session_of(f"/v1/responses/{rid}", None, tenant) == mine
    assert session_of(f"/v1/responses/{rid}/input_items", None, tenant) == mine
    assert session_of("/v1/responses", {"previous_response_id": rid}, tenant) == mine
    assert session_of("/v1/responses", {"session_id": "conv.1"}, tenant) == mine
    assert new_conversation("/v1/responses", {"input": "x"})
    assert not new_conversation("/v1/responses", {"input": "x", "store": False})
    assert not new_conversation("/v1/responses", {"previous_response_id": rid})
