"""Two replicas, the router and the session store on a three-node Redis Cluster of
real `redis-server` processes: custody runs unchanged (the cluster is detected), every
session's turns resume from state on its replica and equal one-shot, a drain moves
state between replicas, and neither replica's ledger leaks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shared.redis_client import connect
from shared.redis_server import PrivateCluster
from tests.services_harness import call, stack_settings, start_stack
from tests.test_migration import SESSIONS, check_one_shot, ledgers_clean, placements, play


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateCluster]:
    with PrivateCluster(3) as running:
        yield running


def test_two_replicas_serve_and_move_sessions_on_a_redis_cluster(cluster: PrivateCluster):
    stack = start_stack(stack_settings(cluster.url, replicas=2))
    client = connect(cluster.url)
    try:
        port, rng = stack.settings.port, np.random.default_rng(11)
        sids = [call(port, "/open_session", {}) for _ in range(SESSIONS)]
        history = {sid: [] for sid in sids}
        play(port, sids, history, rng, 2, resumed=False)
        play(port, sids, history, rng, 1, resumed=True)
        assert sorted(set(placements(client, sids).values())) == ["0", "1"]
        moved = call(port, "/admin/drain", {"replica": "1"})
        assert moved["failed"] == 0 and moved["history"] == 0
        play(port, sids, history, rng, 1, resumed=True)
        check_one_shot(sids, history)
        ledgers_clean(stack)
    finally:
        client.close()
        stack.stop()
