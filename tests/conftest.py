"""Test-suite hooks: tests marked ``cuda`` are skipped where no CUDA GPU is available, and a
process group a test created in the pytest process (``fleet.init()`` forms a one-process world)
is destroyed after it, and ``fleet``'s module state (its world, latest strategy, optimizers and
models) is reset, so the next test on the same worker starts as a fresh process would."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from distamp import fleet


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.cuda`` tests when ``torch.cuda.is_available()`` is False."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    fleet._state = fleet._FleetState()
