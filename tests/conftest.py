"""Shared fixtures. Every test session talks to a real Redis: REDIS_URL when set, else a
private redis-server started for the session on a free loopback port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from custody.up import Stack
from shared.redis_server import PrivateRedis
from tests.checkpoints import (
    AGENT_LAYERS,
    AGENT_MOE,
    AGENT_TEMPLATE,
    build_chat_checkpoint,
    reference,
)
from tests.services_harness import (
    agent_settings,
    stack_settings,
    start_stack,
    without_scheduler,
)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis of this test process's own: a private server, or the database of
    `REDIS_URL` numbered as this pytest-xdist worker (two workers' stacks must never meet
    in one database)."""
    url = os.environ.get("REDIS_URL")
    if url:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        yield urlsplit(url)._replace(path=f"/{worker}").geturl()
        return
    with PrivateRedis(appendonly=False) as server:
        yield server.url


def clean_database(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A clean database for each test."""
    yield from clean_database(redis_url)


@pytest.fixture(scope="module")
def module_redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A clean database for a module whose tests share one stack (never flushed
    between them)."""
    yield from clean_database(redis_url)


@pytest.fixture
def stack(redis_url: str, redis_client: redis.Redis) -> Iterator[Stack]:
    """The three services as processes on the test Redis (a clean database)."""
    running = start_stack(stack_settings(redis_url))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def services_only(redis_url: str) -> Iterator[Stack]:
    """The executor and the store as services; the scheduler is the test's to run in its
    own process (services_harness.scheduler_here)."""
    redis.Redis.from_url(redis_url).flushdb()
    stack = Stack(stack_settings(redis_url), plan=without_scheduler).start_all()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A NemotronH checkpoint with a trained byte-level BPE tokenizer and a Jinja chat
    template in chat_template.jinja, all saved by transformers (tests/checkpoints.py)."""
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat-checkpoint"))


@pytest.fixture(scope="module")
def checkpoint_stack(redis_url: str, chat_checkpoint: Path) -> Iterator[Stack]:
    """The services serving `chat_checkpoint`, one stack per module that asks."""
    running = start_stack(stack_settings(redis_url, model=chat_checkpoint))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def checkpoint_reference(chat_checkpoint: Path):
    """transformers' tokenizer and model of `chat_checkpoint`: the reference."""
    return reference(chat_checkpoint)


@pytest.fixture(scope="session")
def agent_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat checkpoint with the agent template (tools, calls, thinking), its model a
    MoE hybrid."""
    return build_chat_checkpoint(
        tmp_path_factory.mktemp("agent-checkpoint"),
        template=AGENT_TEMPLATE,
        layers=AGENT_LAYERS,
        **AGENT_MOE,
    )


@pytest.fixture(scope="module")
def agent_stack(redis_url: str, agent_checkpoint: Path) -> Iterator[Stack]:
    """The services serving `agent_checkpoint` as an agent deployment (agent_settings);
    tests/agent_apis/ shares one across its modules."""
    running = start_stack(agent_settings(redis_url, agent_checkpoint))
    yield running
    running.stop()


@pytest.fixture(scope="session")
def chat_checkpoint_config_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, with the template in tokenizer_config.json's chat_template."""
    return build_chat_checkpoint(tmp_path_factory.mktemp("chat-checkpoint-config"), "config")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked `long` first (the rest keep their order): pytest-xdist hands files
    to its workers in this order, so a long one starts at once instead of running alone
    at the end while the other worker waits."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
