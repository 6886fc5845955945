"""Tier moves on the wire: the copies that carry a session's state between the device,
the host tier and the disk tier, as a `Step` lists them (shared/messages/forward.py).

A move carries the whole state of one session as one unit: the KV of positions
`0..tokens-1` (its pages, page-granular, in every attention layer) and the Mamba conv
and SSM state after those positions (one slot, in every Mamba layer). Never KV without
its state: a KV hit without the state at the same position is worthless.

| kind        | source                         | destination                     |
|-------------|--------------------------------|---------------------------------|
| `hibernate` | device pages + device slot     | host pages + host slot          |
| `spill`     | host pages + host slot         | disk blob `dst_slot`            |
| `load`      | disk blob `src_slot`           | host pages + host slot          |
| `restore`   | host pages + host slot         | device pages + device slot      |
| `adopt`     | blob `src_slot` of replica `src_replica` | disk blob `dst_slot`  |

An `adopt` brings a session that moved here from another replica (migration): the blob
that replica's executor wrote is copied, checked whole and for the session and its
length, into a disk slot of this one. It reads `<state root>/replica-<src_replica>/`,
beside this executor's own directory: replicas that share a machine or a volume.

The executor runs a step's moves before its deferred clears and copies and its forward,
in this order: the blobs of `Step.discards` are deleted, then adopts, spills, hibernates,
loads, restores. Why that order is safe: the sources of spills (host) and of hibernates (device)
are already free in the scheduler's ledger when the step is planned, so that the same
step can reuse them, and every write to those tiers in the step comes later in the
order; the sources of loads (disk) and restores (host) stay held by a transit owner until
the step has run, because earlier moves of the same step write those tiers.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from shared.messages.envelope import I4, Arrays, WireError, array, empty
from shared.streams import REPLICA_ID

MoveKind = Literal["hibernate", "spill", "load", "restore", "adopt"]
MOVE_ORDER: tuple[MoveKind, ...] = ("adopt", "spill", "hibernate", "load", "restore")
DISK_SIDES = {"load": (True, False), "spill": (False, True), "adopt": (True, True)}


class TierMove(Arrays, kw_only=True):
    kind: MoveKind
    sid: str  # the session whose state moves: names its blob (checked at a load)
    tokens: int  # positions moved: the KV of 0..tokens-1 and the state after them
    src_pages: I4 = msgspec.field(default_factory=empty(I4))  # none from disk
    dst_pages: I4 = msgspec.field(default_factory=empty(I4))  # none to disk
    src_slot: int  # Mamba slot of the source tier; for a load, the disk slot (blob)
    dst_slot: int  # Mamba slot of the destination tier; for a spill, the disk slot
    owner: int = 0  # the ledger owner its destination is written for (0: not named)
    src_replica: str = ""  # an adopt's: the replica whose blob it copies

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.src_slot < 1 or self.dst_slot < 1:
            raise WireError(f"{self.kind} of {self.sid}: tokens and slots must be >= 1")
        if (self.kind == "adopt") != bool(REPLICA_ID.fullmatch(self.src_replica)):
            raise WireError(f"{self.kind} of {self.sid}: source replica {self.src_replica!r}")
        src_disk, dst_disk = DISK_SIDES.get(self.kind, (False, False))
        for side, pages, disk in (
            ("source", self.src_pages, src_disk),
            ("destination", self.dst_pages, dst_disk),
        ):
            n = len(pages)
            if disk != (n == 0) or (n and np.any(pages < 1)):
                raise WireError(f"{self.kind} of {self.sid}: {n} {side} pages")
        src, dst = len(self.src_pages), len(self.dst_pages)
        if src and dst and src != dst:
            raise WireError(f"{self.kind} of {self.sid}: {src} pages to {dst}")

    @classmethod
    def of(
        cls,
        kind: MoveKind,
        sid: str,
        tokens: int,
        src_slot: int,
        dst_slot: int,
        src_pages: np.ndarray | list[int] = (),
        dst_pages: np.ndarray | list[int] = (),
        owner: int = 0,
        src_replica: str = "",
    ) -> TierMove:
        return cls(
            kind=kind,
            sid=sid,
            tokens=tokens,
            src_pages=array(src_pages, I4),
            dst_pages=array(dst_pages, I4),
            src_slot=src_slot,
            dst_slot=dst_slot,
            owner=owner,
            src_replica=src_replica,
        )

    def pages(self, page_size: int) -> int:
        """KV pages the move carries (each side that is not disk holds this many)."""
        return -(-self.tokens // page_size)
