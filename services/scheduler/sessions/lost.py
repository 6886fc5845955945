"""Sessions the session store lost: a gap in the ownership stream that only a dead
scheduler life could have filled (services/session_store/consumer.py) left their records
unprovable, so the store dropped them and listed them (`Keys.lost`). This replica holds
each, by the epoch of its placement, only to tell its client so: every turn is refused
`session_lost` (410, final), and the client's close ends it (its placement is taken away
as a closed session's). The placement stays until then, so every front keeps sending the
session's requests here rather than answering 404."""

from __future__ import annotations

from services.scheduler.records.session import SessionError
from shared.session_ids import session_name


class LostSessions:
    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}

    def __contains__(self, sid: str) -> bool:
        return sid in self._epochs

    def add(self, sid: str, epoch: int) -> None:
        self._epochs[sid] = epoch

    def pop(self, sid: str) -> int | None:
        """`sid`'s placement epoch if it was lost here (it is not any more)."""
        return self._epochs.pop(sid, None)

    def refusal(self, sid: str) -> SessionError:
        return SessionError(
            f"session {session_name(sid)} was lost: the session store could not prove its "
            "history current after a fault; open a new session and send the whole "
            "conversation",
            "lost",
        )
