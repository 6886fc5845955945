"""Moving sessions between replicas: draining one before it stops, and re-homing the
sessions of one that died.

A move has two phases, and the placement directory is its commit point. First the
session's state is copied: the replica it leaves stops its turns and places its state
on its disk tier (`/admin/migrate_out`), and the replica it goes to opens it from the
record the first one persisted and copies its blob (`/admin/migrate_in`). Then the
placement is flipped, only if it still names the replica the session left (one key,
compare-and-set), and the old replica closes its copy (`/admin/migrate_done`). Until the
flip every router sends turns to the old replica, which answers 503 while the session is
moving; this router holds them instead, and sends them on once the move is over. A move
that fails before the flip leaves the session where it was (`/admin/migrate_cancel`).

A replica is dead once its registration has been missing for `replica_dead_seconds`;
until then its sessions' turns wait (503, Retry-After). Then one front (the one holding
the duties lease, `streams.FRONT_DUTIES`, and the replica's `rehoming` key under a lease
it renews) moves each of its sessions to a live
replica, from the record the store persisted: with the state when that record names a
blob the new replica can read, else from the history. Its restarted scheduler waits for
the key to go, then takes back nothing the directory has placed elsewhere."""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time

import aiohttp
from prometheus_client import Counter

from fronts.directory import Directory
from fronts.replicas import Replica, ReplicaTable
from protocol.moves import (
    ABSENT,
    Abort,
    Begin,
    CallIn,
    CallOut,
    Commit,
    DropLost,
    Effect,
    MoveRun,
    Read,
    Release,
    Unlist,
    Unlisted,
)
from shared import streams
from shared.key_lease import KeyLease
from shared.placement import Move
from shared.retry import Retry

log = logging.getLogger("custody.router")
RELEASE_ATTEMPTS = 6  # over about 12 s
# an admin call's bound: longer than a replica's own bound on any of them (a move's
# arrival waits up to 10 s for the store's proof and 30 s for its copy)
CALL_SECONDS = 60.0
MOVE_SECONDS = 2 * CALL_SECONDS  # a move's bound: its state out, then in (each one call)
MIGRATE_DONE, MIGRATE_CANCEL = "/admin/migrate_done", "/admin/migrate_cancel"


