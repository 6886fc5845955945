"""Ownership events over a real Redis stream into the session store's independent
ledger: agreement with the scheduler, faults named, exactly-once across restarts."""

import numpy as np
import pytest
import redis

from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.runtime.event_shipper import EventShipper
from services.session_store.consumer import OwnershipConsumer
from shared import streams
from shared.messages.cache import CACHE_KIND, CacheEvents, CacheSnapshot, Stored, chain
from shared.messages.envelope import encode
from shared.messages.ownership import RECORDS, Events, Transfers
from shared.placement import Placement
from shared.records_proof import entry_id
from tests.engine.driver import Driver
from tests.engine.test_sessions import text


def publish(client, message: bytes) -> None:
    client.xadd(streams.SINGLE.ownership, {"m": message}, maxlen=streams.MAXLEN, approximate=True)


def drain(consumer: OwnershipConsumer) -> None:
    while consumer.poll(block_ms=10):
        pass


def workload(d: Driver, shipper: EventShipper, client) -> None:
    """Sessions, plain requests sharing a prefix and an abort, shipping after each step."""
    sids = [d.engine.sessions.open(f"s{i}").sid for i in range(3)]
    for k in range(3):
        turns = [d.turn(sid, text(6, 10 * k + i), max_new=5) for i, sid in enumerate(sids)]
        plain = d.generate(text(30, 99) + text(3, k), max_new=4)
        for step in range(40):
            d.step()
            if step == 2:
                d.engine.abort(turns[0].rid)
            shipped = shipper.batch()
            if shipped:
                publish(client, shipped[0])
        assert plain.done
    for sid in sids:
        d.engine.sessions.close(sid)
    d.run()
    shipped = shipper.batch()
    if shipped:
        publish(client, shipped[0])


def test_the_store_ledger_agrees_with_the_scheduler(redis_client):
    d = Driver(page_size=4, kv_pages=300, chunk=8, step_tokens=32)
    shipper = EventShipper(d.pools.ledger, epoch="e1")
    consumer = OwnershipConsumer(redis_client, "store-1")
    publish(redis_client, shipper.snapshot())
    workload(d, shipper, redis_client)
    publish(redis_client, shipper.idle(d.engine.check(idle=True).counts))
    drain(consumer)
    led = consumer.ledger
    assert led.violations == []
    assert led.events_applied > 100
    for pool in d.pools.ledger.by_id:
        assert led.tables[pool.pool_id].tolist() == pool.owner_view.tolist(), pool.name
    assert led.counts() == d.engine.check(idle=True).counts
    assert redis_client.xpending(streams.SINGLE.ownership, streams.STORE_GROUP)["pending"] == 0


def crafted(seq: int, first_event: int, records: list[tuple], reasons: list[str]) -> bytes:
    columns = Transfers(*(np.array(c) for c in zip(*records, strict=True)))
    return encode(Events.of("e2", seq, first_event, reasons, columns, {}))


def test_a_double_free_and_a_foreign_free_are_named(redis_client):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e2")
    publish(redis_client, shipper.snapshot())
    req = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r1")
    other = d.pools.ledger.new_owner(OwnerKind.SESSION, "s9")
    slot = d.pools.mamba.alloc_one(req)
    kept = d.pools.mamba.alloc_one(req)
    publish(redis_client, shipper.batch()[0])
    mamba = d.pools.mamba.pool_id
    n = d.pools.ledger.events.next_seq
    # a faulty producer: the slot freed twice, then freed by someone who never had it
    message = crafted(
        shipper.seq + 1,
        n,
        [(0, mamba, slot, req.id, 0), (1, mamba, slot, req.id, 0), (2, mamba, kept, other.id, 0)],
        ["free", "free", "free"],
    )
    publish(redis_client, message)
    consumer = OwnershipConsumer(redis_client, "store-1")
    drain(consumer)
    kinds = [(v.kind, v.slots, v.event) for v in consumer.ledger.violations]
    assert kinds == [("double_free", [slot], n + 1), ("not_owner", [kept], n + 2)]
    assert "request:r1" in consumer.ledger.violations[0].detail
    assert "session:s9" in consumer.ledger.violations[1].detail
    assert consumer.ledger.double_frees == 1


