"""The multi-process harness reports every rank's failure, not only the first to arrive.

A rank's error often follows a peer's (the peer gone, its store closed), so the
first message alone can hide the cause.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.multiprocess import run_workers


def _one_fails_other_dies(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(1.0)
        os._exit(3)
    raise ValueError("rank 1's own error")


def _both_fail(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(0.5)
    raise ValueError(f"error on {rank}")


@pytest.mark.timeout(120)
def test_every_rank_that_fails_is_reported():
    with pytest.raises(AssertionError) as e:
        run_workers(_both_fail, 2, timeout=60)
    assert "error on 0" in str(e.value)
    assert "error on 1" in str(e.value)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_after_another_failed_is_reported_with_its_exit_code():
    with pytest.raises(AssertionError) as e:
        run_workers(_one_fails_other_dies, 2, timeout=60)
    assert "rank 1's own error" in str(e.value)
    assert "exit code 3" in str(e.value)
