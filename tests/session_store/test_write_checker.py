"""The session store's check of what every forward step writes, and of the slots every
session record names, against its own replayed ledger: silent on a busy workload, loud
and precise on a misrouted write; and the store's memory bounded by what is held."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import msgpack
import msgspec
import numpy as np

from services.scheduler.engine.misroute import ENV, MisrouteWrite
from services.scheduler.engine.step import StepPlan
from services.scheduler.runtime.event_shipper import EventShipper
from services.session_store.consumer import OwnershipConsumer
from services.session_store.write_checker import RowWrites, WriteChecker
from shared import streams
from shared.messages.envelope import I4, I8, array, encode
from shared.messages.forward import StepRow
from shared.messages.step_rows import RowColumns
from tests.engine.data_model import result_of
from tests.engine.driver import Driver
from tests.engine.test_sessions import text
from tests.services_harness import stack_settings, start_stack


class Publisher:
    """The scheduler service's order of publishing, in process: a step goes on the
    forward stream right after it is planned, the ownership messages of its planning
    (events up to its point, then the session records) just before it, and those of
    whatever happens after it later."""

    def __init__(self, d: Driver, client, epoch: str = "e1") -> None:
        self.d, self.client = d, client
        self.shipper = EventShipper(d.pools.ledger, epoch)
        self.misroute: MisrouteWrite | None = None
        self.published = 0
        self._xadd(streams.SINGLE.ownership, self.shipper.snapshot())

    def _xadd(self, stream: str, message: bytes) -> None:
        self.client.xadd(stream, {"m": message}, maxlen=streams.MAXLEN, approximate=True)

    def ship(self) -> None:
        shipped = self.shipper.batch()
        if shipped is not None:
            self._xadd(streams.SINGLE.ownership, shipped[0])
        records = self.d.engine.sessions.records.take_records()
        if records:
            self._xadd(streams.SINGLE.ownership, self.shipper.sessions(records, "x1"))

    def step(self) -> StepPlan | None:
        engine = self.d.engine
        plan = engine.plan_step()
        if plan is not None:
            step = plan.message(self.shipper.epoch, "x1", self.d.pools, self.misroute)
            self.ship()
            self._xadd(streams.SINGLE.forward, encode(step))
            self.published += 1
        if engine.in_flight and (plan is None or len(engine.in_flight) > self.d.depth):
            self.complete_oldest()
        return plan

    def complete_oldest(self) -> None:
        oldest = self.d.engine.in_flight[0]
        self.d.engine.complete(oldest, result_of(oldest, self.d.model.run(oldest)))

    def run(self) -> None:
        while not self.d.engine.idle:
            self.step()
        self.ship()


def drain(consumer: OwnershipConsumer) -> None:
    while consumer.poll(block_ms=10):
        pass


def busy_round(d: Driver, pub: Publisher, k: int) -> None:
    """Session turns (one aborted mid-way), plain requests sharing a prefix (cache hits,
    so deferred copies), all under memory pressure (retracts, dropped session state)."""
    sids = [d.engine.sessions.open(f"s{k}-{i}").sid for i in range(3)]
    for t in range(3):
        turns = [d.turn(sid, text(6, 10 * t + i), max_new=5) for i, sid in enumerate(sids)]
        for j in range(4):
            d.generate(text(24, 99) + text(3, 7 * k + j), max_new=12)
        for n in range(200):
            pub.step()
            if n == 2 and t == 1:
                d.engine.abort(turns[0].rid)
            if d.engine.idle:
                break
        pub.ship()
    for sid in sids:
        d.engine.sessions.close(sid)
    pub.run()


def pressured() -> Driver:
    return Driver(
        page_size=4, kv_pages=32, mamba_slots=16, rows=6, context=112, chunk=8, step_tokens=24
    )


def test_a_busy_workload_writes_only_what_its_writers_own(redis_client):
    d = pressured()
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    for k in range(2):
        busy_round(d, pub, k)
    drain(consumer)
    assert consumer.ledger.violations == []
    assert consumer.checker.checked == pub.published > 100
    assert consumer.checker.unchecked == 0 and consumer.checker.queued == []
    assert d.engine.retractions > 0 and d.engine.cache_hits > 0
    assert d.engine.sessions.states_dropped > 0
    assert redis_client.xpending(streams.SINGLE.forward, "write-checker")["pending"] == 0


def test_owners_known_to_the_store_stay_bounded(redis_client):
    """Owners are forgotten once they hold nothing: after three times the requests, the
    store knows no more owners, and exactly those holding a slot (or live sessions)."""
    d = pressured()
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    known = []
    for k in range(6):
        busy_round(d, pub, k)
        drain(consumer)
        known.append(len(consumer.ledger.owners.names))
    assert consumer.ledger.violations == []
    holders = {o for table in consumer.ledger.tables for o in table.tolist() if o > 0}
    assert set(consumer.ledger.owners.names) == holders  # every session was closed
    assert max(known[3:]) <= max(known[:2])
    raw = redis_client.hget(streams.SINGLE.checkpoint, "state")
    state = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    assert len(state["owners"]) == known[-1]


def test_a_misrouted_state_write_is_named_with_slot_owner_and_step(redis_client):
    d = Driver(page_size=4)
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    pub.misroute = MisrouteWrite(d.pools.mamba, armed=True)
    req = d.generate(text(10, 1), max_new=3)
    first = pub.step()
    victim = int(np.flatnonzero(d.pools.mamba.owner_view == 0)[-1])
    pub.run()
    drain(consumer)
    (v,) = consumer.ledger.violations
    assert (v.kind, v.pool, v.slots, v.step) == ("misrouted_write", "mamba", [victim], 1)
    assert v.expected == f"request:{req.rid}" and v.actual == "free"
    assert f"step {first.step_id}" in v.detail and f"mamba_out of {req.rid}" in v.detail
    assert consumer.checker.checked == pub.published


def test_a_restarted_store_still_checks_the_steps_it_had_queued(redis_client):
    """A step read before the events of its planning stays unacknowledged: the store
    restarted meanwhile reads it again among its pending entries and checks it once its
    ledger gets there."""
    d = Driver(page_size=4)
    pub = Publisher(d, redis_client)
    d.generate(text(10, 1), max_new=3)
    plan = d.engine.plan_step()
    step = plan.message(pub.shipper.epoch, "x1", d.pools, MisrouteWrite(d.pools.mamba, armed=True))
    pub._xadd(streams.SINGLE.forward, encode(step))
    pub._xadd(streams.SINGLE.ownership, pub.shipper.sessions([], "x1"))  # nothing moved yet
    drain(OwnershipConsumer(redis_client, "store-1"))
    again = OwnershipConsumer(redis_client, "store-1")
    again.checker.read()  # its pending entries: the steps its last life had queued
    assert [p.step for p in again.checker.queued] == [plan.step_id]
    pub.run()
    drain(again)
    (v,) = again.ledger.violations
    assert (v.kind, v.step) == ("misrouted_write", plan.step_id)
    assert again.checker.checked == pub.published + 1 and again.checker.unchecked == 0


def test_an_op_for_an_owner_outside_the_step_and_a_foreign_kv_page_are_named(redis_client):
    d = Driver(page_size=4)
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    d.engine.sessions.open("idle")
    bystander = d.generate(text(9, 2), max_new=20)
    pub.step()
    other = d.generate(text(9, 3), max_new=2)
    plan = d.engine.plan_step()  # admits `other`: a clear for its fresh working slot
    step = plan.message(pub.shipper.epoch, "x1", d.pools)
    (dst,) = plan.ops.clears
    idle = d.engine.sessions.sessions["idle"].owner.id
    rows = list(step.rows)
    i = next(i for i, r in enumerate(rows) if r.rid == other.rid)
    foreign = int(d.pools.rows.pages[bystander.slots.row.slot, 0])  # the bystander's KV
    kv = rows[i].kv_indices.copy()
    kv[rows[i].start - rows[i].kv_from] = foreign * 4
    rows[i] = msgspec.structs.replace(rows[i], kv_indices=array(kv, I4))
    # and the clear claims to be for a bystander
    columns = RowColumns.of(rows)
    step = msgspec.structs.replace(step, columns=columns, clear_owners=array([idle], I8))
    pub.ship()
    pub._xadd(streams.SINGLE.forward, encode(step))
    pub.complete_oldest()
    d.engine.abort(other.rid)
    d.engine.abort(bystander.rid)
    pub.run()
    drain(consumer)
    by_pool = {v.pool: v for v in consumer.ledger.violations}
    assert set(by_pool) == {"mamba", "kv"}, consumer.ledger.violations
    assert by_pool["mamba"].slots == [dst] and by_pool["mamba"].expected == "a party of the step"
    assert by_pool["mamba"].actual == f"request:{other.rid}"  # the op names another owner
    assert "for session:idle, no party of the step" in by_pool["mamba"].detail
    assert by_pool["kv"].slots == [foreign]
    assert by_pool["kv"].expected == f"request:{other.rid}"
    assert by_pool["kv"].actual == f"request:{bystander.rid}"


def test_a_session_record_naming_slots_it_does_not_hold_is_reported(redis_client):
    d = Driver(page_size=4)
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    d.engine.sessions.open("chat")
    d.turn("chat", text(9, 4), max_new=3)
    pub.run()
    d.engine.sessions.dirty.add("chat")
    (record,) = d.engine.sessions.records.take_records()
    free = int(np.flatnonzero(d.pools.mamba.owner_view == 0)[0])
    misnamed = msgspec.structs.replace(record, working=free)
    pub._xadd(streams.SINGLE.ownership, pub.shipper.sessions([misnamed], "x1"))
    drain(consumer)
    (v,) = consumer.ledger.violations
    assert (v.kind, v.pool, v.slots) == ("record_not_owned", "mamba", [free])
    assert v.expected == "session:chat" and v.actual == "free"


# ---- the live services ----


def get(port: int, path: str, key: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


def post(port: int, path: str, body: dict, key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def generate(port: int, prompt: list[int], sid: str | None = None, key: str | None = None) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    if sid:
        body["session_params"] = {"id": sid}
    return post(port, "/generate", body, key)


def test_the_live_store_names_a_misrouted_write_of_the_scheduler(
    redis_url, redis_client, monkeypatch
):
    monkeypatch.setenv(ENV, "1")
    stack = start_stack(stack_settings(redis_url))
    try:
        out = generate(stack.settings.port, list(range(3, 20)))
        rid = out["meta_info"]["id"]
        deadline = time.monotonic() + 2
        while True:
            _, view = get(stack.settings.store_port, "/ledger")
            found = [v for v in view["violations"] if v["kind"] == "misrouted_write"]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        stack.stop()
    assert len(found) == 1, view
    (v,) = found
    assert v["pool"] == "mamba" and len(v["slots"]) == 1 and v["step"] >= 1
    assert v["expected"] == f"request:{rid}" and v["actual"] == "free"
    assert f"step {v['step']}" in v["detail"] and f"mamba_out of {rid}" in v["detail"]


def test_a_clean_live_run_checks_every_step_and_the_store_wants_an_operator_key(redis_url):
    stack = start_stack(stack_settings(redis_url, admin_api_keys="op-one, op-two"))
    s = stack.settings
    try:
        post(s.port, "/open_session", {"session_id": "chat"}, "op-one")
        for k in range(2):
            generate(s.port, text(6, k), sid="chat", key="op-one")
        generate(s.port, text(12, 5), key="op-one")
        post(s.port, "/close_session", {"session_id": "chat"}, "op-one")
        deadline = time.monotonic() + 10
        while True:
            _, view = get(s.store_port, "/ledger", "op-two")
            idle = not any(c["request"] or c["session"] for c in view["counts"].values())
            if (idle and not view["steps"]["queued"]) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert view["violations"] == [] and view["leaked"] == {}
        assert view["steps"]["checked"] > 5 and view["steps"]["unchecked"] == 0
        for path in ("/ledger", "/sessions/chat"):
            assert get(s.store_port, path)[0] == 401
            assert get(s.store_port, path, "op-three")[0] == 401
        assert get(s.store_port, "/sessions/chat", "op-one")[0] == 404  # closed: gone
        assert get(s.store_port, "/health")[0] == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{s.store_port}/metrics") as resp:
            misrouted = b'custody_ledger_violations{kind="misrouted_write",replica="0"} 0.0'
            assert misrouted in resp.read()
    finally:
        stack.stop()


def test_a_restarted_checker_reads_its_pending_steps_once_each_and_goes_on(redis_client):
    """Pending entries are read in pages, each once (reading them from "0" again and
    again never ends); a busy stream is read at most MAX_READ entries a call."""
    for i in range(1300):
        redis_client.xadd(streams.SINGLE.forward, {"m": b"not a step %d" % i})
    first = WriteChecker(redis_client, "store-1", streams.SINGLE.forward)
    first.read(most=1300)  # read, never acknowledged: the store dies here
    assert first.unchecked == 1300
    again = WriteChecker(redis_client, "store-1", streams.SINGLE.forward)
    again.read(most=1000)
    assert again.unchecked == 1000
    again.read()
    assert again.unchecked == 1300
    redis_client.xadd(streams.SINGLE.forward, {"m": b"late"})
    again.read()
    assert again.unchecked == 1301


def test_each_page_a_row_writes_is_listed_once_under_its_row_a_negative_one_too():
    """A malformed negative KV index must reach the check as the page it names (where
    the ledger finds no owner, a violation), not folded into another row's pages."""
    rows = [
        StepRow.of([1, 2, 3], 0, [32, 33, 34], 1, rid="a"),  # one page, three positions
        StepRow.of([4], 0, [-16], 2, rid="b"),
        StepRow.of([5, 6], 0, [48, 64], 3, rid="c"),
    ]
    writes = RowWrites.of(RowColumns.of(rows), page_size=16)
    assert list(zip(writes.kv_row.tolist(), writes.kv_page.tolist(), strict=True)) == [
        (0, 2),
        (1, -1),
        (2, 3),
        (2, 4),
    ]