def test_a_duplicated_message_is_applied_once_and_a_gap_asks_for_a_snapshot(redis_client):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e3")
    publish(redis_client, shipper.snapshot())
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    d.pools.mamba.alloc_one(owner)
    message, _ = shipper.batch()
    publish(redis_client, message)
    publish(redis_client, message)  # replayed
    consumer = OwnershipConsumer(redis_client, "store-1")
    drain(consumer)
    assert consumer.duplicates == 1 and consumer.ledger.violations == []
    d.pools.mamba.alloc_one(owner)
    shipper.batch()  # lost on the way
    d.pools.mamba.alloc_one(owner)
    publish(redis_client, shipper.batch()[0])
    drain(consumer)
    assert [v.kind for v in consumer.ledger.violations] == ["gap"]
    assert redis_client.exists(streams.SINGLE.snapshot_wanted)
    publish(redis_client, shipper.snapshot())
    drain(consumer)
    assert consumer.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()
    # asked again until the records the gap may have lost come whole: a full set
    assert redis_client.exists(streams.SINGLE.snapshot_wanted)
    publish(redis_client, shipper.sessions([], None, full=True))
    drain(consumer)
    assert not redis_client.exists(streams.SINGLE.snapshot_wanted)


def test_a_restarted_store_resumes_from_its_checkpoint_exactly_once(redis_client):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e4")
    publish(redis_client, shipper.snapshot())
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    for _ in range(3):
        d.pools.mamba.alloc_one(owner)
        publish(redis_client, shipper.batch()[0])
    first = OwnershipConsumer(redis_client, "store-1")
    drain(first)
    for _ in range(2):
        d.pools.mamba.alloc_one(owner)
        publish(redis_client, shipper.batch()[0])
    # the store reads the new entries and dies before applying or acknowledging them
    redis_client.xreadgroup(streams.STORE_GROUP, "store-1", {streams.SINGLE.ownership: ">"})
    again = OwnershipConsumer(redis_client, "store-1")
    assert again.ledger.events_applied == 3  # from the checkpoint
    drain(again)
    assert again.ledger.events_applied == 5 and again.ledger.violations == []
    assert again.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()


def test_entries_of_a_dead_consumer_are_claimed(redis_client):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e5")
    publish(redis_client, shipper.snapshot())
    streams.ensure_group(redis_client, streams.SINGLE.ownership, streams.STORE_GROUP)
    redis_client.xreadgroup(streams.STORE_GROUP, "dead", {streams.SINGLE.ownership: ">"})
    survivor = OwnershipConsumer(redis_client, "alive")
    assert survivor.poll(block_ms=10) == 0
    assert survivor.claim_stale(min_idle_ms=0) == 1
    assert survivor.ledger.ready


def test_a_leak_at_idle_is_reported_with_its_owner(redis_client):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e6")
    publish(redis_client, shipper.snapshot())
    lost = d.pools.ledger.new_owner(OwnerKind.TRACK, "r77")
    slot = d.pools.mamba.alloc_one(lost)
    publish(redis_client, shipper.batch()[0])
    publish(redis_client, shipper.idle(d.engine.check(idle=False).counts))
    consumer = OwnershipConsumer(redis_client, "store-1")
    drain(consumer)
    (leak,) = consumer.ledger.violations
    assert leak.kind == "leak" and leak.slots == [slot] and "track:r77" in leak.detail


@pytest.mark.parametrize(
    "garbage", [b"", b"\x00\x01", crafted(1, 0, [(0, 1, 1, 0, 8)], ["alloc"])[:-3]]
)
def test_garbage_on_the_stream_is_refused_without_harm(redis_client, garbage):
    consumer = OwnershipConsumer(redis_client, "store-1")
    redis_client.xadd(streams.SINGLE.ownership, {"m": garbage})
    drain(consumer)
    assert consumer.refused == 1 and not consumer.ledger.ready
    assert redis_client.xpending(streams.SINGLE.ownership, streams.STORE_GROUP)["pending"] == 0
    publish(redis_client, EventShipper(Driver().pools.ledger, epoch="e7").snapshot())
    drain(consumer)
    assert consumer.ledger.ready  # the stream keeps flowing


