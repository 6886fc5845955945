"""The device tests: every test under tests/gpu is marked `gpu` (`-m gpu` selects them,
`-m "not gpu"` leaves them out) and skipped where torch sees no CUDA device, so the
suite collects and passes on a CPU host. The `cuda` fixture is the device they run on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark (and without CUDA, skip) the items collected from this folder only: the hook
    sees every item of the session, wherever its module."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if HERE not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device("cuda")
