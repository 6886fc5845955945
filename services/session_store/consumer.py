"""Consumes the ownership stream into the independent ledger, exactly once.

Entries are read through a consumer group: this consumer's pending entries first (what
a previous life of it read but did not acknowledge), then new ones. Each message is
applied once by its `(epoch, seq)`: a duplicate is acknowledged and dropped, a gap is
reported and a snapshot requested. After applying, the ledger's checkpoint and the
acknowledgements are written in one transaction, so a restart resumes from the
checkpoint and the still-pending entries, never applying anything twice.

The records are current only while no message was lost: `records_through` (in the
checkpoint) is the last stream entry up to which every session record on the stream has
been applied (it stops at the last entry before a gap, even within one batch read). A
gap stops it until a snapshot's `full` set of records (every open session, shipped with
each snapshot once its life has taken back its sessions) has replaced what the gap may
have lost. A restarted
scheduler, or a replica taking a session over, reads from the records only once
`records_through` has passed the stream's end as it saw it (shared/records_proof.py).

A gap only the scheduler life that wrote it can fill ends in a decision when that life is
gone (a snapshot of another epoch comes first): nothing can prove its sessions' records
current any more, and a record a turn short would answer wrong, so every session recorded
then is lost (`Keys.lost`, counted in `sessions_lost`), its record dropped. Its client
hears so (`session_lost`) instead of a 503 for ever: the new life waits for a proof, the
proof for a full set, and the full set for the new life's sessions to be taken back. A
message of an epoch never seen (its snapshot was lost in the gap) is a gap too.

A message that does not decode as one of shared/messages/ownership.py's kinds (or
names slots the ledger lacks) is refused whole: counted in `refused`, its reason kept in
`last_refused` (both on `/ledger` and `/metrics`), acknowledged, and treated as a gap,
since what it carried is lost: a snapshot is requested. Entries marked `k` = `cache`
(the prefix cache's messages for the routers, shared/messages/cache.py) are acknowledged
undecoded: they are not the store's, and not malformed.

Before applying what it read, it reads the forward stream to its end, so the write
checker (write_checker.py) has every step it must check within those messages; the
steps it has read are acknowledged in the same transaction as the checkpoint.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import msgpack
import msgspec
import redis

from protocol import records
from services.session_store.ledger_replay import (
    CHECKPOINT_PAGE,
    KEEP_VIOLATIONS,
    IndependentLedger,
    Violation,
)
from services.session_store.record_check import check_records
from services.session_store.write_checker import WriteChecker
from shared import records_proof, streams
from shared.messages.cache import CACHE_KIND
from shared.messages.envelope import WIRE_DTYPES, WireError, pack, unpack
from shared.messages.ownership import (
    MESSAGES,
    OWNER,
    Events,
    Idle,
    SessionRecord,
    SessionRecords,
    Snapshot,
    encode_record,
)
from shared.placement import Placement

log = logging.getLogger("custody.session_store")
PAST_EPOCHS = 16  # epochs remembered as left behind (a restart a life, at most a few late)


class OwnershipConsumer:
    def __init__(
        self,
        client: redis.Redis,
        name: str,
        ledger: IndependentLedger | None = None,
        keys: streams.Keys = streams.SINGLE,
    ) -> None:
        self.client, self.name, self.keys = client, name, keys
        self.stream, self.group = keys.ownership, streams.STORE_GROUP
        self.ledger = ledger or IndependentLedger()
        self.checker = WriteChecker(client, name, keys.forward)
        self.epoch: str | None = None
        self.seq = 0
        self.duplicates = 0
        self.refused = 0  # messages refused as malformed
        self.fenced = 0  # session records refused: written under an epoch left behind
        self.last_refused: str | None = None  # why the latest was
        self._writes: list[SessionRecord] = []  # to persist with the next checkpoint
        self._full: set[str] | None = None  # a full set applied: every sid it named
        self.records_complete = True  # no session record lost since the last full set
        self.records_through = records_proof.NO_STREAM  # every record applied up to it
        self.gap_epoch: str | None = None  # the epoch whose records a gap left incomplete
        self.lost_epoch: str | None = None  # the last epoch whose records were decided lost
        self.past_epochs: list[str] = []  # epochs left behind: their late tails are dropped
        self.sessions_lost = 0  # sessions lost by a decision on an unfillable gap
        self.last_entry = records_proof.NO_STREAM  # the last stream entry handled
        self._lose = False  # every recorded session is to be lost with the next write
        self._maybe_pending = True  # entries read but not acknowledged may be there
        self._stale_fields: list[str] = []  # a whole-table checkpoint's, read once
        streams.ensure_group(client, self.stream, self.group)
        self._load_checkpoint()

    # ---- reading ----
    def poll(self, block_ms: int = 100, count: int = 64) -> int:
        """Read and apply what is there (pending first); returns entries handled. The
        pending entries are read only while some may be there, not with every poll (a
        round trip each time for nothing): in a life's first poll, and after any read or
        write that did not finish, since Redis may have delivered entries whose reply was
        lost, or kept those whose write it refused."""
        if self._writer_gone(self._fenced_by()):  # nothing more may come from it
            self._decide_lost()
            self._handle([])
        if self._maybe_pending:
            entries = self._read("0", count, None)
            if entries:
                return self._handle(entries)  # drain pending fully before taking new ones
            self._maybe_pending = False
        return self._taken(lambda: self._read(">", count, block_ms))

    def claim_stale(self, min_idle_ms: int = 10_000) -> int:
        """Take over entries a dead consumer of the group read but never acknowledged."""

        def claim() -> list:
            _, entries, _ = self.client.xautoclaim(
                self.stream, self.group, self.name, min_idle_ms, "0-0", count=256
            )
            return entries

        return self._taken(claim)

    def _read(self, start: str, count: int, block_ms: int | None) -> list:
        reply = self.client.xreadgroup(
            self.group, self.name, {self.stream: start}, count=count, block=block_ms
        )
        return reply[0][1] if reply else []

    def _taken(self, take: Callable[[], list]) -> int:
        """Handle the entries `take` makes this consumer's own: pending from the moment
        it is called (its reply may be lost on the way) until they are handled."""
        self._maybe_pending = True
        handled = self._handle(take())
        self._maybe_pending = False
        return handled

    # ---- applying ----
    def _handle(self, entries: list) -> int:
        """Apply `entries`, then write what they changed (and a decision taken before
        them) in one transaction with the checkpoint and their acknowledgements."""
        if not entries and not self._lose:
            return 0
        self.checker.read()  # every step planned before these messages' events is there
        self._steps_due()
        for entry, fields in entries:
            # An entry trimmed before it was read has no fields, and one for the routers
            # (the prefix cache's, `k` = cache) is none of the store's: just ack them.
            if fields and fields.get(b"k") != CACHE_KIND:
                self._apply(fields.get(b"m", b""))
            self.last_entry = entry.decode() if isinstance(entry, bytes) else entry
            if self.records_complete:  # a gap later in the batch must not hold it back
                self.records_through = self.last_entry
        keys, pipe = self.keys, self.client.pipeline(transaction=True)
        if self._lose:
            self._lose_recorded(pipe)
        if self._full is not None:
            known = {m.decode() for m in self.client.smembers(keys.sessions)}
            for sid in known - self._full:  # closed in a gap: its close was lost
                pipe.delete(keys.session(sid))
                pipe.srem(keys.sessions, sid)
        for rec in self._fence(self._writes):
            if rec.closed:
                pipe.delete(keys.session(rec.sid))
                pipe.srem(keys.sessions, rec.sid)
            else:
                pipe.hset(keys.session(rec.sid), "record", encode_record(rec))
                pipe.sadd(keys.sessions, rec.sid)
        if self.records_complete:  # a decision taken with no entry read
            self.records_through = self.last_entry
        pipe.hset(keys.checkpoint, mapping=self._checkpoint())
        if self._stale_fields:  # its tables are all in pages now (all dirty once loaded)
            pipe.hdel(keys.checkpoint, *self._stale_fields)
        if entries:
            pipe.xack(self.stream, self.group, *[i for i, _ in entries])
        self.checker.ack(pipe)
        pipe.execute()
        # Only now: a write Redis refused (OOM, READONLY) keeps them for the next batch.
        # Cleared before, they were lost while the next batch's checkpoint claimed them
        # (a move then carried a history a turn short: the 3-replica campaign).
        self._writes.clear()
        self.ledger.dirty.clear()  # likewise: a refused checkpoint writes them next time
        self._full, self._lose, self._stale_fields = None, False, []
        return len(entries)

    def _lose_recorded(self, pipe: redis.client.Pipeline) -> None:
        """Every session recorded now is lost (the decision on an unfillable gap): listed
        in `Keys.lost` and its record dropped, in the checkpoint's transaction."""
        keys = self.keys
        lost = sorted(m.decode() for m in self.client.smembers(keys.sessions))
        for sid in lost:
            pipe.delete(keys.session(sid))
        if lost:
            pipe.sadd(keys.lost, *lost)
        pipe.delete(keys.sessions)
        self.sessions_lost += len(lost)
        log.error(
            "replica %s: the gap in epoch %s cannot be filled (a new life began): "
            "%d recorded sessions are lost",
            keys.replica,
            self.lost_epoch,
            len(lost),
        )

    def _apply(self, raw: bytes) -> list[Violation]:
        try:
            msg = MESSAGES.decode(raw)
            if isinstance(msg, Snapshot):
                if self.epoch not in (None, msg.epoch) and self._trimmed_unread():
                    self._gap(f"entries of epoch {self.epoch} trimmed before they were read")
                if self._writer_gone(msg.epoch):
                    self._decide_lost()
                if self.epoch is not None and self.epoch != msg.epoch:
                    self.past_epochs = [*self.past_epochs, self.epoch][-PAST_EPOCHS:]
                self.ledger.reset(msg)
                self.epoch, self.seq = msg.epoch, msg.seq
                if self.records_complete:  # else asked again until a full set comes
                    self.client.delete(self.keys.snapshot_wanted)
                self.checker.reset(msg.epoch)
                return self._steps_due()
            if msg.epoch not in (self.epoch, self.lost_epoch, *self.past_epochs):
                if not self.records_complete:
                    return []  # a gap already waits for a snapshot
                what = f"message {msg.seq} of epoch {msg.epoch}, its snapshot unread"
                return self._gap(what, self.epoch or msg.epoch)
            if msg.epoch != self.epoch or msg.seq <= self.seq:
                self.duplicates += msg.epoch == self.epoch
                return []  # a duplicate, or an old epoch's tail after a snapshot
            if msg.seq != self.seq + 1:
                return self._gap(f"message {msg.seq} after {self.seq} in epoch {msg.epoch}")
            self.seq = msg.seq
            return self._apply_next(msg)
        except WireError as err:
            self.refused += 1
            self.last_refused = str(err)
            return self._gap(f"refused message: {err}")

    def _apply_next(self, msg: Events | SessionRecords | Idle) -> list[Violation]:
        """The next message of the epoch."""
        if isinstance(msg, Events):
            return self._replay(msg)
        if isinstance(msg, Idle):
            return self.ledger.check_idle(msg.counts, msg.seq)
        if msg.full:  # it supersedes what this batch had taken
            self._writes = []
            self._full = {r.sid for r in msg.records}
            self.records_complete = True
            self.client.delete(self.keys.snapshot_wanted)
        self._writes += [msgspec.structs.replace(r, executor=msg.executor) for r in msg.records]
        return self.ledger.report(check_records(self.ledger, msg.records))

    def _replay(self, batch: Events) -> list[Violation]:
        """Apply a batch, checking each queued step when the ledger stands at its point."""
        led, epoch = self.ledger, self.epoch
        if batch.first != led.next_event:
            return led.apply(batch)  # a gap of events: reported there, nothing checked
        found = self._steps_due()
        stops = self.checker.stops(epoch, batch.first, led.next_event + batch.num_events)
        found += led.apply(batch, stops, lambda seq: self.checker.at(epoch, seq, led))
        return found + self._steps_due()

    def _fence(self, records: list[SessionRecord]) -> list[SessionRecord]:
        """The records as this replica may write them: one written under a placement
        epoch the directory has since left (the session moved while the replica was
        paused or cut off) is refused, counted and logged, and stands as a close: the
        copy it describes is no longer the session, and the record it would replace must
        not go on claiming slots this replica has given to other sessions since (a
        restarted scheduler would take them back twice). A close always goes through."""
        placed = [r for r in records if not r.closed and r.epoch is not None]
        if not placed:
            return records
        pipe = self.client.pipeline(transaction=False)
        for rec in placed:
            pipe.get(streams.placement_key(rec.sid))
        refused = set()
        for rec, raw in zip(placed, pipe.execute(), strict=True):
            try:
                now = Placement.decode(raw)
            except ValueError:
                continue  # unreadable: the directory cannot say; the record stands
            if now is None:
                continue  # closed since (its close comes next), or its open placing it
            if now.epoch > rec.epoch or not now.names(self.keys.replica):
                refused.add(id(rec))
                self.fenced += 1
                log.warning(
                    "replica %s: record of session %s (epoch %d) refused: placed %s",
                    self.keys.replica,
                    rec.sid,
                    rec.epoch,
                    None if now is None else now.encode(),
                )
        return [SessionRecord(sid=r.sid, closed=True) if id(r) in refused else r for r in records]

    def _steps_due(self) -> list[Violation]:
        """Check the queued steps planned where the ledger stands now."""
        return self.ledger.report(self.checker.at(self.epoch, self.ledger.next_event, self.ledger))

    def _trimmed_unread(self) -> bool:
        """Whether the scheduler trimmed entries after the last one handled here before
        they were read (its mark, `Keys.trimmed_unread`, is past it): the end of an epoch
        trimmed away whole, before a new life's snapshot, shows no gap in any sequence.
        Asked only there (a new life)."""
        mark = self.client.get(self.keys.trimmed_unread)
        if mark is None or self.last_entry == records_proof.NO_STREAM:
            return False  # no such trim (or nothing handled here yet)
        return records_proof.entry_id(mark) > records_proof.entry_id(self.last_entry)

    def _writer_gone(self, epoch: str | None) -> bool:
        """Whether records a gap left incomplete can no longer be made whole: a life
        other than the one the gap was in (`epoch`: a snapshot's, or the fence a new
        life writes first, read when no message comes) has begun."""
        return not self.records_complete and records.gap_decided(self.gap_epoch, epoch)

    def _fenced_by(self) -> str | None:
        """The epoch of the scheduler life fenced in now, read only while a gap waits."""
        if self.records_complete or self.gap_epoch is None:
            return None
        raw = self.client.get(self.keys.scheduler_epoch)
        return None if raw is None else raw.decode()

    def _decide_lost(self) -> None:
        """The epoch whose gap left the records incomplete is over: no full set of it
        will ever come. What it recorded is lost (`_lose_recorded`, with the next
        write); the records are complete again, for the lives after it."""
        self._writes.clear()  # that epoch's records, taken before the gap: in doubt too
        self._full, self._lose = None, True
        self.lost_epoch, self.gap_epoch = self.gap_epoch, None
        self.records_complete = True

    def _gap(self, what: str, epoch: str | None = None) -> list[Violation]:
        """A gap in `epoch` (the one applied now unless named): nothing more is applied
        until a snapshot, and the records wait for a full set of that epoch."""
        found = Violation("gap", "*", [], what + "; snapshot requested", None)
        self.ledger.report([found])
        if self.records_complete:  # the first gap since the last full set: its epoch
            self.gap_epoch = epoch or self.epoch
        self.epoch = None  # apply nothing more until a snapshot arrives
        self.records_complete = False  # records may be lost: until a full set
        self.client.set(self.keys.snapshot_wanted, 1)
        return [found]

    # ---- checkpoint ----
    def _checkpoint(self) -> dict:
        """The fields of the checkpoint to write: every page of the owner tables changed
        since the last one written (`page:<n>`, ledger_replay.py's CHECKPOINT_PAGE slots
        of the tables joined: they are its biggest part, and a batch changes a few
        pages) and the rest of the state."""
        led = self.ledger
        state = {
            "epoch": self.epoch,
            "seq": self.seq,
            "next_event": led.next_event,
            "names": led.names,
            "owners": led.owners.names,
            "violations": [v.as_dict() for v in led.violations[-KEEP_VIOLATIONS:]],
            "found": dict(led.found),
            "double_frees": led.double_frees,
            "events_applied": led.events_applied,
            "steps": self.checker.state(),
            "gap_epoch": self.gap_epoch,
            "past_epochs": self.past_epochs,
            "sessions_lost": self.sessions_lost,
            "last_entry": self.last_entry,
            "lost_epoch": self.lost_epoch,
            "sizes": led.sizes,
        }
        tables = {f"page:{n}": pack(led.page(n), WIRE_DTYPES[OWNER]) for n in led.dirty}
        return {
            "state": msgpack.packb(state, use_bin_type=True),
            "records_complete": int(self.records_complete),
            records_proof.THROUGH: self.records_through,
            **tables,
        }

    def _load_checkpoint(self) -> None:
        raw, complete, through = self.client.hmget(
            self.keys.checkpoint, ["state", "records_complete", records_proof.THROUGH]
        )
        if raw is None:
            return
        self.records_complete = complete is None or complete == b"1"
        self.records_through = records_proof.NO_STREAM if through is None else through.decode()
        state = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        led = self.ledger
        self.epoch, self.seq = state["epoch"], state["seq"]
        led.names, led.next_event = state["names"], state["next_event"]
        if "sizes" in state:
            sizes = state["sizes"]
            fields = [f"page:{n}" for n in range(-(-sum(sizes) // CHECKPOINT_PAGE))]
            raws = self.client.hmget(self.keys.checkpoint, fields) if fields else []
            led.restore_pages([unpack(t or b"", WIRE_DTYPES[OWNER]) for t in raws], sizes)
        else:  # written whole, a field a table, before pages (5000829)
            fields = [f"table:{i}" for i in range(len(led.names))]
            raws = self.client.hmget(self.keys.checkpoint, fields) if fields else []
            led.restore([unpack(t or b"", WIRE_DTYPES[OWNER]) for t in raws])
            self._stale_fields = fields  # the next checkpoint deletes them
        led.owners.reset({int(k): v for k, v in state["owners"].items()}, led.tables)
        led.violations = [Violation(**v) for v in state["violations"]]
        led.found = Counter(state.get("found") or [v.kind for v in led.violations])
        led.double_frees, led.events_applied = state["double_frees"], state["events_applied"]
        if "steps" in state:
            self.checker.load(state["steps"])
        # absent from a checkpoint written before these existed (5000829): nothing known
        self.gap_epoch = state.get("gap_epoch")
        self.past_epochs = state.get("past_epochs") or []
        self.sessions_lost = state.get("sessions_lost", 0)
        self.last_entry = state.get("last_entry", records_proof.NO_STREAM)
        self.lost_epoch = state.get("lost_epoch")
