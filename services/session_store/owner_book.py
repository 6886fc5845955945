"""The owners the replayed ledger knows by name, kept only while they hold something.

Owner ids are never reused, so a store that remembered every owner it was told about
would grow with every request ever served, in memory and in its checkpoint. A name is
needed only to report about slots, so an owner is forgotten once it holds no slot:
requests, tracks and cache nodes never take a slot again after giving
up their last one (a request holds its row, a track its two slots, from the transfer
that declares them until they retire). A session may hold nothing between turns and
still live, so it is forgotten when its closed record arrives (or, if it still held
slots then, once it gives up the last).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from shared.owners import OwnerKind, anonymous, kind_of, label


class OwnerBook:
    def __init__(self) -> None:
        self.names: dict[int, str] = {}  # declared names of owners that still matter
        self.held: Counter[int] = Counter()  # slots held per owner id, over every pool
        self._sessions: dict[str, int] = {}  # session label -> owner id
        self._ended: set[int] = set()  # closed sessions still holding slots

    def reset(self, names: dict[int, str], tables: list[list[int]]) -> None:
        """Start over from a snapshot (or a checkpoint): its names and owner tables."""
        every = np.concatenate([np.zeros(0, np.int64), *(np.asarray(t[1:]) for t in tables)])
        ids, counts = np.unique(every, return_counts=True)
        self.held = Counter(
            {o: n for o, n in zip(ids.tolist(), counts.tolist(), strict=True) if o > 0}
        )
        self.names, self._sessions, self._ended = {}, {}, set()
        self.declare(names)
        for owner in list(self.names):
            self._forget_if_done(owner)

    def declare(self, names: dict[int, str]) -> None:
        self.names.update(names)
        for owner, name in names.items():
            if kind_of(owner) is OwnerKind.SESSION:
                self._sessions[name] = owner

    def moved(self, givers: np.ndarray, receivers: np.ndarray, declared: dict[int, str]) -> None:
        """Count a batch's moves (one giver and one receiver per moved slot, the giver
        being the slot's owner before the move), then forget every owner the batch
        declared or took slots from that now holds nothing and will take nothing again."""
        for ids, sign in ((givers, -1), (receivers, 1)):
            owners, counts = np.unique(ids, return_counts=True)
            for owner, n in zip(owners.tolist(), counts.tolist(), strict=True):
                if owner > 0:
                    self.held[owner] += sign * n
        for owner in {*np.unique(givers).tolist(), *declared}:
            self._forget_if_done(owner)

    def closed(self, sid: str) -> None:
        """The session `sid` was closed: it will hold nothing again."""
        owner = self._sessions.get(label(OwnerKind.SESSION, sid))
        if owner is not None:
            self._ended.add(owner)
            self._forget_if_done(owner)

    def session(self, sid: str) -> int | None:
        """The owner id of the live session `sid`, if it was declared."""
        return self._sessions.get(label(OwnerKind.SESSION, sid))

    def name(self, owner: int) -> str:
        return self.names.get(owner) or anonymous(owner)

    def _forget_if_done(self, owner: int) -> None:
        if owner <= 0 or self.held[owner] > 0:
            return
        if kind_of(owner) is OwnerKind.SESSION and owner not in self._ended:
            return  # a live session between turns
        del self.held[owner]
        name = self.names.pop(owner, None)
        if self._sessions.get(name) == owner:
            del self._sessions[name]
        self._ended.discard(owner)
