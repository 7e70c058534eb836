"""all_reduce_max: every rank ends with the elementwise maximum of the verdicts; group=None is local."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distamp.distributed.flag_sync import all_reduce_max
from tests.multiprocess import run_workers


def test_group_none_leaves_the_values_alone():
    values = torch.tensor([0.0, 1.0, float("inf")])
    all_reduce_max(values, None)
    assert torch.equal(values, torch.tensor([0.0, 1.0, float("inf")]))


def _worker(rank, world_size):
    out = {}
    verdict = torch.tensor([float(rank == 1), 0.0, float(rank)])  # overflow seen on rank 1 only
    all_reduce_max(verdict, dist.group.WORLD)
    out["world"] = verdict
    local = torch.tensor([float(rank)])
    all_reduce_max(local, None)  # explicitly no synchronisation
    out["none"] = local
    single = dist.new_group([0])
    one = torch.tensor([float(rank + 5)])
    if rank == 0:
        all_reduce_max(one, single)  # a group of one: no collective
    out["single"] = one
    return out


@pytest.mark.timeout(60)
def test_two_ranks_agree_on_the_maximum():
    results = run_workers(_worker, 2, timeout=50)
    for rank, got in enumerate(results):
        assert torch.equal(got["world"], torch.tensor([1.0, 0.0, 1.0]))
        assert torch.equal(got["none"], torch.tensor([float(rank)]))
        assert torch.equal(got["single"], torch.tensor([float(rank + 5)]))
