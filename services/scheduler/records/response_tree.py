"""A session's stored responses (the OpenAI Responses API, docs/api.md "Responses") as a
tree: each response names the one it continued (`previous_response_id`), and the
conversation it ends is the messages of every response from the root down to it.

The tree lives in the session and travels in its record (`SessionRecord.responses`), so
a response is stored by the same record write as its turn's history, and its id lives
as long as the session does: through a restart, a move and a drain. Its size is bounded
(`MAX_RESPONSES`, `MAX_BYTES`) by forgetting the oldest leaves first, never the newest
response; a deleted response with responses below it stays unnamed (its messages are
part of their conversations) until the last of them goes.
"""

from __future__ import annotations

import json

from shared.messages.ownership import ResponseEntry

MAX_RESPONSES = 256  # responses a conversation's session keeps
MAX_BYTES = 1 << 20  # their stored bodies and messages together (each record write carries them)


class ResponseTree:
    def __init__(self) -> None:
        self.nodes: dict[str, ResponseEntry] = {}  # oldest first
        self.children: dict[str, int] = {}  # how many responses continue each one
        self.bytes = 0
        self.newest = ""

    def get(self, rid: str) -> ResponseEntry | None:
        """The stored response `rid`, unless deleted or forgotten."""
        node = self.nodes.get(rid)
        return None if node is None or node.deleted else node

    def conversation(self, rid: str) -> list[dict]:
        """The messages of the conversation response `rid` ends, oldest first."""
        parts, node = [], self.nodes.get(rid)
        while node is not None:
            parts.append(json.loads(node.messages))
            node = self.nodes.get(node.parent) if node.parent else None
        return [m for part in reversed(parts) for m in part]

    @property
    def live(self) -> int:
        """Responses a client may still name."""
        return sum(not n.deleted for n in self.nodes.values())

    def add(self, entry: ResponseEntry) -> bool:
        """A response stored as its turn finished; False (nothing stored) if the one it
        continues is held no more (deleted and pruned while it ran)."""
        if (entry.parent and entry.parent not in self.nodes) or entry.id in self.nodes:
            return False
        self.nodes[entry.id] = entry
        self.bytes += _size(entry)
        if entry.parent:
            self.children[entry.parent] = self.children.get(entry.parent, 0) + 1
        self.newest = entry.id
        self._bound()
        return True

    def delete(self, rid: str) -> bool:
        """Response `rid` is named no more; False if it was not. Its messages stay while
        a response below it continues its conversation."""
        node = self.get(rid)
        if node is None:
            return False
        self.nodes[rid] = ResponseEntry(node.id, node.parent, node.messages, b"{}", True)
        self.bytes -= len(node.body) - 2
        self._prune(rid)
        return True

    def entries(self) -> list[ResponseEntry]:
        """The tree as the session's record carries it, parents first."""
        return list(self.nodes.values())

    @classmethod
    def of(cls, entries: list[ResponseEntry]) -> ResponseTree:
        """The tree a record carries; ValueError if a parent comes after its child."""
        tree = cls()
        for entry in entries:
            if not tree.add(entry):
                raise ValueError(f"response {entry.id} continues {entry.parent}, not held")
        return tree

    def _prune(self, rid: str) -> None:
        """Forget `rid` and the deleted responses above it that nothing continues now."""
        while rid and rid in self.nodes and self.nodes[rid].deleted and not self.children.get(rid):
            node = self.nodes.pop(rid)
            self.bytes -= _size(node)
            self.children.pop(rid, None)
            if node.parent:
                self.children[node.parent] -= 1
            rid = node.parent

    def _bound(self) -> None:
        """Forget the oldest leaves (never the newest response) while over a bound."""
        while len(self.nodes) > MAX_RESPONSES or self.bytes > MAX_BYTES:
            leaf = next(
                (rid for rid in self.nodes if not self.children.get(rid) and rid != self.newest),
                None,
            )
            if leaf is None:
                return
            node = self.nodes[leaf]
            self.nodes[leaf] = ResponseEntry(node.id, node.parent, node.messages, b"{}", True)
            self.bytes -= len(node.body) - 2
            self._prune(leaf)


def _size(entry: ResponseEntry) -> int:
    return len(entry.messages) + len(entry.body)
