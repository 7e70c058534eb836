"""wire_rounds.round_bytes: gloo cuts its sharded collectives into rounds, other backends and no group do not."""

from __future__ import annotations

import pytest

from distamp.sharding import wire_rounds
from tests.multiprocess import run_workers


def test_no_process_group_means_no_limit():
    assert wire_rounds.round_bytes(None) is None


def _on_gloo(rank, world):
    return wire_rounds.round_bytes(None)


@pytest.mark.timeout(60)
def test_gloo_rounds_are_1_mib_per_peer():
    assert run_workers(_on_gloo, 1, timeout=50) == [1 << 20]
    assert wire_rounds.GLOO_ROUND_BYTES == 1 << 20
