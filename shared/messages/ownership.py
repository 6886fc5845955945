"""What the scheduler tells the session store on the ownership stream, one Struct per
kind, and the session record both services persist and read back:

- `Snapshot`: every pool's owner table; a consumer resets to it (start of an epoch, or
  after a gap).
- `Events`: a batch of transfers, one record per moved slot (event number, pool, slot,
  giver, receiver), per event its reason, and the names of the owners declared since the
  last batch, so reports can name them.
- `SessionRecords`: the session records that changed, and the executor epoch their slots
  are valid on.
- `Idle`: the scheduler has nothing running; its own counts by owner kind per pool, to be
  compared with the consumer's.

Each checks itself as it is decoded (arrays of whole items and of equal lengths,
events numbered inside the batch, a snapshot's tables as long as their pools), so a
consumer never meets a message it would half-apply.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import msgspec
import numpy as np

from shared.messages.envelope import I4, I8, U1, Arrays, Decoder, Message, WireError, array, encode

OWNER = I8  # owner ids (shared/owners.py), in owner tables and transfers


class PoolTable(Arrays, kw_only=True):
    """One pool of a snapshot: its owner per slot, slot 0 (the sink) included."""

    id: int
    name: str
    capacity: int
    owners: OWNER  # capacity + 1 of them

    def __post_init__(self) -> None:
        if len(self.owners) != self.capacity + 1:
            raise WireError(f"snapshot of pool {self.name}: {len(self.owners)} owners")


class Snapshot(Message, tag="snapshot"):
    """Every pool's owner table, events up to `next_event` folded in."""

    pools: list[PoolTable]  # in pool id order: events name pools by id
    owners: dict[int, str]  # names of the live owners
    next_event: int

    def __post_init__(self) -> None:
        if [p.id for p in self.pools] != list(range(len(self.pools))):
            raise WireError(f"snapshot pools numbered {[p.id for p in self.pools]}")


class Transfers(NamedTuple):
    """An `Events` batch's records, one per moved slot, as arrays."""

    event: np.ndarray  # index of its event within the batch
    pool: np.ndarray
    slot: np.ndarray
    giver: np.ndarray
    receiver: np.ndarray


class Events(Message, Arrays, tag="events"):
    """Transfers in ledger order, flattened to one record per moved slot, so a consumer
    replays them in a tight loop."""

    first: int  # ledger number of the batch's first event
    reasons: list[str]  # per event
    event: I4  # per record: the index of its event within the batch
    pool: U1
    slot: I4
    giver: OWNER
    receiver: OWNER
    owners: dict[int, str] = msgspec.field(default_factory=dict)  # declared since the last

    @classmethod
    def of(
        cls,
        epoch: str,
        seq: int,
        first: int,
        reasons: list[str],
        records: Transfers,
        owners: dict[int, str],
    ) -> Events:
        return cls(
            epoch=epoch,
            seq=seq,
            first=first,
            reasons=reasons,
            event=array(records.event, I4),
            pool=array(records.pool, U1),
            slot=array(records.slot, I4),
            giver=array(records.giver, OWNER),
            receiver=array(records.receiver, OWNER),
            owners=owners,
        )

    def __post_init__(self) -> None:
        """Each array holds whole items (checked as it was decoded); here, that they are
        as long as each other and that each record names an event of the batch."""
        lengths = [len(a) for a in self.records()]
        if len(set(lengths)) > 1:
            raise WireError(f"events: record arrays of lengths {lengths}")
        ev = self.event
        if len(ev) and (
            ev[0] < 0 or ev[-1] >= len(self.reasons) or (len(ev) > 1 and (ev[1:] < ev[:-1]).any())
        ):
            raise WireError(f"events: records numbered outside 0..{len(self.reasons) - 1}")

    def records(self) -> Transfers:
        return Transfers(self.event, self.pool, self.slot, self.giver, self.receiver)

    @property
    def num_events(self) -> int:
        return len(self.reasons)


class ChatEntry(msgspec.Struct, array_like=True, frozen=True):
    """One message of a chat session's conversation (docs/chat.md): a digest of it as the
    template saw it, and `end`, the length of the canonical tokens of the conversation
    through it (the template's rendering up to it, without a generation prompt)."""

    digest: str
    end: int


class TurnEntry(Arrays, array_like=True):
    """One finished `/generate` turn of a session, as its turn tree keeps it
    (services/scheduler/sessions/turn_tree.py): its tokens are the first `base` tokens
    of its parent's (none for a root), then its own `input`, then its `output`. `id`
    numbers it within its session (a client may reuse a `rid`); `parent` 0: a root."""

    id: int
    rid: str
    parent: int
    base: int
    input: I4
    output: I4


