"""all_reduce_max: every rank ends with the elementwise maximum of the verdicts; group=None is local."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distamp.distributed import flag_sync
from distamp.distributed.flag_sync import all_reduce_max, host_wait_timeout
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


@pytest.mark.parametrize(("group_timeout", "host_wait"), [(1800.0, 1740.0), (10.0, 5.0), (90.0, 45.0)])
def test_the_host_gives_up_before_the_watchdog(group_timeout, host_wait):
    store = dist.HashStore()
    group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=group_timeout))
    pg = dist.ProcessGroup(store, 0, 1)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, group)
    assert host_wait_timeout(pg, torch.device("cpu")) == timedelta(seconds=host_wait)


class _RecordingWork:
    def __init__(self):
        self.waited_with = None

    def wait(self, timeout=None):
        self.waited_with = timeout
        return True


def test_on_a_device_the_host_waits_with_the_shorter_timeout(monkeypatch):
    """The NCCL path, shown on a tensor that claims another device: an async all-reduce, then a bounded wait."""
    work = _RecordingWork()
    calls = []

    def fake_all_reduce(tensor, op, group, async_op=False):
        calls.append(async_op)
        return work

    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(flag_sync, "host_wait_timeout", lambda group, device: timedelta(seconds=7))
    values = torch.zeros(2, device="meta")
    all_reduce_max(values, object())
    assert calls == [True]
    assert work.waited_with == timedelta(seconds=7)


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_nccl_verdict_waits_on_the_host_with_the_shorter_timeout():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=40),
                            device_id=torch.device("cuda", 0))
    try:
        assert host_wait_timeout(dist.group.WORLD, torch.device("cuda", 0)) == timedelta(seconds=20)
    finally:
        dist.destroy_process_group()
