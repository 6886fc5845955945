"""The store's checkpoint writes only the owner-table pages a batch changed, and a
store restarted from it (or from a checkpoint written whole, a field a table, as
5000829 wrote it) holds the same tables."""

import msgpack

from services.scheduler.ownership.owners import OwnerKind
from services.scheduler.runtime.event_shipper import EventShipper
from services.session_store.consumer import OwnershipConsumer
from services.session_store.ledger_replay import CHECKPOINT_PAGE
from shared import streams
from shared.messages.envelope import WIRE_DTYPES, pack
from shared.messages.ownership import OWNER
from tests.engine.driver import Driver
from tests.session_store.test_ownership_stream import drain, publish

KEY = streams.SINGLE.checkpoint


def page_fields(client) -> set[str]:
    return {f.decode() for f in client.hkeys(KEY) if f.startswith(b"page:")}


def stack(client) -> tuple[Driver, EventShipper, OwnershipConsumer]:
    """A KV pool of several pages, its snapshot applied and checkpointed."""
    d = Driver(kv_pages=3 * CHECKPOINT_PAGE)
    shipper = EventShipper(d.pools.ledger, epoch="e1")
    publish(client, shipper.snapshot())
    consumer = OwnershipConsumer(client, "store-1")
    drain(consumer)
    return d, shipper, consumer


def test_a_batch_rewrites_only_the_pages_it_changed(redis_client):
    d, shipper, consumer = stack(redis_client)
    every = page_fields(redis_client)
    assert len(every) == -(-len(consumer.ledger.flat) // CHECKPOINT_PAGE) > 3
    redis_client.hdel(KEY, *every)  # what the next checkpoint writes is what reappears
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    slot = d.pools.mamba.alloc_one(owner)
    publish(redis_client, shipper.batch()[0])
    drain(consumer)
    at = int(consumer.ledger.offsets[d.pools.mamba.pool_id]) + slot
    assert page_fields(redis_client) == {f"page:{at // CHECKPOINT_PAGE}"}


def test_a_restarted_store_reads_every_table_back_from_the_pages(redis_client):
    d, shipper, consumer = stack(redis_client)
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    d.pools.kv_pages.alloc(5, owner)
    d.pools.mamba.alloc_one(owner)
    publish(redis_client, shipper.batch()[0])
    drain(consumer)
    again = OwnershipConsumer(redis_client, "store-1")
    for pool in d.pools.ledger.by_id:
        assert again.ledger.tables[pool.pool_id].tolist() == pool.owner_view.tolist()


def test_a_checkpoint_written_a_table_a_field_is_read_and_replaced_by_pages(redis_client):
    d, shipper, consumer = stack(redis_client)
    led = consumer.ledger
    # rewrite the checkpoint as the whole-table format had it: no sizes, no pages
    state = msgpack.unpackb(redis_client.hget(KEY, "state"), raw=False, strict_map_key=False)
    del state["sizes"]
    redis_client.hdel(KEY, *page_fields(redis_client))
    tables = {f"table:{i}": pack(t, WIRE_DTYPES[OWNER]) for i, t in enumerate(led.tables)}
    redis_client.hset(KEY, mapping={"state": msgpack.packb(state), **tables})
    again = OwnershipConsumer(redis_client, "store-1")
    for pool in d.pools.ledger.by_id:
        assert again.ledger.tables[pool.pool_id].tolist() == pool.owner_view.tolist()
    owner = d.pools.ledger.new_owner(OwnerKind.REQUEST, "r")
    d.pools.mamba.alloc_one(owner)
    publish(redis_client, shipper.batch()[0])
    drain(again)
    fields = {f.decode() for f in redis_client.hkeys(KEY)}
    assert not {f for f in fields if f.startswith("table:")}
    assert len(page_fields(redis_client)) == -(-len(led.flat) // CHECKPOINT_PAGE)