def test_cache_entries_are_acknowledged_and_skipped(redis_client):
    """The routers' entries on the stream (`k` = cache) are neither applied nor refused,
    and the ownership messages around them keep their sequence."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e8")
    publish(redis_client, shipper.snapshot())
    stream, cache = streams.SINGLE.ownership, {"k": CACHE_KIND}
    redis_client.xadd(
        stream, cache | {"m": encode(CacheSnapshot(epoch="e8", seq=1, block=4, ops=[]))}
    )
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    d.pools.mamba.alloc_one(owner)
    ops = [Stored(3, 0, chain(range(8), 4))]
    redis_client.xadd(stream, cache | {"m": encode(CacheEvents(epoch="e8", seq=2, ops=ops))})
    publish(redis_client, shipper.batch()[0])
    consumer = OwnershipConsumer(redis_client, "store-1")
    drain(consumer)
    assert consumer.refused == 0 and consumer.ledger.violations == []
    assert not redis_client.exists(streams.SINGLE.snapshot_wanted)
    assert consumer.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()
    assert redis_client.xpending(stream, streams.STORE_GROUP)["pending"] == 0


def test_records_lost_in_a_gap_are_made_whole_by_the_full_set_after_a_snapshot(redis_client):
    """A gap stops `records_through` (the proof a restarted scheduler waits for) and the
    records in it are lost; the snapshot the store asks for brings every open session's
    record (a full set), and a record the full set does not name (closed in the gap) goes."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e3")
    consumer = OwnershipConsumer(redis_client, "store-1")
    keys = streams.SINGLE
    a = d.engine.sessions.open("sa")
    d.engine.sessions.open("sb")
    publish(redis_client, shipper.snapshot())
    publish(redis_client, shipper.sessions(d.engine.sessions.records.take_records(), None))
    drain(consumer)
    assert redis_client.smembers(keys.sessions) == {b"sa", b"sb"}
    applied = consumer.records_through
    assert applied == redis_client.xrevrange(keys.ownership, count=1)[0][0].decode()

    a.history = np.arange(7)
    d.engine.sessions.dirty.add("sa")
    d.engine.sessions.close("sb")
    shipper.sessions(d.engine.sessions.records.take_records(), None)  # lost: never on the stream
    publish(redis_client, shipper.idle({}))  # the next message shows the gap
    drain(consumer)
    assert not consumer.records_complete
    assert consumer.records_through == applied  # no proof past a gap
    assert redis_client.exists(keys.snapshot_wanted)

    publish(redis_client, shipper.snapshot())
    publish(
        redis_client, shipper.sessions(d.engine.sessions.records.all_records(), None, full=True)
    )
    drain(consumer)
    assert consumer.records_complete
    assert entry_id(consumer.records_through) > entry_id(applied)
    assert redis_client.smembers(keys.sessions) == {b"sa"}  # sb's close, lost, is made good
    stored = RECORDS.decode(redis_client.hget(keys.session("sa"), "record"))
    assert stored.tokens().tolist() == list(range(7))
    assert not redis_client.exists(keys.session("sb"))
    restarted = OwnershipConsumer(redis_client, "store-1")  # the proof survives a restart
    assert (restarted.records_complete, restarted.records_through) == (
        True,
        consumer.records_through,
    )


