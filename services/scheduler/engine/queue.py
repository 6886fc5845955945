"""The requests the core holds, by state: one table the core and its collaborators
(admission, endings, completion, faults) share, so none of them needs the core."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.records.request import Request


@dataclass
class RequestQueue:
    waiting: deque[Request] = field(default_factory=deque)  # in order; a retracted one first
    running: list[Request] = field(default_factory=list)
    by_rid: dict[str, Request] = field(default_factory=dict)  # every request not yet ended
