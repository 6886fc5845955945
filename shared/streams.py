"""Redis names and the Redis stream operations every service uses the same way.

Every name of one replica (its streams, its executor's and scheduler's keys, its session
records, its ledger checkpoint) carries the hash tag `{r<replica>}`: on a Redis Cluster
all of them hash to one slot, so a replica's transactions and pipelines stay on one shard,
and two replicas on one Redis never read each other's. The few names that span replicas
(the replica set, a session's placement, a request's replica) are each one key, read and
written by single-key commands."""

from __future__ import annotations

import re
from dataclasses import dataclass

import redis

STORE_GROUP = "session-store"
EXECUTOR_GROUP = "executor"
# Approximate bound of a stream: far above the worst lag of its consumer, so nothing
# unread is ever trimmed (trimming with ~ keeps whole radix-tree nodes, cheaply).
MAXLEN = 100_000
REPLICA_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
REPLICAS = "custody:replicas"  # set of replica ids ever registered (the store reads each)
MOVES = "custody:moves"  # sessions in transit between replicas (shared/placement.py)
# a pub/sub channel: every write of a placement key publishes "<key> <new value>" on it
# ("<key>" alone for a removal), so a front may answer from the placements it keeps
# while it is subscribed (fronts/directory.py)
PLACEMENT_CHANGES = "custody:placement_changes"
# held by the one front (router or endpoint picker) taking over moves and re-homing now
FRONT_DUTIES = "custody:front_duties"


def placement_key(sid: str) -> str:
    """Where a session lives (`shared.placement.Placement`): the router's placement
    directory, one key each."""
    return f"custody:placement:{sid}"


def request_key(rid: str) -> str:
    """The replica a request runs on (for an abort through the router)."""
    return f"custody:rid:{rid}"


@dataclass(frozen=True)
class Keys:
    """The Redis names of one replica."""

    replica: str = "0"

    def _name(self, part: str) -> str:
        return f"custody:{{r{self.replica}}}:{part}"

    @property
    def ownership(self) -> str:
        return self._name("ownership")

    @property
    def forward(self) -> str:
        return self._name("forward")

    @property
    def results(self) -> str:
        return self._name("results")

    @property
    def executor_alive(self) -> str:
        """The live executor's epoch, expiring."""
        return self._name("executor-alive")

    @property
    def scheduler_epoch(self) -> str:
        """The live scheduler's epoch (fencing)."""
        return self._name("scheduler-epoch")

    @property
    def alive(self) -> str:
        """The replica's registration (address, epoch, load), expiring: the router routes
        only to replicas whose key is there."""
        return self._name("alive")

    @property
    def placed(self) -> str:
        """Set of the sessions the placement directory puts on this replica (the router
        keeps it beside each placement)."""
        return self._name("placed")

    @property
    def draining(self) -> str:
        """Set while the replica is drained: the router places nothing new on it."""
        return self._name("draining")

    @property
    def rehoming(self) -> str:
        """Held (expiring) by the router re-homing this dead replica's sessions; its
        restarted scheduler waits for it to go before it takes its sessions back."""
        return self._name("rehoming")

    @property
    def sessions(self) -> str:
        """Set of persisted session ids."""
        return self._name("sessions")

    def session(self, sid: str) -> str:
        return self._name(f"session:{sid}")

    @property
    def trimmed_unread(self) -> str:
        """The first ownership entry kept when the scheduler last had to trim entries the
        store had not read (runtime/outbox.py `trim`): the store finds that gap by it
        where no sequence shows one (an epoch's end trimmed away whole)."""
        return self._name("trimmed-unread")

    @property
    def lost(self) -> str:
        """Set of session ids whose records the store could not prove current after a
        gap whose writer died (services/session_store/consumer.py): each answers
        `session_lost` until its client closes it."""
        return self._name("lost")

    @property
    def checkpoint(self) -> str:
        """The store's ledger of this replica."""
        return self._name("ledger")

    @property
    def snapshot_wanted(self) -> str:
        return self._name("snapshot-wanted")

    @property
    def cache_snapshot_wanted(self) -> str:
        """Set by a router that wants the replica's prefix cache whole (its index is
        new, or it saw a gap); the scheduler deletes it as it queues the snapshot."""
        return self._name("cache-snapshot-wanted")

    @property
    def tier_in_flight(self) -> str:
        """The executor's tier moves in flight (hash kind -> count), set while a step's
        moves run: after a kill, a fault drill reads what was moving."""
        return self._name("executor:tier_in_flight")

    @property
    def grammar_checks(self) -> str:
        """List of the scheduler's grammar compile checks, which the executor pops
        (shared/messages/grammar.py); each names the key its answer goes to."""
        return self._name("grammar-checks")

    def grammar_verdict(self, check: str) -> str:
        return self._name(f"grammar-verdict:{check}")


SINGLE = Keys()  # the names of a single-replica stack (replica "0")


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create the consumer group (reading the stream from its start) if it is missing."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise
