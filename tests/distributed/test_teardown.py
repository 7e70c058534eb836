"""A data-parallel model freed after ``destroy_process_group()`` does not hang the process, and the
group ``fleet.init`` created is destroyed at exit.

gloo's thread that completes a comm hook's all-reduce takes the GIL once more, after the backward
returned, to release the hook's Python continuation; freeing the model's reducer (the process
group's last owner) joins that thread with the GIL held. Without distamp's finalizer this hangs at
the first or second iteration of the loop below, every time; so it does when the finalizer cannot
find gloo's threads by name (as on a torch that renamed them): the tests below show both.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distamp import fleet
from distamp.distributed import comm_threads
from distamp.model import ddp_preparation
from tests.multiprocess import free_port, run_workers

_TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _train_destroy_free(rank: int, world_size: int, port: int, iterations: int, pure: bool,
                        progress: str | None = None) -> int:
    # The main thread keeps the GIL for up to 0.1 s of Python work (the default is 5 ms), as a busy
    # interpreter would: gloo's thread then still waits for it when the model is freed, every time.
    sys.setswitchinterval(0.1)
    # The harness's group; each iteration builds its own. The barrier first: a rank that destroyed it
    # at once closed its sockets under a peer still connecting ("Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=30))
    for it in range(iterations):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"it{it}", store), rank=rank, world_size=world_size)
        fleet._state = fleet._FleetState()
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": pure}
        module = nn.Linear(64, 64)
        optimizer = fleet.distributed_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), strategy)
        model = fleet.distributed_model(module)
        with fleet.auto_cast():
            loss = model(torch.ones(4, 64)).float().sum()
        optimizer.backward(loss)
        optimizer.step()
        dist.destroy_process_group()  # the user's teardown, then the model goes out of scope
        del model, optimizer, module, loss
        if progress is not None:
            with open(f"{progress}.{rank}", "w") as file:
                file.write(f"{it + 1} {time.time()}")
            _rearm_stall_watchdog()
    dist.init_process_group("gloo", store=dist.PrefixStore("last", store), rank=rank, world_size=world_size)
    # A rank may return from init before its peer finished connecting: a rank that exited at once
    # closed its sockets under the peer's handshake ("connection closed by peer").
    dist.barrier()
    return iterations


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pure", [False, True])
def test_freeing_the_model_after_destroy_process_group_does_not_hang(pure):
    assert run_workers(_train_destroy_free, 2, free_port(), 8, pure, timeout=90) == [8, 8]


_STALL_SECONDS = 15.0
_stall_report = None


def _rearm_stall_watchdog() -> None:
    """Exit this worker with a traceback in its stall file if it finishes no iteration for _STALL_SECONDS.

    The hang holds the GIL, so no Python thread could see it: faulthandler's watchdog is a C thread.
    """
    if _stall_report is not None:
        faulthandler.dump_traceback_later(_STALL_SECONDS, exit=True, file=_stall_report)


def _without_the_wait(rank: int, world_size: int, port: int, iterations: int, how: str, progress: str) -> int:
    global _stall_report
    if how == "no-op finalizer":
        ddp_preparation.wait_for_comm_threads = lambda: None
    else:  # the threads are not found by name, as on a torch that renamed them
        comm_threads.GLOO_WORKER_THREAD_NAME = "pt_renamed_loop"
    _stall_report = open(f"{progress}.{rank}.stall", "w")  # noqa: SIM115 - the watchdog writes it until exit
    _rearm_stall_watchdog()
    return _train_destroy_free(rank, world_size, port, iterations, False, progress)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["no-op finalizer", "threads not found"])
@pytest.mark.skipif(_TORCH_RELEASE >= (2, 14), reason=(
    "on torch 2.14.1 the sequence without the wait hangs only sometimes (seen both ways on this host, "
    "depending on load), so it cannot show the wait is needed; the wait itself is tested above and in "
    "test_comm_threads.py"))
@pytest.mark.slow
def test_without_waiting_for_the_threads_it_found_the_sequence_hangs(how, tmp_path):
    """The test above can fail: the same sequence, without distamp's wait acting, hangs on torch 2.11 and
    2.13, quietly at the first or second iteration; on a loaded host some iterations get through first.
    So the workers run for up to 45 s, and a hang is a rank that finished no iteration for 15 s: a C
    watchdog (faulthandler's, since the hang holds the GIL) then writes the rank's stack to its stall
    file and ends it, and the test stops there. A slow rank that kept finishing iterations fails the
    test. Under heavy load the race once missed a whole 45 s window on torch 2.13 (a clean-clone CI run
    with benchmarks beside it), so a window without a hang is tried once more before the test fails."""
    windows = []
    for attempt in range(2):
        progress = str(tmp_path / f"progress{attempt}")
        with pytest.raises((TimeoutError, RuntimeError, AssertionError)) as stopped:
            run_workers(_without_the_wait, 2, free_port(), 10_000, how, progress, timeout=45)
        stalls = {rank: pathlib.Path(f"{progress}.{rank}.stall").read_text() for rank in range(2)}
        stalled = [rank for rank, report in stalls.items() if report.startswith("Timeout")]
        if stalled:
            assert "_train_destroy_free" in stalls[stalled[0]], stalls[stalled[0]]  # stuck in the loop
            return
        assert isinstance(stopped.value, TimeoutError), stopped.value  # no other failure than running on
        finished = [pathlib.Path(f"{progress}.{rank}").read_text().split()[0]
                    if pathlib.Path(f"{progress}.{rank}").exists() else "0" for rank in range(2)]
        windows.append(f"window {attempt + 1}: iterations finished per rank {finished}")
    raise AssertionError(f"no rank hung: both kept finishing iterations until the timeout ({'; '.join(windows)})")


# A fleet script that never calls destroy_process_group(): a DDP model with distamp's comm hook (O1
# BF16: the 16-bit all-reduce), one step, then exit with the model alive. An exit handler registered
# before fleet.init runs after distamp's (atexit is last-in, first-out) and reports what it left.
_EXITS_WITHOUT_DESTROY = """
    import atexit, sys, torch, torch.distributed as dist
    from torch import nn
    from distamp import fleet

    atexit.register(lambda: print("group left at exit:", dist.is_initialized(), flush=True))
    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16"}
    module = nn.Linear(64, 64)
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), strategy)
    model = fleet.distributed_model(module)
    with fleet.auto_cast():
        loss = model(torch.ones(4, 64)).float().sum()
    optimizer.backward(loss)
    optimizer.step()
    print("trained", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script fails after training")
"""


def _run_ranks(tmp_path, world_size: int, mode: str) -> list[tuple[int, str, str, float]]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_EXITS_WITHOUT_DESTROY))
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), mode], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            results.append((p.returncode, out, err, time.monotonic() - start))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.timeout(120)
def test_the_group_fleet_init_created_is_destroyed_at_exit_promptly(tmp_path):
    for code, out, err, seconds in _run_ranks(tmp_path, 2, "exit"):
        assert code == 0, err[-3000:]
        assert out.splitlines() == ["trained", "group left at exit: False"], (out, err[-3000:])
        assert "terminate called" not in err
        assert seconds < 45


@pytest.mark.timeout(120)
def test_after_an_uncaught_exception_the_group_is_left_to_torch(tmp_path):
    """NCCL's shutdown would flush work that peers of a failed rank may never join; torch's destructor aborts it."""
    [(code, out, err, _)] = _run_ranks(tmp_path, 1, "raise")
    assert code == 1
    assert "RuntimeError: the script fails after training" in err
    assert out.splitlines() == ["trained", "group left at exit: True"], (out, err[-3000:])
