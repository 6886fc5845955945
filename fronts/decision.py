"""Where a request goes: the one routing decision of every front. The router is this
decision plus an HTTP proxy (services/router/), the endpoint picker this decision plus
Envoy's ext_proc (services/epp/); neither touches the directory, the chooser, the mover
or the session limits itself (tests/test_structure.py holds them to it).

`Decision.pick` reads a request as its replica will (the path its routes match, the
body, the session header) and answers a `Pick` (the replica, why, the body to send if
it names the session, and `done`: the bookkeeping once the answer's status is known),
or raises a `Refusal` the front answers itself:

- A session's request (`session_params.id`, `session_id`, or the session header) goes
  where the directory places it: remembered while the front hears every placement
  change, else read from Redis (fronts/directory.py). A session in transit, or placed
  on a replica that is not ready, is refused 503 with Retry-After: its state is there,
  and the turn waits. A move this front is making of it is waited for first.
- `/open_session` is placed (a `SET NX` on the directory) on the least loaded replica
  before it is sent there, named here when the client named none (the body is
  rewritten). An open that loses a race for the same id is sent where the winner
  placed it (that replica answers the conflict); an open refused leaves no placement,
  and one whose answer never came leaves no copy either.
- The first turn of a session only the header names is placed the same way (its
  replica opens the session as it runs the turn), and so is the first response of a
  stored conversation (`/v1/responses` without `previous_response_id`), named here
  when the client named none; a stored response's id names its session.
- `/fork_session` is placed the same way on its parent's replica, whose prefix cache
  holds the states the fork resumes from (the new name is `new_session_id`).
- Anything else goes by the prefix index within a load bound (fronts/choice.py), shed
  (429) while every allowed replica's queue is full when `max_queued` is set.
- `/flush_cache`, `/reset_prefix_cache`, an `abort_all` and an abort by a rid no front
  kept need every replica: `FanOut`, which the router sends to each and the picker,
  one endpoint, cannot.

A front given a subset of replicas (a gateway's hint) chooses within it, and refuses a
session placed outside it (503) rather than serve it elsewhere.
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field

from multidict import MultiMapping

from fronts.addressing import (
    FANOUT_ROUTES,
    aborts_all,
    header_session,
    new_conversation,
    read_json,
    session_of,
)
from fronts.front import Routing
from fronts.replicas import Opening, Replica
from shared.http_limits import MAX_BATCH, MAX_RID
from shared.placement import (
    OPENED_HEADER,
    PLACED_HEADER,
    ROUTED_EPOCH_HEADER,
    Placement,
    read_opened_mark,
)
from shared.retry import DEPENDENCY_FAULTS
from shared.session_header import RepeatedHeader
from shared.session_ids import SESSION_ID, scoped_session_id, session_name, valid_session_name
from shared.tenancy import Caller, Refused, authorization

log = logging.getLogger("custody.router")
PROBES = frozenset({"/health_generate"})  # any ready replica, no key: a liveness probe


class Refusal(Exception):
    """A front's own answer to a request, shaped as the replicas shape their errors, with
    its headers (Retry-After 1 when `retry`; a key refused may bring its own)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        retry: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.retry = status, kind, retry
        self.headers = {**(headers or {}), **({"Retry-After": "1"} if retry else {})}

    def body(self) -> bytes:
        return json.dumps({"error": {"message": str(self), "type": self.kind}}).encode()


class FanOut(Refusal):
    """A request for every ready replica: the router sends it to each; a front of one
    endpoint answers this refusal."""

    def __init__(self, path: str) -> None:
        super().__init__(
            501,
            f"{path} here goes to every replica, which one endpoint cannot be: send it to "
            "each replica, or through the custody router",
            "fan_out_unsupported",
        )


def _nothing(status: int | None, headers: Mapping[str, str]) -> None:
    """A pick with no bookkeeping after its answer."""


