"""The checks of a step's tier moves, all made before the first of them runs.

The scheduler's slot numbers are trusted only after this: a move naming the sink, a page
or slot beyond its tier's capacity, a page count that does not cover its tokens, or more
tokens than a context holds is refused, and so is a step in which two moves write the
same place, or one move writes a place that a move running after it (in the order of
`MOVE_ORDER`) reads, or a load reads a blob the step discards. A place read first and
written later is allowed: the scheduler frees the sources of spills (host) and of
hibernates (device) at once, for the same step to reuse, because those moves run before
any write to their tier; it holds what loads and restores read until the step has run.
A discarded slot may be spilled to in the same step: discards run first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shared.messages.tiers import MOVE_ORDER, TierMove

SIDES = {  # kind -> (source tier, destination tier)
    "hibernate": ("device", "host"),
    "spill": ("host", "disk"),
    "load": ("disk", "host"),
    "restore": ("host", "device"),
    "adopt": ("foreign", "disk"),  # another replica's blob: read, never written here
}


class TierMoveRefused(ValueError):
    """A move or discard out of range or in conflict: the step is refused whole."""


@dataclass(frozen=True)
class Capacity:
    """The usable pages and slots of a tier (1..n; 0 is the sink)."""

    pages: int
    slots: int


FOREIGN = Capacity(0, 2**31 - 1)  # another replica's disk: its size is not known here


def check_moves(
    moves: Sequence[TierMove],
    discards: Sequence[int],
    tiers: dict[str, Capacity],
    page_size: int,
    context_len: int,
) -> None:
    """Raise TierMoveRefused for the first thing wrong; touches nothing."""
    reads: dict[str, dict[tuple[str, int], int]] = {tier: {} for tier in tiers}
    writes: dict[str, list[tuple[str, int]]] = {tier: [] for tier in tiers}
    written_at: dict[str, dict[tuple[str, int], int]] = {tier: {} for tier in tiers}
    for i, move in enumerate(moves):
        what = f"move {i} ({move.kind} of {move.sid!r})"
        if move.kind not in SIDES:
            raise TierMoveRefused(f"{what}: unknown kind")
        if not 0 < move.tokens <= context_len:
            raise TierMoveRefused(f"{what}: {move.tokens} tokens outside 1..{context_len}")
        src, dst = SIDES[move.kind]
        sides = (
            (src, move.src_pages, move.src_slot, reads),
            (dst, move.dst_pages, move.dst_slot, writes),
        )
        rank = MOVE_ORDER.index(move.kind)
        for tier, pages, slot, uses in sides:
            _check_side(what, tier, tiers[tier], pages, slot, move.pages(page_size))
            places = [("page", int(p)) for p in pages] + [("slot", slot)]
            if uses is writes:
                writes[tier] += places
                written_at[tier].update(dict.fromkeys(places, rank))
            else:
                for place in places:  # the earliest read of each place
                    reads[tier][place] = min(rank, reads[tier].get(place, rank))
    for slot in discards:
        if not 0 < slot <= tiers["disk"].slots:
            raise TierMoveRefused(f"discard of disk slot {slot} outside 1..{tiers['disk'].slots}")
    loaded = {m.src_slot for m in moves if m.kind == "load"} & set(discards)
    if loaded:
        raise TierMoveRefused(f"disk slot {min(loaded)} is discarded and loaded in one step")
    for tier in tiers:
        twice = [w for w, n in Counter(writes[tier]).items() if n > 1]
        if twice:
            kind, index = min(twice)
            raise TierMoveRefused(f"{tier} {kind} {index} is written twice")
        early = [p for p, at in written_at[tier].items() if at <= reads[tier].get(p, -1)]
        if early:
            kind, index = min(early)
            raise TierMoveRefused(f"{tier} {kind} {index} is written before a move reads it")


def _check_side(
    what: str, tier: str, cap: Capacity, pages: np.ndarray, slot: int, expected: int
) -> None:
    if tier in ("disk", "foreign"):
        if len(pages):
            raise TierMoveRefused(f"{what}: {len(pages)} pages on the disk side")
    elif len(pages) != expected:
        raise TierMoveRefused(f"{what}: {len(pages)} {tier} pages, its tokens need {expected}")
    elif int(pages.min()) < 1 or int(pages.max()) > cap.pages:
        raise TierMoveRefused(f"{what}: {tier} pages outside 1..{cap.pages}")
    elif len(np.unique(pages)) != len(pages):
        raise TierMoveRefused(f"{what}: a {tier} page named twice")
    if not 0 < slot <= cap.slots:
        raise TierMoveRefused(f"{what}: {tier} slot {slot} outside 1..{cap.slots}")
