"""A session's durable record: what the session store persists for it, and how a
restarted scheduler takes its sessions back from those records.

A record carries the history always, the owner (a hash of the API key, never the key)
and, only while the session itself holds them (not lent to a turn, not borrowing cache
pages), its row, working Mamba slot and KV pages: only then can a restarted scheduler
take them over. A session closed, or closing during a turn, is recorded closed at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.allocators import handover
from services.scheduler.ownership.lease import new_lease

if TYPE_CHECKING:
    from services.scheduler.allocators.pools import Pools
    from services.scheduler.records.session import Session


class DurableRecords:
    """The records half of `SessionManager` (which provides these attributes)."""

    pools: Pools
    sessions: dict[str, Session]
    dirty: set[str]  # sessions whose record changed since the last `take_records`
    open: Callable[..., Session]

    def take_records(self) -> list[dict]:
        """What changed since the last call, as records the session store persists: the
        history always; the slots only while the session itself holds them (not lent to
        a turn, not borrowing cache pages), since only then can a restarted scheduler
        take them over."""
        out = []
        for sid in sorted(self.dirty):
            s = self.sessions.get(sid)
            if s is None or s.closing:
                out.append({"sid": sid, "closed": True})
                continue
            rec = {
                "sid": sid,
                "closed": False,
                "timeout": s.timeout,
                "tenant": s.tenant,  # its owner survives a restart (a hash, never a key)
                "history": s.history.astype(np.int32).tobytes(),
                "cached_len": s.cached_len,
                "row": None,
            }
            if s.slots is not None and s.slots.borrowed == 0:
                row = s.slots.row.slot
                rec |= {
                    "row": row,
                    "working": s.slots.working.slot,
                    "pages": self.pools.rows.row_pages(row, 0, s.cached_len).tobytes(),
                }
            out.append(rec)
        self.dirty.clear()
        return out

    def rebuild(self, records: list[dict], state_valid: bool) -> None:
        """A restarted scheduler takes its sessions back: the history always, the slots
        too when the executor that holds their contents is the same one."""
        for rec in records:
            if rec.get("closed"):
                continue
            session = self.open(rec["sid"], rec.get("timeout"), rec.get("tenant"), limited=False)
            session.history = np.frombuffer(rec["history"], dtype=np.int32).astype(np.int64)
            if not state_valid or rec.get("row") is None:
                continue
            owner, pools = session.owner, self.pools
            row, working = np.array([rec["row"]]), np.array([rec["working"]])
            pages = np.frombuffer(rec["pages"], dtype=np.int64).copy()
            pools.req.take(row, owner, "rebuild")
            pools.mamba.take(working, owner, "rebuild")
            pools.kv_pages.take(pages, owner, "rebuild")
            pools.kv.restore_row(int(row[0]), pages, rec["cached_len"])
            session.slots = handover.SessionSlots(
                owner,
                new_lease(pools.req, owner, int(row[0])),
                new_lease(pools.mamba, owner, int(working[0])),
            )
            session.cached_len = rec["cached_len"]