@dataclass
class Pick:
    replica: Replica
    decision: str  # affinity, prefix, load, random or request
    kind: str  # open, turn or other (the decision-time metric's label)
    body: bytes | None = None  # the body to send instead of the client's (an open named)
    placing: bool = False  # a placement written for it: the replica is told
    # the session's placement came from memory: its replica answering that it does not
    # hold the session (404) or not now (503) may mean a change still on its way, and a
    # front that can try again picks once more with `fresh`
    remembered: bool = False
    # called once with the answer's status and headers (None: no answer came), for the
    # bookkeeping an open or a close leaves (placements kept or taken back)
    done: Callable[[int | None, Mapping[str, str]], None] = field(default=_nothing)
    epoch: int | None = None  # the placement epoch a placed session's request is routed by

    def upstream_headers(self) -> dict[str, str]:
        """The fronts' own headers on the request sent (`OWN_HEADERS`; a client's own
        are never passed on): an open placed for it, the placement epoch routed by."""
        headers = {PLACED_HEADER: "1"} if self.placing else {}
        if self.epoch is not None:
            headers[ROUTED_EPOCH_HEADER] = str(self.epoch)
        return headers


OWN_HEADERS = (PLACED_HEADER, ROUTED_EPOCH_HEADER)


def endpoint(replica: Replica) -> str:
    """`ip:port` of a replica's registered URL (`http://ip:port`)."""
    return replica.url.partition("://")[2].rstrip("/")