def test_a_record_written_under_an_epoch_the_directory_left_is_refused(redis_client):
    """A replica woken from a pause after its session moved (placement at a newer epoch,
    or on another replica) cannot overwrite the record: the store refuses it, counts it,
    and removes the one it had (its slot claims are stale: the replica may have given
    those slots to another session, and a restart would take them back twice); a record
    at the current epoch, or never placed, is kept."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e5")
    consumer = OwnershipConsumer(redis_client, "store-1")
    keys = streams.SINGLE
    publish(redis_client, shipper.snapshot())
    sessions = d.engine.sessions
    for sid in ("here", "moved", "away", "direct"):
        sessions.open(sid).routed = sid != "direct"
    redis_client.set(streams.placement_key("here"), Placement(keys.replica, 1).encode())
    redis_client.set(streams.placement_key("moved"), Placement(keys.replica, 1).encode())
    redis_client.set(streams.placement_key("away"), Placement(keys.replica, 1).encode())
    publish(redis_client, shipper.sessions(sessions.records.take_records(), None))
    drain(consumer)
    assert redis_client.smembers(keys.sessions) == {b"here", b"moved", b"away", b"direct"}

    redis_client.set(streams.placement_key("moved"), Placement(keys.replica, 3).encode())
    redis_client.set(streams.placement_key("away"), Placement("7", 2).encode())
    for sid in ("here", "moved", "away", "direct"):
        sessions.sessions[sid].history = np.arange(5)
        sessions.dirty.add(sid)
    publish(redis_client, shipper.sessions(sessions.records.take_records(), None))
    drain(consumer)
    assert consumer.fenced == 2

    def stored(sid: str) -> int | None:
        raw = redis_client.hget(keys.session(sid), "record")
        return None if raw is None else len(RECORDS.decode(raw).tokens())

    assert {sid: stored(sid) for sid in ("here", "moved", "away", "direct")} == {
        "here": 5,
        "moved": None,
        "away": None,
        "direct": 5,
    }
    assert redis_client.smembers(keys.sessions) == {b"here", b"direct"}


def test_records_a_refused_write_dropped_are_written_with_the_next_batch(redis_client):
    """Redis refuses the store's transaction (OOM) after it applied a batch: its session
    records must go with the next batch, whose checkpoint claims them (`records_through`).
    They were cleared before the write, so a move read a record a turn short."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e7")
    consumer = OwnershipConsumer(redis_client, "store-1")
    keys = streams.SINGLE
    publish(redis_client, shipper.snapshot())
    drain(consumer)
    sessions = d.engine.sessions
    sessions.open("kept").history = np.arange(9)
    publish(redis_client, shipper.sessions(sessions.records.take_records(), None))
    saved = redis_client.config_get("maxmemory*")
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.ResponseError):
            drain(consumer)
    finally:
        redis_client.config_set("maxmemory", saved["maxmemory"])
        redis_client.config_set("maxmemory-policy", saved["maxmemory-policy"])
    sessions.open("later")
    publish(redis_client, shipper.sessions(sessions.records.take_records(), None))
    drain(consumer)
    assert {m.decode() for m in redis_client.smembers(keys.sessions)} == {"kept", "later"}
    kept = RECORDS.decode(redis_client.hget(keys.session("kept"), "record"))
    assert len(kept.tokens()) == 9
    last = redis_client.xrevrange(keys.ownership, count=1)[0][0].decode()
    assert redis_client.hget(keys.checkpoint, "records_through").decode() == last
    # the refused batch's entries stayed pending, were read again and acknowledged
    assert redis_client.xpending(keys.ownership, streams.STORE_GROUP)["pending"] == 0


