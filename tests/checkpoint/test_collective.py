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
from distamp.checkpoint.collective import DEFAULT_TIMEOUT, Coordinator
from tests.multiprocess import free_port, run_workers

PG_TIMEOUT = 3.0
SLOW_WRITE = 5.0  # longer than PG_TIMEOUT


@pytest.mark.parametrize("call", ["save", "load"])
@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        ("60", TypeError, r"timeout must be a number of seconds or a datetime.timedelta, got str '60'"),
        (True, TypeError, r"got bool True"),
        (0, ValueError, r"timeout=0 must be a positive, finite number of seconds"),
        (float("inf"), ValueError, r"timeout=inf must be a positive, finite number of seconds"),
        (float("nan"), ValueError, r"timeout=nan must be a positive, finite"),
        (timedelta(seconds=-1), ValueError, r"must be a positive, finite"),
        (1e300, ValueError, r"too large for a datetime.timedelta"),
    ],
)
def test_a_bad_timeout_is_refused_before_anything_is_written(tmp_path, call, timeout, error, match):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = {
        "save": lambda: save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, timeout=timeout),
        "load": lambda: load_latest_checkpoint(tmp_path, model=model, optimizer=optimizer, timeout=timeout),
    }
    with pytest.raises(error, match=match):
        calls[call]()
    assert list(tmp_path.iterdir()) == []


def test_the_default_wait_is_fleets_thirty_minutes():
    assert timedelta(minutes=30) == DEFAULT_TIMEOUT


def test_one_process_needs_no_store():
    coordinator = Coordinator("save step 1", DEFAULT_TIMEOUT)
    assert (coordinator.rank, coordinator.world_size) == (0, 1)
    assert coordinator.gather({"a": 1}) == [{"a": 1}]
    assert coordinator.broadcast("x") == "x"
    assert coordinator.decide(2, lambda values: sum(values) * 10) == 20


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


def _rank_1_reads_the_decision_late(rank: int, world_size: int, directory: str, call: str) -> int:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(directory, 1, model=model, optimizer=opt)
    dist.barrier()
    if rank == 1:
        broadcast = Coordinator.broadcast

        def late(self, value=None):
            time.sleep(1.5)  # a slow reader: without the closing round, rank 0 has exited by now
            return broadcast(self, value)

        Coordinator.broadcast = late
    if call == "save":
        save_checkpoint(directory, 2, model=model, optimizer=opt)
        return 2
    info = load_latest_checkpoint(directory, model=model, optimizer=opt)
    return info.step  # rank 0 returns, and its process (the store's host) exits right after


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["save", "load"])
def test_rank_0_does_not_leave_before_every_rank_read_the_last_decision(tmp_path, call):
    want = 2 if call == "save" else 1
    assert run_workers(_rank_1_reads_the_decision_late, 2, str(tmp_path), call, timeout=45) == [want, want]
