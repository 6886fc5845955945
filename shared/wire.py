"""The wire contract: msgpack messages, each with a format version and the producer's
`(epoch, seq)`, so a consumer applies every message once (a duplicate has a seq it has
seen; a gap has one past the next it expects). Integer arrays travel as packed bytes.

Ownership messages (scheduler -> session store):
- `snapshot`: every pool's owner table; a consumer resets to it (start of an epoch, or
  after a gap).
- `events`: a batch of transfers, one record per moved slot: event number, pool, slot,
  giver, receiver; per event its reason; plus the names of owners declared since the last
  batch, so reports can name them.
- `idle`: the scheduler has nothing running; its own counts by owner kind per pool, to be
  compared with the consumer's.

The forward path (scheduler -> executor -> scheduler) is typed: shared/messages/forward.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

FORMAT_VERSION = 1


class WireError(ValueError):
    """A message that is not of this format: refused, never half-applied."""


def pack_ints(a: np.ndarray | list[int], dtype: str = "<i8") -> bytes:
    return np.asarray(a, dtype=dtype).tobytes()


def unpack_ints(b: bytes, dtype: str = "<i8") -> np.ndarray:
    return np.frombuffer(b, dtype=dtype)


def encode(kind: str, epoch: str, seq: int, body: dict) -> bytes:
    return msgpack.packb(
        {"v": FORMAT_VERSION, "kind": kind, "epoch": epoch, "seq": seq, **body}, use_bin_type=True
    )


def decode(raw: bytes) -> dict:
    try:
        msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several types for garbage
        raise WireError(f"undecodable message: {err}") from err
    if not isinstance(msg, dict) or msg.get("v") != FORMAT_VERSION:
        raise WireError(
            f"unsupported message format: {msg.get('v') if isinstance(msg, dict) else msg!r}"
        )
    for key in ("kind", "epoch", "seq"):
        if key not in msg:
            raise WireError(f"message without {key}")
    return msg


@dataclass
class EventBatch:
    """Transfers in ledger order, flattened to one record per moved slot."""

    first_event: int  # ledger seq of the first event in the batch
    reasons: list[str]  # per event
    event: np.ndarray  # per record: index of its event within the batch
    pool: np.ndarray
    slot: np.ndarray
    giver: np.ndarray
    receiver: np.ndarray
    owners: dict[int, str] = field(default_factory=dict)  # declared since the last batch

    def body(self) -> dict:
        return {
            "first": self.first_event,
            "reasons": self.reasons,
            "owners": self.owners,
            "event": pack_ints(self.event, "<i4"),
            "pool": pack_ints(self.pool, "<u1"),
            "slot": pack_ints(self.slot, "<i4"),
            "giver": pack_ints(self.giver),
            "receiver": pack_ints(self.receiver),
        }

    @classmethod
    def from_body(cls, msg: dict) -> EventBatch:
        try:
            batch = cls(
                msg["first"],
                list(msg["reasons"]),
                unpack_ints(msg["event"], "<i4"),
                unpack_ints(msg["pool"], "<u1"),
                unpack_ints(msg["slot"], "<i4"),
                unpack_ints(msg["giver"]),
                unpack_ints(msg["receiver"]),
                {int(k): str(v) for k, v in msg.get("owners", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise WireError(f"malformed events message: {err}") from err
        n = len(batch.slot)
        if not all(len(a) == n for a in (batch.event, batch.pool, batch.giver, batch.receiver)):
            raise WireError("events message: record arrays of different lengths")
        return batch

    @property
    def num_events(self) -> int:
        return len(self.reasons)