class ResponseEntry(msgspec.Struct, array_like=True, frozen=True):
    """One stored response of a session (the OpenAI Responses API, docs/api.md): `parent`
    the response it continued ("": a conversation's first), `messages` the JSON list of
    template messages it added to its parent's conversation (its input, then its reply),
    `body` the JSON response object its `GET` returns, with its input items beside it.
    `deleted`: named no more, kept while a response below it continues its conversation."""

    id: str
    parent: str
    messages: bytes
    body: bytes
    deleted: bool = False


class SessionRecord(Arrays, kw_only=True, omit_defaults=True):
    """A session's durable record: the history always, and its row, working Mamba slot
    and KV pages only while the session itself holds them (then a restarted scheduler
    can take them over), or the disk slot of its blob once the blob is valid. A closed
    session's record carries only its sid. The store persists it as sent, with the
    executor epoch of its message, which is what a restarted scheduler decodes."""

    sid: str
    closed: bool = False
    timeout: float | None = None  # seconds idle before it is closed; None: never
    tenant: str | None = None  # a hash of the opening API key, never the key
    history: I4 | None = None  # its tokens
    cached_len: int = 0  # positions of the history the slots hold
    row: int | None = None
    working: int | None = None
    pages: I8 | None = None  # its KV pages
    # how many of `pages`, from the first, are the prefix cache's, which the session
    # borrows (docs/ownership.md, "Shared prefixes"), and the namespace of that prefix
    shared_pages: int = 0
    cache_namespace: str = ""
    executor: str | None = None  # as persisted: the executor epoch the slots belong to
    disk: int | None = None  # or: the disk slot of its valid blob, of cached_len positions
    chat: list[ChatEntry] | None = None  # its conversation; None: raw tokens or empty
    last_rid: str = ""  # its latest finished turn's request id (session_params.rid)
    # the placement epoch it was written under; None: a session no router placed. The
    # store refuses the record once the directory has moved on (a replica woken late)
    epoch: int | None = None
    # the move attempt that brought it, until the directory confirmed it here: a life
    # started meanwhile takes it back only for that attempt (protocol/lives.py)
    arrival: str = ""
    turns: list[TurnEntry] = msgspec.field(default_factory=list)  # its turn tree, oldest first
    streaming: bool = False  # append-only: its turns never branch
    responses: list[ResponseEntry] = msgspec.field(default_factory=list)  # oldest first

    def __post_init__(self) -> None:
        slots = (self.row, self.working, self.pages)
        if self.closed:
            rest = (self.timeout, self.tenant, self.history, self.disk, self.chat, *slots)
            rest += (self.epoch,)
            if (
                self.cached_len
                or self.shared_pages
                or self.cache_namespace
                or self.last_rid
                or self.turns
                or self.streaming
            ):
                raise WireError(f"the record of closed session {self.sid} carries more")
            if any(x is not None for x in rest):
                raise WireError(f"the record of closed session {self.sid} carries more")
            return
        if self.history is None:
            raise WireError(f"the record of session {self.sid} has no history")
        if any(x is None for x in slots) != all(x is None for x in slots):
            raise WireError(f"the record of session {self.sid} names some of its slots")
        if self.disk is not None and (self.row is not None or self.disk < 1):
            raise WireError(f"the record of session {self.sid} names a blob {self.disk}")
        if not 0 <= self.shared_pages <= len(self.kv_pages()):
            raise WireError(
                f"the record of session {self.sid} shares {self.shared_pages} of its "
                f"{len(self.kv_pages())} pages"
            )
        ends = [entry.end for entry in self.chat or ()]
        if any(b < a for a, b in pairwise([0, *ends])):
            raise WireError(f"the record of session {self.sid} has chat spans out of order")

    def tokens(self) -> np.ndarray:
        return array((), I4) if self.history is None else self.history

    def kv_pages(self) -> np.ndarray:
        return array((), I8) if self.pages is None else self.pages


class SessionRecords(Message, tag="sessions"):
    """Session records that changed; their slots are valid only on `executor`. A `full`
    message carries every open session of the scheduler (sent after each snapshot, once
    a restarted scheduler has taken back its sessions: before, it cannot name them all):
    the store forgets any record it holds that the message does not name, so records
    lost in a gap are made whole again."""

    records: list[SessionRecord]
    executor: str | None  # the executor epoch when they were taken
    full: bool = False


class Idle(Message, tag="idle"):
    """The scheduler runs nothing: its counts by owner kind, per pool name."""

    counts: dict[str, dict[str, int]]


OwnershipMessage = Snapshot | Events | SessionRecords | Idle
MESSAGES = Decoder(OwnershipMessage)  # what the session store reads off the stream
RECORDS = Decoder(SessionRecord)  # what a restarted scheduler reads back from the store


def encode_record(record: SessionRecord) -> bytes:
    """A record as the session store persists it (decoded with `RECORDS`)."""
    return encode(record)
