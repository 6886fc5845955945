"""Shared fixtures. Every test session talks to a real Redis: REDIS_URL when set, else a
private redis-server started for the session on a free loopback port."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis

from shared.redis_server import PrivateRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with PrivateRedis(appendonly=False) as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A clean database for each test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()