class Decision:
    def __init__(
        self,
        routing: Routing,
        background: Callable[[Callable[[], Awaitable[object]]], None],
        session_header: str = "",
        max_queued: int = 0,
    ) -> None:
        """`background(work)`: runs a bookkeeping coroutine function until it succeeds;
        `session_header`: the header naming a chat request's implicit session;
        `max_queued`: shed (429) while every replica allowed has this many waiting (0:
        never; each replica's own bound, the same setting)."""
        self.table, self.directory, self.chooser = routing.table, routing.directory, routing.chooser
        self.limits, self.mover, self.tenancy = routing.limits, routing.mover, routing.tenancy
        self.background, self.session_header = background, session_header
        self.max_queued = max_queued

    @property
    def declared_dead(self) -> collections.Counter[str]:
        """Replicas this front found dead, by id (a death no fault explains is a false
        alarm to look into)."""
        return self.mover.declared_dead

    async def pick(
        self,
        path: str,
        headers: MultiMapping[str],
        body: bytes,
        subset: Collection[str] | None = None,
        fresh: bool = False,
    ) -> Pick:
        """The replica for a request (`path` as the replica's routes match it, `headers`
        every copy of each, as it reads them); raises `Refusal`. `subset`: the endpoints
        allowed (None: any); `fresh`: read a session's placement from the directory."""
        only = self._allowed(subset)
        if path in PROBES:
            return Pick(self._least_loaded(only), "load", "other")
        caller = self._caller(headers, path)
        parsed, tenant = read_json(body), caller.tenant
        if path in FANOUT_ROUTES or aborts_all(path, parsed):
            raise FanOut(path)
        if path == "/abort_request":
            return await self._abort(parsed, tenant, only)
        if path == "/open_session":
            return await self._open(self._least_loaded(only), "session_id", parsed, tenant, only)
        if path == "/fork_session":
            return await self._fork(parsed, tenant, only)
        try:
            implied = header_session(path, parsed, headers, self.session_header, tenant)
        except RepeatedHeader as err:
            raise Refusal(400, str(err), "invalid_request_error") from None
        rewritten = None
        if implied is None and new_conversation(path, parsed):
            if parsed.get("session_id") is None:  # named here, so it can be placed first
                parsed["session_id"] = secrets.token_hex(12)
                rewritten = json.dumps(parsed).encode()
            if valid_session_name(parsed["session_id"]):
                implied = scoped_session_id(tenant, parsed["session_id"])
        implicit = implied is not None  # opened by the turn that names it
        sid = implied if implicit else session_of(path, parsed, tenant)
        if sid is not None:
            await self.mover.settled(sid)
            remembered = None if fresh else self.directory.remembered(sid)
            home = remembered or await self.directory.session(sid)
            if home is not None:
                return self._placed(path, sid, home, only, remembered is not None)
            if implicit:
                return await self._place_implicit(sid, tenant, only, rewritten)
        return self._choose(path, parsed, tenant, only)

    async def drain(self, headers: MultiMapping[str], body: bytes) -> dict:
        """`POST /admin/drain` (an operator's): move every session off the replica the
        body names, which takes nothing new from then on."""
        if not self._caller(headers, "/admin/drain").operator:
            raise Refusal(403, "/admin/drain needs an operator key", "permission_error")
        parsed = read_json(body)
        replica = parsed.get("replica") if parsed else None
        if not isinstance(replica, str) or replica not in self.table.known:
            raise Refusal(404, f"no replica {replica!r}", "not_found")
        return await self.mover.drain(replica)

    def _caller(self, headers: MultiMapping[str], path: str) -> Caller:
        """Who asks, as each replica checks it (shared/tenancy.py): a refused key is a
        `Refusal` with the refusal's status and headers."""
        try:
            return self.tenancy.caller(authorization(headers), path)
        except Refused as refused:
            raise Refusal(
                refused.status, str(refused), refused.kind, headers=refused.headers
            ) from None

    def _allowed(self, subset: Collection[str] | None) -> set[str] | None:
        """The replica ids the subset allows; None: every one."""
        if subset is None:
            return None
        allowed = {r.id for r in self.table.ready() if endpoint(r) in subset}
        if not allowed:
            raise Refusal(503, "no ready replica in the gateway's subset", "no_replica", True)
        return allowed

    def _placed(
        self, path: str, sid: str, home: Placement, only: set[str] | None, remembered: bool
    ) -> Pick:
        """A placed session's request: to its replica, or refused while it cannot run."""
        if home.moving_to is not None:
            message = f"session {session_name(sid)} is moving to replica {home.moving_to}; retry"
            raise Refusal(503, message, "moving", retry=True)
        replica = self.table.live.get(home.replica)
        if replica is None or not replica.executor or (only is not None and replica.id not in only):
            message = f"replica {home.replica} is not available; retry"
            raise Refusal(503, message, "replica_unavailable", retry=True)
        done = _nothing
        if path == "/close_session":

            def done(status: int | None, headers: Mapping[str, str]) -> None:
                if status == 200:  # only the placement it was routed by: never a newer one
                    self.background(lambda: self.directory.take_back(sid, home))

        kind = "open" if path == "/open_session" else "turn"
        return Pick(replica, "affinity", kind, remembered=remembered, done=done, epoch=home.epoch)

    def _least_loaded(self, only: set[str] | None) -> Replica:
        replica = self.table.least_loaded(only=only)
        if replica is None:
            raise Refusal(503, "no replica is ready", "no_replica", retry=True)
        return replica

    async def _place_implicit(
        self, sid: str, tenant: str | None, only: set[str] | None, body: bytes | None = None
    ) -> Pick:
        """The first turn of a session the header names (or of a stored conversation),
        placed before it is sent (its replica opens the session as it runs the turn): the
        directory, not this front, decides where later turns go, so no two replicas ever
        hold it. `body`: the request's, rewritten to name the session."""
        replica = self._least_loaded(only)
        refused = self.limits.refuse_open(tenant)
        if refused is not None:
            raise Refusal(429, refused, "session_limit")
        home, _ = await self._place(sid, replica)
        if home.replica != replica.id:
            return self._placed("", sid, home, only, remembered=False)
        return Pick(replica, "affinity", "turn", body, placing=True)

    async def _fork(self, parsed: dict | None, tenant: str | None, only: set[str] | None) -> Pick:
        """A fork opens on its parent's replica; a parent placed nowhere goes by load (its
        replica answers that it does not know it)."""
        parent = session_of("/fork_session", parsed, tenant)
        if parent is not None:
            await self.mover.settled(parent)
        home = None if parent is None else await self.directory.session(parent)
        if home is None:
            return Pick(self._least_loaded(only), "load", "open")
        replica = self._placed("/fork_session", parent, home, only, remembered=False).replica
        return await self._open(replica, "new_session_id", parsed, tenant, only)

    async def _open(
        self,
        replica: Replica,
        field: str,
        parsed: dict | None,
        tenant: str | None,
        only: set[str] | None,
    ) -> Pick:
        """Placed on `replica` (the session's name in `field`), then sent where placed
        (see the module's doc)."""
        name = parsed.get(field) if parsed is not None else None
        if parsed is None or (name is not None and not isinstance(name, str)):
            return Pick(replica, "load", "open")  # the replica answers it with its 400
        rewritten = None
        if name is None:
            name = parsed[field] = secrets.token_hex(16)
            rewritten = json.dumps(parsed).encode()
        if not valid_session_name(name):  # refused before it can name a Redis key
            raise Refusal(400, f"session_id must match {SESSION_ID.pattern}", "session_invalid")
        sid = scoped_session_id(tenant, name)
        refused = self.limits.refuse_open(tenant)
        if refused is not None:
            raise Refusal(429, refused, "session_limit")
        home, placed = await self._place(sid, replica)
        if home.replica != replica.id:
            return self._placed("/open_session", sid, home, only, remembered=False)
        opening = Opening(tenant)
        replica.placed.append(opening)  # counted while it runs (fronts/replicas.py)

        def done(status: int | None, headers: Mapping[str, str]) -> None:
            replica.placed.remove(opening)
            if status == 200:
                mark = read_opened_mark(headers.get(OPENED_HEADER.lower()))
                replica.answered(Opening(tenant, time.monotonic(), mark))
            elif placed and status is not None:
                self.background(lambda: self.directory.forget(sid, replica.id))
            elif placed:  # no answer: the replica may have opened it; nothing stays
                self.background(lambda: self._abandon(sid, replica))

        return Pick(replica, "affinity", "open", rewritten, placing=True, done=done)

    async def _place(self, sid: str, replica: Replica) -> tuple[Placement, bool]:
        """The session placed on `replica` unless placed already (the directory's `SET
        NX`). A write whose answer never came (Redis cut off, refusing) may still have
        landed, with no open ever sent: it is taken back (a compare-and-delete, retried in
        the background), and the front answers 503."""
        try:
            return await self.directory.place(sid, replica.id)
        except DEPENDENCY_FAULTS:
            self.background(lambda: self.directory.take_back(sid, Placement(replica.id)))
            raise

    async def _abandon(self, sid: str, replica: Replica) -> None:
        """An open whose answer never came: its placement goes (compare-and-delete if
        the removal itself fails part-way), then the copy its replica may have opened."""
        try:
            await self.directory.forget(sid, replica.id)
        except DEPENDENCY_FAULTS:
            await self.directory.take_back(sid, Placement(replica.id))
        await self.mover.release(replica, sid)

    async def _abort(self, parsed: dict | None, tenant: str | None, only: set[str] | None) -> Pick:
        rid = parsed.get("rid") if parsed else None
        home = await self.directory.request(tenant or "-", rid) if isinstance(rid, str) else None
        replica = None if home is None else self.table.live.get(home)
        if replica is None or (only is not None and replica.id not in only):
            raise FanOut("/abort_request")
        return Pick(replica, "request", "other")

    def _choose(
        self, path: str, parsed: dict | None, tenant: str | None, only: set[str] | None
    ) -> Pick:
        """A request no session binds: by prefix within the load bound, else by load;
        shed when every replica allowed has a full queue."""
        allowed = self.table.placeable(only=only)
        if self.max_queued and allowed and all(r.queued >= self.max_queued for r in allowed):
            raise Refusal(429, "every replica's queue is full; retry later", "overloaded", True)
        choice = self.chooser.pick(path, parsed, tenant, only)
        if choice is None:
            raise Refusal(503, "no replica is ready", "no_replica", retry=True)
        if path == "/generate" and parsed is not None:
            self._remember_rids(tenant or "-", parsed.get("rid"), choice.replica.id)
        return Pick(choice.replica, choice.decision, "other")

    def _remember_rids(self, tenant: str, rid: object, replica: str) -> None:
        """Kept while the request runs, for an abort by rid (an abort by a rid not yet
        kept goes to every replica, so it still finds it). A rid the replica will refuse
        (a list longer than a batch, an id empty or too long) is not kept: the work a
        request costs a front is bounded before it is looked at."""
        rids = rid if isinstance(rid, list) else [rid]
        if len(rids) > MAX_BATCH or not all(
            isinstance(one, str) and 0 < len(one) <= MAX_RID for one in rids
        ):
            return
        self.background(lambda: self.directory.remember_requests(tenant, rids, replica))
