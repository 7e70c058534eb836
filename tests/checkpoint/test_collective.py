"""distamp.checkpoint.collective: ranks wait for rank 0 on the store, not in collectives.

The multi-rank test builds a gloo group whose collectives time out after 3
seconds and makes rank 0's write last longer than that: the other rank
must wait it out, and the group must still work afterwards.
"""

from __future__ import annotations

import errno
import functools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distamp.checkpoint import list_checkpoints, load_latest_checkpoint, save_checkpoint
from distamp.checkpoint.collective import DEFAULT_TIMEOUT, Coordinator, check_timeout
from tests.multiprocess import free_port, run_workers

PG_TIMEOUT = 3.0
SLOW_WRITE = 5.0  # longer than PG_TIMEOUT


def test_check_timeout():
    assert check_timeout(None) == DEFAULT_TIMEOUT == timedelta(minutes=30)
    assert check_timeout(2) == timedelta(seconds=2)
    assert check_timeout(0.5) == timedelta(seconds=0.5)
    assert check_timeout(timedelta(hours=1)) == timedelta(hours=1)
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds, a datetime.timedelta or None, got str"):
        check_timeout("60")
    with pytest.raises(TypeError, match=r"got bool"):
        check_timeout(True)
    with pytest.raises(ValueError, match=r"timeout=0 must be positive"):
        check_timeout(0)
    with pytest.raises(ValueError, match=r"timeout=datetime.timedelta\(days=-1, .*\) must be positive"):
        check_timeout(timedelta(seconds=-1))


def test_one_process_needs_no_store():
    coordinator = Coordinator("save step 1", DEFAULT_TIMEOUT)
    assert (coordinator.rank, coordinator.world_size) == (0, 1)
    assert coordinator.gather({"a": 1}) == [{"a": 1}]
    assert coordinator.broadcast("x") == "x"
    assert coordinator.decide(2, lambda values: sum(values) * 10) == 20


def test_the_timeout_argument_is_checked_before_anything_is_written(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"timeout must be"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=opt, timeout="1h")
    with pytest.raises(ValueError, match=r"timeout=-5 must be positive"):
        load_latest_checkpoint(tmp_path, model=model, optimizer=opt, timeout=-5)
    assert list(tmp_path.iterdir()) == []


def _group_with_short_timeout(rank: int, world_size: int, port: int) -> None:
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PG_TIMEOUT))


def _slow_rank_zero(rank: int, world_size: int, directory: str, port: int) -> dict:
    from distamp.checkpoint import storage

    _group_with_short_timeout(rank, world_size, port)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_write = storage.write_payload
    out: dict = {}

    def slow_write(*args, seconds=SLOW_WRITE, **kwargs):
        time.sleep(seconds)
        return real_write(*args, **kwargs)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 0:
        storage.write_payload = slow_write
    save_checkpoint(directory, 1, model=model, optimizer=opt)  # default timeout
    storage.write_payload = real_write
    box = torch.ones(1)
    dist.all_reduce(box)  # the group survived the wait
    out["all_reduce"] = box.item()

    for step in (2, 2, 3):  # repeated saves, the same step twice: keys must not collide
        save_checkpoint(directory, step, model=model, optimizer=opt, extra={"rank": rank})
    out["listed"] = list_checkpoints(directory)

    if rank == 0:
        storage.write_payload = full_disk
    try:
        save_checkpoint(directory, 4, model=model, optimizer=opt)
    except RuntimeError as exc:
        out["failure"] = str(exc)
    storage.write_payload = real_write
    out["loaded"] = load_latest_checkpoint(directory, model=model, optimizer=opt).step

    if rank == 0:
        storage.write_payload = functools.partial(slow_write, seconds=2.0)
    try:
        save_checkpoint(directory, 5, model=model, optimizer=opt, timeout=0.5)
    except RuntimeError as exc:
        out["timeout"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_other_ranks_outwait_a_slow_rank_zero_and_share_its_failures(tmp_path):
    out = run_workers(_slow_rank_zero, 2, str(tmp_path), free_port(), timeout=100)
    for result in out:
        assert result["all_reduce"] == 2.0
        assert result["listed"] == [3, 2]
        assert result["failure"] == out[0]["failure"]
        assert "rank 0 could not save checkpoint 4" in result["failure"]
        assert "No space left" in result["failure"]
        assert result["loaded"] == 3
    assert "timeout" not in out[0]
    assert "rank 1 waited 0:00:00.500000 during the checkpoint's save step 5 and rank(s) [0] did not arrive" in (
        out[1]["timeout"]
    )
    assert "pass a larger timeout" in out[1]["timeout"]