class Mover:
    def __init__(
        self,
        table: ReplicaTable,
        directory: Directory,
        session: aiohttp.ClientSession,
        admin_key: str | None,
        dead_seconds: float,
        forget_seconds: float = 0.0,
    ) -> None:
        """`forget_seconds`: how long a replica stays dead, nothing placed on it, before
        its id leaves the replica set (0: never)."""
        self.table, self.directory, self.session = table, directory, session
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.dead_seconds, self.forget_seconds = dead_seconds, forget_seconds
        self.moving: dict[str, asyncio.Event] = {}
        self.last_seen: dict[str, float] = {}
        self.moved = {"state": 0, "history": 0, "failed": 0, "gone": 0}
        self.declared_dead: collections.Counter[str] = collections.Counter()  # by replica
        self._dead_before: set[str] = set()

    async def settled(self, sid: str) -> None:
        """Until a move of `sid` by this router is over."""
        event = self.moving.get(sid)
        if event is not None:
            await event.wait()

    async def _post(
        self, replica: Replica, path: str, sid: str, extra: dict | None = None
    ) -> tuple[int, object]:
        """`replica`'s answer to an admin call, or 503 when it cannot be had: not
        connected, no answer within `CALL_SECONDS`, or the replica stopped registering
        meanwhile (paused, hung, cut off). A call must not hold a move, and the duties
        behind it, for as long as TCP takes to give up on a peer that never answers."""
        body = {"session_id": sid, **(extra or {})}
        call = asyncio.ensure_future(self._request(replica, path, body))
        try:
            while not call.done():
                await asyncio.wait({call}, timeout=self.table.period)
                if not call.done() and replica.id not in self.table.live:
                    return 503, f"replica {replica.id} stopped registering during {path}"
            return call.result()
        finally:
            call.cancel()

    async def _request(self, replica: Replica, path: str, body: dict) -> tuple[int, object]:
        timeout = aiohttp.ClientTimeout(total=CALL_SECONDS)
        try:
            async with self.session.post(
                replica.url + path, json=body, headers=self.headers, timeout=timeout
            ) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as err:
            return 503, str(err) or type(err).__name__

    async def release(self, replica: Replica, sid: str, path: str = MIGRATE_DONE) -> bool:
        """Close `replica`'s copy of `sid`, which the directory places elsewhere (or, by
        `path` /admin/migrate_cancel, let it take turns again); whether it answered. A
        replica that cannot answer now (Redis away, restarting) is asked again, a few
        times, so a failed open or move leaves no copy behind."""
        for attempt in range(RELEASE_ATTEMPTS):
            status, answer = await self._post(replica, path, sid)
            if status < 500:
                return True
            if replica.id not in self.table.live:
                break  # it settles from the directory once back (directory_check.py)
            await asyncio.sleep(0.2 * 2**attempt)
        log.warning("session %s: %s on %s not answered: %s", sid, path, replica.id, answer)
        return False

    async def move(self, sid: str, source: str, target: Replica) -> str:
        """Move `sid` from replica `source` (live or dead) to `target`; how it went:
        `state` (its state came along), `history` (it will re-prefill), `failed` or
        `gone` (protocol/moves.py decides each step)."""
        run = MoveRun.fresh_move(sid, source, target.id, secrets.token_hex(8))
        self.moving[sid] = asyncio.Event()
        try:
            outcome = await self._drive(run, target, listed=False)
        finally:
            self.moving.pop(sid).set()
        if outcome is not None:
            self.moved[outcome] += 1
            log.info("session %s: %s -> %s: %s", sid, source, target.id, outcome)
        return outcome or "failed"

    async def _drive(self, run: MoveRun, target: Replica | None, listed: bool) -> str | None:
        """Perform `run`'s effects one at a time until it is over; its lease is renewed
        while it is listed (a slow step, a large blob's copy, does not let another front
        take it over)."""
        holding = asyncio.ensure_future(self._hold(run.move)) if listed else None
        try:
            effect: Effect | None = run.first()
            while effect is not None:
                result = await self._perform(run.move, effect, target)
                if isinstance(effect, Begin) and result:
                    holding = asyncio.ensure_future(self._hold(run.move))
                run, effect = run.advance(result)
            return run.outcome
        finally:
            if holding is not None:
                holding.cancel()

    async def _perform(self, move: Move, effect: Effect, target: Replica | None) -> object:
        """One effect of a move's run, against the directory or a replica."""
        directory, sid = self.directory, move.sid
        match effect:
            case Read():
                return await directory.session(sid)
            case Unlisted():
                # closed, or moved elsewhere, while `source` still lists it: a member whose
                # removal was lost, which a drain or re-homing would retry for good
                await directory.client.srem(streams.Keys(move.source).placed, sid)
            case Begin():
                return await directory.begin(move)
            case CallOut():
                leaving = self.table.live.get(move.source)
                if leaving is None:  # its records alone only once it is surely not serving
                    return ABSENT if self._gone(move.source) else 503
                status, answer = await self._post(leaving, "/admin/migrate_out", sid)
                if status != 200:
                    log.warning("session %s stays on %s: %s", sid, move.source, answer)
                return status
            case CallIn():
                body = {"source": move.source, "epoch": move.epoch + 1, "move": move.nonce}
                status, placed = await self._post(target, "/admin/migrate_in", sid, body)
                if status != 200:
                    log.warning("session %s not moved to %s: %s", sid, move.target, placed)
                has_state = isinstance(placed, dict) and placed.get("cached_tokens", 0) > 0
                return status, has_state
            case Commit():
                return await directory.commit(move)
            case Abort():
                return await directory.abort(move)
            case DropLost():
                # the dead source's records, proven current, hold no record of the session
                # (closed there, its placement's removal lost): nothing can carry it
                log.error("session %s of dead replica %s has no record: dropped", sid, move.source)
                if await directory.swap_out(sid, move.in_transit):
                    await directory.client.srem(streams.Keys(move.source).placed, sid)
            case Release(replica=rid, cancel=cancel):
                replica = self.table.live.get(rid)
                if replica is None:
                    return True  # it settles from the directory once back (directory_check.py)
                return await self.release(replica, sid, MIGRATE_CANCEL if cancel else MIGRATE_DONE)
            case Unlist():
                await directory.done(move)
        return None

    async def _hold(self, move: Move) -> None:
        while True:
            await self.directory.renew(move)
            await asyncio.sleep(self.directory.lease_seconds / 3)

    async def recover(self) -> None:
        """Finish, or undo, every move whose front's lease ran out (it died, or lost
        Redis): a move still in transit is carried on if its target is ready, else
        undone; any other is settled as its placement now stands (protocol/moves.py)."""
        for move in await self.directory.abandoned():
            target = next((r for r in self.table.ready() if r.id == move.target), None)
            log.warning("taking over the move of %s (%s -> %s)", move.sid, move.source, move.target)
            run = MoveRun(move, fresh=False, target_ready=target is not None)
            outcome = await self._drive(run, target, listed=True)
            if outcome is not None:
                self.moved[outcome] += 1

    async def drain(self, replica: str) -> dict:
        """Place nothing new on `replica` and move every session off it."""
        await self.directory.client.set(streams.Keys(replica).draining, 1)
        await self.table.refresh()
        return await self._empty(replica)

    async def _empty(self, replica: str) -> dict:
        outcomes = {"state": 0, "history": 0, "failed": 0, "gone": 0}
        for sid in await self.directory.placed_on(replica):
            target = self.table.least_loaded(excluding=replica)
            if target is None:
                outcomes["failed"] += 1
                continue
            outcomes[await self.move(sid, replica, target)] += 1
        return {"replica": replica, **outcomes}

    async def watch(self, faults: Counter | None = None) -> None:
        """Take over abandoned moves, re-home the sessions of replicas found dead and
        forget long-dead ones, forever: one pass every period by whichever front holds
        the duties lease then (each front notes which replicas it sees live every period,
        lease or not, so a front that takes the lease over knows how long each has been
        gone). A fault (one bad entry must not end the loop for every other) is counted
        in `faults`, logged and retried after a backoff (shared/retry.py)."""
        retry = Retry("move_takeover", log, faults)
        lease = KeyLease(self.directory.client, streams.FRONT_DUTIES, self.directory.lease_seconds)
        while True:
            await asyncio.sleep(self.table.period)
            dead = self._dead()
            try:
                async with lease.held() as mine:
                    if mine:
                        await self.recover()
                        for replica in dead:
                            await self._rehome(replica)
                            await self._forget(replica)
            except Exception as err:
                await retry.wait(err)
                continue
            retry.ok()

    def _dead(self) -> list[str]:
        """The replicas not seen live for `dead_seconds`; each newly found so is counted
        (`declared_dead`: a death no fault explains is a false alarm to look into)."""
        now = time.monotonic()
        for rid in self.table.live:
            self.last_seen[rid] = now
        for rid in self.table.known:
            self.last_seen.setdefault(rid, now)  # a replica first seen dead gets its grace
        dead = [r for r in self.last_seen if self._gone(r)]
        self.declared_dead.update(set(dead) - self._dead_before)
        self._dead_before = set(dead)
        return dead

    def _gone(self, replica: str) -> bool:
        """Whether `replica` has been missing for `dead_seconds`: its lease ended before
        that (protocol/lives.py), so it acknowledges nothing more until it has checked
        its sessions against the directory. One whose registration merely lapsed (a
        write refused, a short stall) may still serve under its lease: a move carried
        from its records then missed a turn it answered meanwhile (the fault campaign's
        stale turn, after a drain)."""
        seen = self.last_seen.get(replica)
        return seen is not None and time.monotonic() - seen > self.dead_seconds

    async def _forget(self, replica: str) -> None:
        """A replica dead for `forget_seconds` whose sessions all moved leaves the
        replica set (every router stops watching it, the store stops its consumer): with
        ids made up per container, every recreated one would add an id for good."""
        dead_for = time.monotonic() - self.last_seen[replica]
        if not self.forget_seconds or dead_for < self.forget_seconds:
            return
        client, keys = self.directory.client, streams.Keys(replica)
        if await client.exists(keys.alive, keys.rehoming) or await self.directory.placed_on(
            replica
        ):
            return
        await client.srem(streams.REPLICAS, replica)
        del self.last_seen[replica]
        log.info("replica %s forgotten: dead for %.0f s, nothing placed on it", replica, dead_for)

    async def _rehome(self, replica: str) -> None:
        """Move a dead replica's sessions, holding its `rehoming` key (shared/key_lease.py)
        so that one router does it and the replica, back, waits for it to end. Were the
        lease lost meanwhile, a second router moving the same sessions is still safe:
        each move is a compare-and-set on the directory."""
        client, keys = self.directory.client, streams.Keys(replica)
        if not await self.directory.placed_on(replica):
            return
        async with KeyLease(client, keys.rehoming, self.directory.lease_seconds).held() as mine:
            if not mine:
                return  # another router is at it
            if await client.exists(keys.alive):
                return  # it came back
            log.warning("replica %s is dead: re-homing its sessions", replica)
            log.info("re-homed from %s: %s", replica, await self._empty(replica))
