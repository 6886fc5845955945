"""What every front (the router, the endpoint picker) runs to decide where requests go,
built one way from the settings: the replicas' registrations, their prefix caches'
index, the choice, the placement directory, the mover and the session limits; and the
loops that keep them current."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import redis.asyncio as aioredis
from prometheus_client import Counter

from fronts.choice import Chooser, PrefixCounters
from fronts.directory import Directory
from fronts.limits import SessionLimits
from fronts.migration import Mover
from fronts.prefix_feed import PrefixFeed
from fronts.prefix_index import PrefixIndex
from fronts.replicas import ReplicaTable
from shared.config import Settings
from shared.tenancy import ApiKeys
from shared.tokenizer import load_tokenizer


@dataclass
class Routing:
    client: aioredis.Redis
    table: ReplicaTable
    index: PrefixIndex
    chooser: Chooser
    directory: Directory
    mover: Mover
    limits: SessionLimits
    tenancy: ApiKeys

    @classmethod
    def of(
        cls,
        settings: Settings,
        table: ReplicaTable,
        counters: PrefixCounters,
        session: aiohttp.ClientSession,
    ) -> Routing:
        """`table` (`replica_table`; its front's metrics watch it first), `counters`
        (the front's), `session`: the front's HTTP client, which the mover calls
        replicas with."""
        client, index = table.client, PrefixIndex()
        tokenizer = load_tokenizer(settings.model, settings.tokenizer)  # as replicas tokenize
        chooser = Chooser(
            table, index, tokenizer, settings.context_len, counters, settings.router_policy
        )
        directory = Directory(client, lease_seconds=settings.replica_dead_seconds)
        keys = [k.strip() for k in settings.admin_api_keys.split(",") if k.strip()]
        mover = Mover(
            table,
            directory,
            session,
            keys[0] if keys else None,
            settings.replica_dead_seconds,
            settings.replica_forget_seconds,
        )
        limits = SessionLimits(table, settings.max_sessions_per_key, settings.max_sessions)
        tenancy = ApiKeys(settings.api_keys, settings.admin_api_keys)
        return cls(client, table, index, chooser, directory, mover, limits, tenancy)

    def loops(self, faults: Counter) -> list[asyncio.Task]:
        """The loops besides the registration reads (`table.run`): the prefix feeds, the
        placement notices (fronts/directory.py) and the duties (fronts/migration.py)."""
        return [
            asyncio.create_task(PrefixFeed(self.client, self.table, self.index).run(faults)),
            asyncio.create_task(self.directory.follow_changes(faults)),
            asyncio.create_task(self.mover.watch(faults)),
        ]


def replica_table(settings: Settings, client: aioredis.Redis) -> ReplicaTable:
    return ReplicaTable(
        client,
        period=min(0.5, settings.heartbeat_seconds),
        secret=settings.cluster_secret,
        settle=3 * settings.heartbeat_seconds + 0.5,
    )


def refuse_keys_without_secret(settings: Settings, front: str) -> None:
    """A front sends API keys on to the replicas registrations name: only to replicas
    whose registrations the cluster secret signed."""
    if settings.api_keys.strip() and not settings.cluster_secret:
        raise SystemExit(
            f"--api-keys without --cluster-secret: the {front} would send API keys to "
            "whatever address a Redis registration names; set --cluster-secret (the same "
            "on every replica) too"
        )
