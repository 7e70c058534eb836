"""groups: the data-parallel group, its size and this rank, with and without torch.distributed."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from distamp.distributed.groups import (
    data_parallel_group,
    group_rank,
    group_size,
    is_distributed,
)
from tests.multiprocess import run_workers


def test_without_a_process_group_it_is_a_one_process_world():
    assert not dist.is_initialized()
    assert not is_distributed()
    assert data_parallel_group() is None
    assert group_size() == 1
    assert group_rank() == 0


def _worker(rank, world_size):
    sub = dist.new_group([1])  # a group this rank may or may not belong to
    given = object()
    return {
        "is_distributed": is_distributed(),
        "default_is_world": data_parallel_group() is dist.group.WORLD,
        "given_passes_through": data_parallel_group(given) is given,
        "size": group_size(),
        "rank": group_rank(),
        "sub_rank": group_rank(sub) if rank == 1 else None,
        "sub_size": group_size(sub) if rank == 1 else None,
    }


@pytest.mark.timeout(60)
def test_in_a_gloo_group_of_two():
    results = run_workers(_worker, 2, timeout=50)
    for rank, got in enumerate(results):
        assert got["is_distributed"]
        assert got["default_is_world"]
        assert got["given_passes_through"]
        assert (got["size"], got["rank"]) == (2, rank)
    assert (results[1]["sub_rank"], results[1]["sub_size"]) == (0, 1)
