"""The agent APIs' tests (chat tools, Responses, Messages) share one stack: it lives
while this package's tests run, and no other stack runs beside it on the test Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from custody.up import Stack
from tests.services_harness import agent_settings, start_stack


@pytest.fixture(scope="package")
def agent_stack(redis_url: str, agent_checkpoint: Path) -> Iterator[Stack]:
    """The services serving `agent_checkpoint` as an agent deployment (agent_settings)."""
    running = start_stack(agent_settings(redis_url, agent_checkpoint))
    yield running
    running.stop()
