"""One streaming session: its committed history and, between turns, its state slots;
for a chat session, the conversation its history renders (docs/chat.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from services.scheduler.allocators.handover import SessionSlots
from services.scheduler.allocators.tier_slots import DiskState, HostState
from services.scheduler.cache.node import CacheNode
from services.scheduler.ownership.owners import Owner
from services.scheduler.records.sampling import InvalidRequest
from shared.messages.ownership import ChatEntry
from shared.placement import FIRST_EPOCH
from shared.session_ids import session_name

if TYPE_CHECKING:
    from services.scheduler.records.request import Request


class SessionError(InvalidRequest):
    """A session-level refusal: unknown, closed, busy or a bad id."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        # "not_found", "closed", "busy", "conflict", "invalid", "limit", "moving",
        # "rebuilding", "fenced"
        self.kind = kind


def check_session_params(params: dict) -> None:
    """History is append-only: splicing or replacing it is refused (scenario S9,
    docs/scenarios.md)."""
    rewrites = [k for k in ("offset", "replace", "drop_previous_output") if params.get(k)]
    if params.get("offset") == 0 and "offset" not in rewrites:
        rewrites.append("offset")
    if rewrites:
        raise SessionError(
            f"{', '.join(rewrites)} not supported on a streaming session: its history is "
            "append-only; send only the new input",
            "invalid",
        )


@dataclass(eq=False)
class ChatTurn:
    """What a chat turn hands its session, prepared by the HTTP edge (which owns the
    template) so the engine never renders: the history length its new tokens follow,
    the conversation's entries through the prompt, and `reply`, which gives the reply's
    entry and the canonical history (the conversation with the reply, rendered without
    a generation prompt and tokenized), or None if that cannot be rendered."""

    base: int
    messages: tuple[ChatEntry, ...]
    reply: Callable[[Request], tuple[ChatEntry, np.ndarray] | None]


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
    turn: Request | None = None  # the turn in flight, at most one
    closing: bool = False  # close asked while a turn runs: completes when it ends
    closed: bool = False
    tenant: str | None = None  # sha256 of the opening API key, never the key; None: keys off
    chat: tuple[ChatEntry, ...] | None = None  # the conversation; None: raw tokens or empty
    moving: bool = False  # leaving for another replica: no turn starts (sessions/migration.py)
    epoch: int = FIRST_EPOCH  # its placement's epoch here (shared/placement.py)
    routed: bool = False  # placed in the directory (by a router): no placement means gone

    @property
    def name(self) -> str:
        """What its client calls it."""
        return session_name(self.sid)

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
