"""A session's turns as a tree, and SGLang's rule for the history a turn continues from
(docs/api.md, "Sessions").

Each finished `/generate` turn is a node: the first `base` tokens of its parent's tokens,
then its own input, then its output; a turn that names no earlier turn continues the
latest. A turn's `session_params` pick its parent and cut (`resolve`): `rid` names the
parent (absent: the latest turn), `drop_previous_output` keeps the parent's prompt
without its output, a non-zero `offset` cuts what is kept as a Python slice does, and
`replace` forgets the parent's other branches once the turn finishes, as sglang
0.5.23's session controller builds a non-streaming session's request
(tests/peers/test_sglang_session_branches.py runs it beside this). Two choices are
custody's: a turn without `rid` continues the latest turn (SGLang's would start from its
input alone), and so `replace` without `rid` concerns the latest turn (SGLang's raises
there: it deletes from the dict it iterates). Nothing changes until the turn finishes
(`commit`): an aborted turn leaves the tree as it was.

A node keeps only its own tokens, so a tree costs what its turns sent and generated;
its size is bounded (`MAX_TURNS`, `MAX_TOKENS`) by forgetting the oldest leaves first,
never the latest turn or a parent of a kept turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.records.sampling import InvalidRequest
from shared.messages.envelope import I4, array
from shared.messages.ownership import TurnEntry

MAX_TURNS = 1024  # turns a session remembers
MAX_TOKENS = 1 << 20  # tokens its turns hold between them (4 MiB)


@dataclass(eq=False)
class TurnNode:
    id: int
    rid: str
    parent: TurnNode | None
    base: int  # the parent's tokens it starts from
    input: np.ndarray  # int32
    output: np.ndarray  # int32
    children: list[TurnNode] = field(default_factory=list)

    def prompt(self) -> np.ndarray:
        """Its whole prompt: the kept part of each ancestor, then its input."""
        parts, node, keep = [self.input], self, self.base
        while node.parent is not None:
            node = node.parent
            own = np.concatenate([node.input, node.output])
            kept_before = min(keep, node.base)
            parts.append(own[: max(0, keep - node.base)])
            keep = kept_before
        return np.concatenate(parts[::-1]).astype(np.int64)

    def tokens(self) -> np.ndarray:
        """Its prompt and its output: what a turn naming it continues from."""
        return np.concatenate([self.prompt(), self.output.astype(np.int64)])

    @property
    def size(self) -> int:
        return len(self.input) + len(self.output)

    @property
    def length(self) -> int:
        """How many tokens `tokens()` holds, without building them."""
        return self.base + self.size


@dataclass(frozen=True)
class Branch:
    """Where a turn starts: the tokens it continues (`base`), the turn they come from
    (None: no turn, the session's history or nothing), and whether that turn's other
    branches go when it finishes."""

    base: np.ndarray
    parent: TurnNode | None
    replace: bool = False

    def continues(self, history: np.ndarray, cached_len: int) -> bool:
        """Whether the turn may start from its session's state, which holds `history`'s
        first `cached_len` positions (else it resumes from the prefix cache)."""
        n = cached_len
        return len(self.base) >= n and np.array_equal(self.base[:n], history[:n])


class TurnTree:
    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.nodes: dict[int, TurnNode] = {}  # oldest first
        self.by_rid: dict[str, TurnNode] = {}  # the newest turn of each rid
        self.latest: TurnNode | None = None
        self.tokens = 0
        self._next_id = 1

    def resolve(self, options: Mapping, history: np.ndarray, last_rid: str) -> Branch:
        """The branch a turn with `session_params` `options` starts from; `history` and
        `last_rid` are the session's (its latest turn may be one the tree does not hold:
        a chat turn's, or a session with no turns recorded)."""
        rid, offset = options.get("rid"), options.get("offset")
        drop, replace = bool(options.get("drop_previous_output")), bool(options.get("replace"))
        if rid is None or rid == last_rid:
            parent = (
                self.latest if self.latest is not None and self.latest.rid == last_rid else None
            )
            tokens = history
            if drop and parent is not None:
                tokens = parent.prompt()
        else:
            parent = self.by_rid.get(rid)
            if parent is None:
                raise InvalidRequest(
                    f"session_params.rid {rid!r} names no turn of this session (a turn "
                    "is named once it has finished; the oldest are forgotten past "
                    f"{MAX_TURNS} turns)"
                )
            tokens = parent.prompt() if drop else parent.tokens()
        if offset:
            tokens = tokens[:offset]
        return Branch(tokens, parent, replace=replace)

    def commit(self, branch: Branch, rid: str, new_input: np.ndarray, output: list[int]) -> None:
        """The turn `rid`, started from `branch` with `new_input`, finished with `output`:
        it becomes the latest turn."""
        if branch.replace and branch.parent is not None:
            for child in list(branch.parent.children):
                self._forget(child)
        parent = branch.parent
        if parent is not None and self.nodes.get(parent.id) is not parent:
            parent = None  # forgotten meanwhile: the turn keeps its whole prompt itself
        if parent is None:
            base, own = 0, np.concatenate([branch.base, new_input])
        else:
            base, own = len(branch.base), new_input
        node = TurnNode(self._next_id, rid, parent, base, array(own, I4), array(output, I4))
        self._add(node)
        self.latest = node
        self._bound()

    def entries(self) -> list[TurnEntry]:
        """The tree as its durable record carries it, parents first."""
        return [
            TurnEntry(
                n.id, n.rid, 0 if n.parent is None else n.parent.id, n.base, n.input, n.output
            )
            for n in self.nodes.values()
        ]

    @classmethod
    def of(cls, entries: list[TurnEntry], last_rid: str) -> TurnTree:
        """The tree a record carries; ValueError if it does not hold together (a parent
        named before it exists, an id twice, a base past its parent's tokens)."""
        tree = cls()
        for e in entries:
            parent = tree.nodes.get(e.parent) if e.parent else None
            if e.id in tree.nodes or e.id < 1 or (e.parent and parent is None):
                raise ValueError(f"turn {e.id} of parent {e.parent} out of order")
            if parent is not None and not 0 <= e.base <= parent.length:
                raise ValueError(f"turn {e.id} keeps {e.base} tokens of its parent")
            tree._add(TurnNode(e.id, e.rid, parent, e.base if parent else 0, e.input, e.output))
            tree._next_id = max(tree._next_id, e.id + 1)
        if entries:
            last = tree.nodes[entries[-1].id]
            tree.latest = last if last.rid == last_rid else None
        return tree

    def _add(self, node: TurnNode) -> None:
        self.nodes[node.id] = node
        self.by_rid[node.rid] = node
        if node.parent is not None:
            node.parent.children.append(node)
        self.tokens += node.size
        self._next_id = max(self._next_id, node.id + 1)

    def _forget(self, node: TurnNode) -> None:
        """`node` and every turn below it."""
        for child in list(node.children):
            self._forget(child)
        del self.nodes[node.id]
        self.tokens -= node.size
        if self.by_rid.get(node.rid) is node:
            del self.by_rid[node.rid]
        if node.parent is not None:
            node.parent.children.remove(node)
        if self.latest is node:
            self.latest = None

    def _bound(self) -> None:
        """Forget the oldest leaves (never the latest turn) while over a bound."""
        while len(self.nodes) > MAX_TURNS or self.tokens > MAX_TOKENS:
            leaf = next(
                (n for n in self.nodes.values() if not n.children and n is not self.latest), None
            )
            if leaf is None:
                return
            self._forget(leaf)