def two_lives(redis_client) -> tuple[Driver, EventShipper, OwnershipConsumer, str]:
    """A scheduler life "e5" with two sessions recorded by the store; the last entry read."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e5")
    consumer = OwnershipConsumer(redis_client, "store-1")
    d.engine.sessions.open("sa")
    d.engine.sessions.open("sb")
    publish(redis_client, shipper.snapshot())
    publish(redis_client, shipper.sessions(d.engine.sessions.records.take_records(), None))
    drain(consumer)
    return d, shipper, consumer, consumer.records_through


def test_a_gap_whose_life_ended_loses_its_sessions_instead_of_waiting_for_ever(redis_client):
    """Records lost in a gap, and the life that could have sent them whole gone (a new
    life's snapshot comes first): the store decides, every recorded session is lost
    (listed, its record dropped), and the proof goes on for the new life, which before
    waited for a full set it withholds while its sessions wait for that very proof."""
    d, shipper, consumer, applied = two_lives(redis_client)
    keys = streams.SINGLE
    shipper.sessions(d.engine.sessions.records.take_records(), None)  # lost
    publish(redis_client, shipper.idle({}))  # the gap shows
    drain(consumer)
    assert not consumer.records_complete
    new_life = EventShipper(Driver().pools.ledger, epoch="e6")
    publish(redis_client, new_life.snapshot())  # its full set waits for the proof
    drain(consumer)
    assert consumer.records_complete and consumer.sessions_lost == 2
    assert entry_id(consumer.records_through) > entry_id(applied)
    assert redis_client.smembers(keys.lost) == {b"sa", b"sb"}
    assert not redis_client.smembers(keys.sessions) and not redis_client.exists(keys.session("sa"))


def test_an_epoch_s_end_trimmed_away_whole_is_a_gap_too(redis_client):
    """No sequence shows it: the old life's last entries went before the store read them,
    and the next it reads is a new life's snapshot. The mark the trim left does (as the
    scheduler's trim leaves it: the first entry kept)."""
    d, shipper, consumer, _ = two_lives(redis_client)
    keys = streams.SINGLE
    publish(redis_client, shipper.sessions(d.engine.sessions.records.take_records(), None))
    redis_client.xtrim(keys.ownership, maxlen=0)  # trimmed unread
    publish(redis_client, EventShipper(Driver().pools.ledger, epoch="e6").snapshot())
    redis_client.set(keys.trimmed_unread, redis_client.xrange(keys.ownership, count=1)[0][0])
    drain(consumer)
    assert consumer.sessions_lost == 2 and redis_client.smembers(keys.lost) == {b"sa", b"sb"}


def test_a_gap_in_a_new_life_s_epoch_does_not_hold_back_the_proof_of_the_earlier_records(
    redis_client,
):
    """The old life's last records and a new life's entries in one batch (the store was
    paused across the restart), a gap among the new life's: the records are proven
    current through the last entry before the gap, which covers every earlier life's.
    The new life's sessions wait for that proof, and its full set for them: a proof that
    waited for the full set would wait for ever."""
    d, shipper, consumer, _ = two_lives(redis_client)
    keys = streams.SINGLE
    d.engine.sessions.sessions["sa"].history = np.arange(9)
    d.engine.sessions.dirty.add("sa")
    publish(redis_client, shipper.sessions(d.engine.sessions.records.take_records(), None))
    target = redis_client.xrevrange(keys.ownership, count=1)[0][0].decode()
    new_life = EventShipper(Driver().pools.ledger, epoch="e6")
    publish(redis_client, new_life.snapshot())
    new_life.idle({})  # lost
    publish(redis_client, new_life.idle({}))
    drain(consumer)  # one batch
    assert not consumer.records_complete
    assert entry_id(consumer.records_through) >= entry_id(target)
    stored = RECORDS.decode(redis_client.hget(keys.session("sa"), "record"))
    assert stored.tokens().tolist() == list(range(9))
    assert redis_client.smembers(keys.sessions) == {b"sa", b"sb"}


def test_a_gap_is_decided_once_a_new_life_is_fenced_in_though_it_writes_nothing(redis_client):
    """The new life may write nothing for a while (it waits for a front re-homing its
    sessions, which waits for the store's proof): the fence it writes first is enough."""
    d, shipper, consumer, _ = two_lives(redis_client)
    keys = streams.SINGLE
    shipper.sessions(d.engine.sessions.records.take_records(), None)  # lost
    publish(redis_client, shipper.idle({}))
    drain(consumer)
    assert not consumer.records_complete
    redis_client.set(keys.scheduler_epoch, "e5")  # the life of the gap: it may fill it
    consumer.poll(block_ms=10)
    assert not consumer.records_complete
    redis_client.set(keys.scheduler_epoch, "e6")  # a new life: it cannot
    consumer.poll(block_ms=10)
    assert consumer.records_complete and consumer.sessions_lost == 2
    last = redis_client.xrevrange(keys.ownership, count=1)[0][0].decode()
    assert consumer.records_through == last  # the proof comes with the decision


def test_entries_whose_read_reply_was_lost_are_read_again(redis_client):
    """Redis delivers a batch (it is now this consumer's, pending) and the reply is lost
    on the way: the next poll reads its pending entries first, so nothing is skipped (a
    gap) and nothing stays unacknowledged. The store reads pending entries only after
    such a fault, not with every poll."""
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e8")
    consumer = OwnershipConsumer(redis_client, "store-1")
    publish(redis_client, shipper.snapshot())
    drain(consumer)
    req = d.generate(text(10, 1), max_new=3)
    d.run()
    publish(redis_client, shipper.batch()[0])
    real = consumer.client.xreadgroup

    def lost(*args, **kwargs):
        real(*args, **kwargs)  # delivered by Redis...
        raise redis.exceptions.ConnectionError("the reply was lost")  # ...never received

    consumer.client.xreadgroup = lost
    with pytest.raises(redis.exceptions.ConnectionError):
        consumer.poll(block_ms=10)
    consumer.client.xreadgroup = real
    drain(consumer)
    assert consumer.ledger.violations == []
    assert consumer.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()
    assert redis_client.xpending(streams.SINGLE.ownership, streams.STORE_GROUP)["pending"] == 0
    assert req.done
