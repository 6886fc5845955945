"""A session's placement: which replica owns it, under which epoch, and, while it moves,
which replica it is moving to (docs/scaleout.md, "Moving a session").

The value of `streams.placement_key(sid)` is `"<replica> <epoch>"`, or
`"<replica> <epoch> <target> <attempt>"` while the session is in transit (`<attempt>`: the
move's nonce; a move begun by a build before attempts has none). In transit is an owner
of its own, written to Redis before any replica is asked to do anything, so it survives
the router that began the move: every router answers the session's turns 503 while it
lasts, and a router that finds the move abandoned finishes or undoes it. The epoch grows
by one at every move: a replica holding a copy of an older epoch (left behind by a move
whose last step never ran) knows that copy is stale.

The attempt is in the value because an undone move leaves the same epoch: two attempts
of the same move (same source, target and epoch) would otherwise write the same value in
transit, and a front taking over the first, undone, attempt while the second is under
way would find "its" move in transit and carry it, onto a stale copy it had left on the
target (the model checker found it: tests/protocol/, a lost turn after two faults). With
the attempt in the value, every compare-and-set of a move is its own attempt's.

A move is also listed in `streams.MOVES` (a sorted set scored by the moment its router's
lease on it ends) as a `Move`, so an abandoned one is found without scanning every
placement, and its cleanup runs even after the placement has changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.streams import PLACEMENT_CHANGES, REPLICA_ID

FIRST_EPOCH = 1
MOVE_NONCE = re.compile(r"[0-9a-f]{1,32}")  # `Move.nonce`: hex, as `secrets.token_hex` writes
# Sent by a router with the opens it places: the replica then knows that a session of its
# without a placement was closed (or moved and closed) elsewhere (a session opened straight
# on a scheduler has no placement at all).
PLACED_HEADER = "X-Custody-Placed"
# Sent back by a replica with each open it answers: "<scheduler epoch> <n>", the open being
# that scheduler's n-th. Its registration counts its opens the same way ("opened"), so a
# router knows exactly when a registration it reads has taken in an open it sent.
OPENED_HEADER = "X-Custody-Opened"
# on a request for a placed session: the placement epoch the front routed it by (a replica
# refuses it at another epoch: protocol/copies.py, `routed_to`)
ROUTED_EPOCH_HEADER = "X-Custody-Epoch"


def opened_mark(epoch: str, opened: int) -> str:
    """The `OPENED_HEADER` value of a scheduler's `opened`-th open."""
    return f"{epoch} {opened}"


def read_opened_mark(value: str | None) -> tuple[str, int] | None:
    """(epoch, n) of an `OPENED_HEADER` value; None when absent or malformed."""
    epoch, _, number = (value or "").rpartition(" ")
    return (epoch, int(number)) if epoch and number.isdigit() else None


# Remove a placement only if it is still exactly ARGV[1]: a replica closing a session
# takes its placement away, never one a move or a new open has written since. Every
# write of a placement publishes it (`streams.PLACEMENT_CHANGES`).
UNPLACE = f"""if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', '{PLACEMENT_CHANGES}', KEYS[1])  -- a removal
  return 1
end
return 0"""


@dataclass(frozen=True)
class Placement:
    replica: str
    epoch: int = FIRST_EPOCH
    moving_to: str | None = None
    attempt: str = ""  # while in transit: the move's nonce

    def encode(self) -> str:
        parts = [self.replica, str(self.epoch)]
        if self.moving_to is not None:
            parts += [self.moving_to, *([self.attempt] if self.attempt else [])]
        return " ".join(parts)

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Placement | None:
        """The placement stored as `raw` (None: the session is placed nowhere). A value
        written before epochs existed (a bare replica id) is at the first epoch."""
        if raw is None:
            return None
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        parts = text.split(" ")
        if not all(REPLICA_ID.fullmatch(p) for p in parts[:1] + parts[2:3]):
            raise ValueError(f"not a placement: {text!r}")
        if len(parts) == 1:
            return cls(parts[0])
        if len(parts) in (2, 3) and parts[1].isdigit():
            return cls(parts[0], int(parts[1]), parts[2] if len(parts) == 3 else None)
        if len(parts) == 4 and parts[1].isdigit() and MOVE_NONCE.fullmatch(parts[3]):
            return cls(parts[0], int(parts[1]), parts[2], parts[3])
        raise ValueError(f"not a placement: {text!r}")

    def names(self, replica: str) -> bool:
        """Whether `replica` owns the session, or is taking it over."""
        return replica in (self.replica, self.moving_to)


@dataclass(frozen=True)
class Move:
    """One move of `sid` from `source` at `epoch` to `target` (which takes it at epoch + 1).

    `nonce` names this attempt: two attempts of the same session between the same
    replicas from the same epoch (one aborted, then one begun again) are the same move
    but for it, and a copy the aborted one left on the target must never pass for the
    second one's arrival. A move listed by a build without nonces has "": it matches no
    arrival, so its retry copies again."""

    sid: str
    source: str
    target: str
    epoch: int
    nonce: str = ""

    @property
    def before(self) -> Placement:
        return Placement(self.source, self.epoch)

    @property
    def in_transit(self) -> Placement:
        return Placement(self.source, self.epoch, self.target, self.nonce)

    @property
    def after(self) -> Placement:
        return Placement(self.target, self.epoch + 1)

    def encode(self) -> str:
        text = f"{self.sid} {self.source} {self.target} {self.epoch}"
        return f"{text} {self.nonce}" if self.nonce else text

    @classmethod
    def decode(cls, raw: bytes | str) -> Move:
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        parts = text.split(" ")
        if len(parts) not in (4, 5) or not parts[3].isdigit():
            raise ValueError(f"not a move: {text!r}")
        if len(parts) == 5 and not MOVE_NONCE.fullmatch(parts[4]):
            raise ValueError(f"not a move: {text!r}")
        return cls(parts[0], parts[1], parts[2], int(parts[3]), *parts[4:])