def test_a_row_naming_another_request_or_an_owner_of_another_kind_is_named(redis_client):
    """Claims are checked as arrays (the kind from the id's low bits, the name by one
    lookup each): a row whose request owner is declared for another request, and one
    whose track owner is a request, each give one misrouted write naming the owner."""
    d = Driver(page_size=4)
    pub = Publisher(d, redis_client)
    consumer = OwnershipConsumer(redis_client, "store-1")
    a, b = d.generate(text(9, 2), max_new=20), d.generate(text(9, 3), max_new=20)
    pub.step()
    plan = d.engine.plan_step()
    step = plan.message(pub.shipper.epoch, "x1", d.pools)
    rows = list(step.rows)
    i, j = (next(k for k, r in enumerate(rows) if r.rid == req.rid) for req in (a, b))
    owner_a, owner_b = rows[i].owner, rows[j].owner
    rows[i] = msgspec.structs.replace(rows[i], owner=owner_b)  # a's row names b's owner
    rows[j] = msgspec.structs.replace(rows[j], track_owner=owner_b)  # a request as a track
    pub.ship()
    pub._xadd(
        streams.SINGLE.forward, encode(msgspec.structs.replace(step, columns=RowColumns.of(rows)))
    )
    pub.complete_oldest()
    d.engine.abort(a.rid)
    d.engine.abort(b.rid)
    pub.run()
    drain(consumer)
    misnamed = sorted((v.expected, v.actual) for v in consumer.ledger.violations if v.pool == "*")
    assert misnamed == sorted(
        [(f"request:{a.rid}", f"request:{b.rid}"), (f"track:{b.rid}", f"request:{b.rid}")]
    ), consumer.ledger.violations
    assert owner_a != owner_b
