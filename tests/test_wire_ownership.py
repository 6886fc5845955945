"""The typed ownership messages: each kind survives the wire unchanged; a malformed one
is refused with its reason on decode; and the session store's consumer counts such an
entry, acknowledges it and goes on."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.runtime.event_shipper import EventShipper
from services.session_store.consumer import OwnershipConsumer
from services.session_store.service import StoreService
from shared import streams
from shared.config import Settings
from shared.messages.envelope import I4, I8, WireError, array, encode, pack
from shared.messages.ownership import (
    MESSAGES,
    OWNER,
    RECORDS,
    Events,
    Idle,
    PoolTable,
    SessionRecord,
    SessionRecords,
    Snapshot,
    Transfers,
    encode_record,
)
from tests.engine.driver import Driver


def events() -> Events:
    records = Transfers(
        np.array([0, 0, 1]),
        np.array([1, 1, 1]),
        np.array([3, 4, 3]),
        np.array([0, 0, 9]),
        np.array([9, 9, 0]),
    )
    return Events.of("e1", 2, 40, ["alloc", "free"], records, {9: "request:r1"})


def open_record(**slots: object) -> SessionRecord:
    return SessionRecord(
        sid="chat",
        timeout=30.0,
        tenant="ab12",
        history=array([5, 6, 7], I4),
        cached_len=2,
        **slots,
    )


MESSAGES_OF_EACH_KIND = [
    Snapshot(
        epoch="e1",
        seq=1,
        pools=[
            PoolTable(id=0, name="req", capacity=2, owners=array([-1, 0, 9], OWNER)),
            PoolTable(id=1, name="mamba", capacity=1, owners=array([-1, 0], OWNER)),
        ],
        owners={9: "request:r1"},
        next_event=40,
    ),
    events(),
    SessionRecords(
        epoch="e1",
        seq=3,
        records=[
            open_record(row=1, working=4, pages=array([7, 8], I8)),
            open_record(),
            SessionRecord(sid="gone", closed=True),
        ],
        executor="x1",
    ),
    Idle(epoch="e1", seq=4, counts={"req": {"free": 2, "request": 0}}),
]


@pytest.mark.parametrize("message", MESSAGES_OF_EACH_KIND, ids=lambda m: type(m).__name__)
def test_each_kind_survives_the_wire(message):
    assert MESSAGES.decode(encode(message)) == message


def test_the_persisted_record_is_the_typed_one():
    record = open_record(row=1, working=4, pages=array([7, 8], I8), executor="x1")
    back = RECORDS.decode(encode_record(record))
    assert back == record and back.tokens().tolist() == [5, 6, 7]
    assert back.kv_pages().tolist() == [7, 8]
    closed = msgspec.msgpack.decode(encode_record(SessionRecord(sid="gone", closed=True)))
    assert closed == {"sid": "gone", "closed": True}  # nothing but its sid


def altered(message: msgspec.Struct, **fields: object) -> bytes:
    """`message` on the wire with some of its fields replaced by raw values."""
    raw = msgspec.msgpack.decode(encode(message))
    return msgspec.msgpack.encode(raw | fields)


MALFORMED = {
    "wrong version": (altered(events(), v=1), "`$.v`"),
    "wrong type": (altered(events(), seq="2"), "Expected `int`, got `str` - at `$.seq`"),
    "unknown kind": (altered(events(), kind="transfers"), "`$.kind`"),
    "truncated message": (encode(events())[:-3], "truncated"),
    "truncated packed array": (altered(events(), slot=b"\x03\x00\x00"), "a packed <i4 array"),
    "arrays of different lengths": (
        altered(events(), giver=pack([0, 0], "<i8")),
        "record arrays of lengths",
    ),
    "records outside the batch": (altered(events(), reasons=["alloc"]), "records numbered outside"),
    "a snapshot table short of its pool": (
        altered(
            MESSAGES_OF_EACH_KIND[0],
            pools=[{"id": 0, "name": "req", "capacity": 5, "owners": pack([-1, 0], "<i8")}],
        ),
        "snapshot of pool req: 2 owners",
    ),
    "a record naming some of its slots": (
        altered(MESSAGES_OF_EACH_KIND[2], records=[{"sid": "s", "history": b"", "row": 1}]),
        "names some of its slots",
    ),
    "a closed record carrying more": (
        altered(MESSAGES_OF_EACH_KIND[2], records=[{"sid": "s", "closed": True, "row": 1}]),
        "carries more",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_message_is_refused_with_its_reason(case):
    raw, reason = MALFORMED[case]
    with pytest.raises(WireError, match="malformed message") as refused:
        MESSAGES.decode(raw)
    assert reason in str(refused.value)


def test_the_consumer_counts_acknowledges_and_goes_on(redis_client, redis_url):
    d = Driver()
    shipper = EventShipper(d.pools.ledger, epoch="e1")
    consumer = OwnershipConsumer(redis_client, "store-1")

    def publish(message: bytes) -> None:
        redis_client.xadd(streams.SINGLE.ownership, {"m": message})
        while consumer.poll(block_ms=10):
            pass

    publish(shipper.snapshot())
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r1")
    d.pools.mamba.alloc_one(owner)
    message, _ = shipper.batch()
    publish(msgspec.msgpack.encode(msgspec.msgpack.decode(message) | {"slot": b"\x01"}))
    past_the_pool = Transfers(*(np.array([x]) for x in (0, 1, 10_000, 0, owner.id)))
    publish(encode(Events.of("e1", shipper.seq + 1, 0, ["alloc"], past_the_pool, {})))
    assert consumer.refused == 1  # the second came after the gap: dropped, not applied
    assert "a packed <i4 array" in consumer.last_refused
    assert redis_client.xpending(streams.SINGLE.ownership, streams.STORE_GROUP)["pending"] == 0
    publish(shipper.snapshot())  # what the store asked for
    d.pools.mamba.alloc_one(owner)
    publish(shipper.batch()[0])
    assert consumer.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()
    assert [v.kind for v in consumer.ledger.violations] == ["gap"]
    first = d.pools.ledger.events.next_seq
    publish(encode(Events.of("e1", shipper.seq + 1, first, ["alloc"], past_the_pool, {})))
    assert consumer.refused == 2 and "outside their pools" in consumer.last_refused
    assert consumer.ledger.tables[1].tolist() == d.pools.mamba.owner_view.tolist()  # untouched
    store = StoreService(Settings(redis_url=redis_url))
    store.replicas.consumers["0"] = consumer
    assert store.ledger_view()["refused"]["total"] == 2
    assert b'custody_ownership_messages_refused{replica="0"} 2.0' in store.metrics()
