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

A `step` (scheduler -> executor, `step_body`) is read by the session store too: it names
the ledger point it was planned at and whom each of its writes is for.
"""

from __future__ import annotations

from collections.abc import Mapping
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


@dataclass
class WireRow:
    """One row of a forward step, as the executor needs it."""

    rid: str
    tokens: np.ndarray
    start: int
    kv_indices: np.ndarray
    mamba_slot: int  # the state is read from here
    mamba_out: int  # and written here after the step's tokens
    snapshot_slot: int
    snapshot_len: int
    sample: bool
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    future: bool = False  # tokens[0] is a placeholder for the token the step before sampled
    # Who the row writes for (ledger owner ids; 0: not named). The executor ignores them;
    # the session store checks each write against its own ledger.
    owner: int = 0  # the request: owns mamba_out and the KV pages of start..end
    track_owner: int = 0  # the request's track: owns snapshot_slot
    session_owner: int = 0  # the session whose turn this is: may own op destinations

    def body(self) -> dict:
        return {
            "rid": self.rid,
            "tokens": pack_ints(self.tokens, "<i4"),
            "start": self.start,
            "kv": pack_ints(self.kv_indices, "<i4"),
            "slot": self.mamba_slot,
            "out": self.mamba_out,
            "snap_slot": self.snapshot_slot,
            "snap_len": self.snapshot_len,
            "sample": self.sample,
            "t": self.temperature,
            "p": self.top_p,
            "k": self.top_k,
            "seed": self.seed,
            "future": self.future,
            "owner": self.owner,
            "track": self.track_owner,
            "session": self.session_owner,
        }

    @classmethod
    def from_body(cls, b: dict) -> WireRow:
        return cls(
            b["rid"],
            unpack_ints(b["tokens"], "<i4").astype(np.int64),
            b["start"],
            unpack_ints(b["kv"], "<i4").astype(np.int64),
            b["slot"],
            b["out"],
            b["snap_slot"],
            b["snap_len"],
            bool(b["sample"]),
            float(b["t"]),
            float(b["p"]),
            int(b["k"]),
            b["seed"],
            bool(b["future"]),
            int(b.get("owner", 0)),
            int(b.get("track", 0)),
            int(b.get("session", 0)),
        )


def step_body(
    step: int,
    after: int | None,
    executor_epoch: str,
    rows: list[WireRow],
    clears: list[int],
    copies: list[tuple[int, int]],
    *,
    ledger_seq: int | None = None,
    page_size: int = 0,
    op_owners: Mapping[int, int] | None = None,
) -> dict:
    """`after`: the step this one was planned on top of (its rows read the state that
    step writes and its future tokens are that step's samples); None when it builds on
    nothing in flight. An executor refuses a step whose `after` it did not just run.

    For the session store's check of what the step writes: `ledger_seq`, the number of
    ownership events the scheduler's ledger held when the step was planned (every slot
    the step writes must be its writer's at exactly that point); `page_size`, to turn
    KV indices into the pages the ledger counts; `op_owners`, the owner id each clear or
    copy destination is written for (sent as arrays parallel to `clears` and `copies`)."""
    owners = op_owners or {}
    return {
        "step": step,
        "after": after,
        "executor_epoch": executor_epoch,
        "rows": [r.body() for r in rows],
        "clears": pack_ints(clears, "<i4"),
        "copies": pack_ints(copies, "<i4"),
        "ledger_seq": ledger_seq,
        "page_size": page_size,
        "clear_owners": pack_ints([owners.get(s, 0) for s in clears]),
        "copy_owners": pack_ints([owners.get(d, 0) for _, d in copies]),
    }


def result_body(
    step: int,
    scheduler_epoch: str,
    executor_epoch: str,
    rids: list[str],
    tokens: list[int],
    logprobs: list[float],
    error: str | None = None,
    ops_ran: bool = False,
) -> dict:
    """`error`: the step was refused or failed, naming why. `ops_ran` (with an error): all
    its deferred ops had been applied when it failed, so a rollback copy they made holds
    the state it copied. False (or absent: an older executor): the forward did not run,
    and the sources of its copies hold what they held; its destinations may not."""
    return {
        "step": step,
        "scheduler_epoch": scheduler_epoch,  # step ids restart with each scheduler life
        "executor_epoch": executor_epoch,
        "rids": rids,
        "tokens": pack_ints(tokens, "<i4"),
        "logprobs": pack_ints(logprobs, "<f4"),
        "error": error,
        "ops_ran": ops_ran,
    }
