"""Deferred state ops: the Mamba slot clears and copies a forward step needs first.

The scheduler never touches device state; it records what must happen to which slots
and the executor runs it on its compute stream right before that step's forward, so a
copy cannot race a forward still writing its source (lesson 4). Clears run before
copies. A slot is a destination at most once per step, and no slot is both a source and
a destination, so the order of the copies does not matter.

Each destination may name the owner it is written for (`owners`): the step carries it,
so the session store can check, independently of the scheduler, that the slot is that
owner's when the step is planned. 0 (the executor's own tests) names none.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class DeferredOpsError(ValueError):
    pass


@dataclass
class DeferredOps:
    clears: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst)
    owners: dict[int, int] = field(default_factory=dict)  # destination -> owner id it serves

    def clear(self, slot: int, owner: int = 0) -> None:
        self._check_new_destination(slot)
        if slot in self.sources():
            raise DeferredOpsError(f"slot {slot} is a copy source in this step; cannot clear it")
        self.clears.append(slot)
        self.owners[slot] = owner

    def copy(self, src: int, dst: int, owner: int = 0) -> None:
        self._check_new_destination(dst)
        if src == dst or src in self.destinations():
            raise DeferredOpsError(f"copy {src}->{dst}: source is a destination in this step")
        self.copies.append((src, dst))
        self.owners[dst] = owner

    def destinations(self) -> set[int]:
        return set(self.clears) | {dst for _, dst in self.copies}

    def sources(self) -> set[int]:
        return {src for src, _ in self.copies}

    def __bool__(self) -> bool:
        return bool(self.clears or self.copies)

    def _check_new_destination(self, slot: int) -> None:
        if slot <= 0:
            raise DeferredOpsError(f"slot {slot}: slot 0 is the padding sink, never a target")
        if slot in self.destinations():
            raise DeferredOpsError(f"slot {slot} is already a destination in this step")

    def validate(self, num_slots: int) -> None:
        """Refuse ops naming the sink, a slot out of range or a destination twice."""
        dsts = self.clears + [dst for _, dst in self.copies]
        every = dsts + [src for src, _ in self.copies]
        bad = [s for s in every if not 0 < s < num_slots]
        if bad:
            raise DeferredOpsError(f"slots {bad} outside 1..{num_slots - 1}")
        if len(set(dsts)) != len(dsts):
            raise DeferredOpsError(f"a slot is a destination twice: {sorted(dsts)}")
        both = set(dsts) & self.sources()
        if both:
            raise DeferredOpsError(f"slots both source and destination: {sorted(both)}")
