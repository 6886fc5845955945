"""One streaming session: its committed history and, between turns, its state slots;
for a chat session, the conversation its history renders (docs/chat.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from services.scheduler.allocators.handover import SessionSlots
from services.scheduler.allocators.request_slots import RequestSlots
from services.scheduler.allocators.tier_slots import DiskState, HostState
from services.scheduler.cache.node import CacheNode
from services.scheduler.ownership.lease import Lease
from services.scheduler.ownership.owners import Owner
from services.scheduler.records.response_tree import ResponseTree
from services.scheduler.records.sampling import InvalidRequest
from services.scheduler.records.turn_tree import TurnTree
from shared.messages.ownership import ChatEntry
from shared.placement import FIRST_EPOCH
from shared.session_ids import session_name

ARRIVED = "-"  # `Session.arrival` of a copy a move without a nonce brought (an older front)


class SessionError(InvalidRequest):
    """A session-level refusal: unknown, closed, busy or a bad id."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        # "not_found", "closed", "busy", "conflict", "invalid", "limit", "moving",
        # "rebuilding", "fenced"
        self.kind = kind


TURN_NAME = "turn_rid"  # set by the route, never by a client: the turn's own shown id


def check_session_params(params: dict, session: Session) -> None:
    """A streaming session's history is append-only (scenario S9, docs/scenarios.md), as
    SGLang's streaming sessions are: a turn continues from the session's latest turn
    (`rid` absent, null or that turn's id) with nothing cut (`offset` absent, 0 or the
    history's length, as SGLang reads 0: no cut). Naming an earlier turn, cutting,
    replacing or dropping output is refused, naming the field, never silently appended
    to the latest history."""
    rid = params.get("rid")
    if rid is not None and rid != session.last_rid:
        latest = repr(session.last_rid) if session.last_rid else "none yet"
        raise SessionError(
            f"session_params.rid {rid!r} is not the session's latest turn ({latest}): a "
            "session continues only from its latest turn (it cannot branch); send rid "
            "null or the latest turn's id",
            "invalid",
        )
    rewrites = [k for k in ("replace", "drop_previous_output") if params.get(k)]
    if params.get("offset") not in (None, 0, len(session.history)):
        rewrites.insert(0, "offset")
    if rewrites:
        raise SessionError(
            f"{', '.join(rewrites)} not supported on a streaming session: its history is "
            "append-only; send only the new input",
            "invalid",
        )


@dataclass(eq=False)
class TurnStart:
    """What a session turn must return to if it is aborted or retracted."""

    cached_len: int  # positions the session had computed when the turn began
    rollback: Lease | None  # a copy of the session's state at that moment (session-owned)


class Turn(Protocol):
    """What a session reads of its turn in flight: a `Request` (records/request.py), which
    refers to its session; a Protocol keeps the two records out of an import cycle."""

    rid: str
    slots: RequestSlots | None
    turn_start: TurnStart | None


@dataclass(eq=False)
class Session:
    sid: str  # its scoped id (shared/session_ids.py)
    owner: Owner  # session:<sid>
    timeout: float | None  # seconds idle before it is closed; None: never
    last_used: float
    history: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    cached_len: int = 0  # positions of `history` whose KV and state the slots hold
    slots: SessionSlots | None = None  # its state on the device, between turns
    host: HostState | None = None  # or hibernated in the host tier
    disk: DiskState | None = None  # or spilled to the disk tier; at most one of the three
    cache_node: CacheNode | None = None  # locked cache node whose KV the row borrows
    turn: Turn | None = None  # the turn in flight (a Request), at most one
    closing: bool = False  # close asked while a turn runs: completes when it ends
    closed: bool = False
    tenant: str | None = None  # sha256 of the opening API key, never the key; None: keys off
    chat: tuple[ChatEntry, ...] | None = None  # the conversation; None: raw tokens or empty
    moving: bool = False  # leaving for another replica: no turn starts (SessionManager.leave)
    leaves: int = 0  # times it began to leave: a check that read the directory meanwhile is void
    epoch: int = FIRST_EPOCH  # its placement's epoch here (shared/placement.py)
    routed: bool = False  # placed in the directory (by a router): no placement means gone
    # the attempt (`Move.nonce`, or `ARRIVED` for one without) of the move that brought
    # it here, until the directory shows it placed here (directory_check.py `settle`)
    arrival: str = ""
    last_rid: str = ""  # the id of its latest finished turn (session_params.rid names it)
    turns: TurnTree = field(default_factory=TurnTree)  # its /generate turns (turn_tree.py)
    streaming: bool = False  # opened append-only (`check_session_params`): never branches
    responses: ResponseTree = field(default_factory=ResponseTree)  # response_tree.py
    # a retention hint (sessions/tier_policy.py): it counts for `retain_ttl` seconds
    # after the session's last use
    retain_ttl: float = 0.0
    retain_priority: int = 0

    @property
    def in_doubt(self) -> bool:
        """A move's copy whose fate only the directory knows: leaving (`moving`), or
        arrived and not yet seen placed here. Its settle from the router may be lost."""
        return self.moving or bool(self.arrival)

    @property
    def name(self) -> str:
        """What its client calls it."""
        return session_name(self.sid)

    @property
    def state_in_use(self) -> bool:
        """A turn runs on the state. A turn still waiting for admission has not taken it:
        pressure may move or drop it as it would an idle session's (the turn then starts
        from the tier it reached, or re-prefills), or a waiting request that needs the
        room could wait for ever behind one that cannot run before it."""
        return self.turn is not None and self.turn.slots is not None

    @property
    def state_tier(self) -> str | None:
        """Where its state is between turns; None: nowhere (its next turn re-prefills)."""
        if self.slots is not None:
            return "device"
        if self.host is not None:
            return "host"
        return "disk" if self.disk is not None else None

    @property
    def state_ready(self) -> bool:
        """No step in flight still writes its state (wherever it is)."""
        state = self.slots or self.host or self.disk
        return state is None or state.ready
