"""gloo's worker threads, found by name in ``/proc``, and waiting until they are idle.

A gloo thread that completes an all-reduce with a Python continuation (DDP
comm hooks: distamp's, torch's ``fp16_compress_hook``) takes the GIL once
more after the waiting backward has already returned, to release the
continuation. Two places must not hold the GIL against it:

* freeing the last reference to a process group (``~ProcessGroupGloo``
  joins its threads with the GIL held): when a DDP model outlives
  ``destroy_process_group()``, that is the reducer's destructor, at the
  model's garbage collection. Without a wait the job hangs after training
  (reproduced: DDP + comm hook, one backward, ``destroy_process_group()``,
  ``del model``; ``tests/distributed/test_teardown.py``).
* interpreter exit: a thread that needs the GIL while the interpreter
  finalizes is ended with ``pthread_exit``, whose unwinding reaches a
  ``noexcept`` destructor ("terminate called without an active
  exception", exit 134 after a job that had finished).

torch names these threads ``pt_gloo_runloop`` (``ProcessGroupGloo::runLoop``).
A thread waiting for the GIL wakes every switch interval (5 ms) to ask for
it; an idle worker sleeps on its work queue without waking. So a worker is
idle when it was asleep at two looks and did not run in between, while this
thread slept with the GIL released: had it been waiting for the GIL, it
would have woken (and, the GIL being free, taken it). The wait depends on
finding the threads: where a gloo group exists and none is found (a torch
that renamed them), :func:`check_gloo_workers_found` warns at set-up.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch.distributed as dist

__all__ = [
    "GLOO_WORKER_THREAD_NAME",
    "check_gloo_workers_found",
    "gloo_worker_threads",
    "wait_for_comm_threads",
    "wait_for_idle_threads",
]

GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"
"""The name torch gives ``ProcessGroupGloo``'s worker threads (``c10::setThreadName``)."""

_EXIT_WAIT = 2.0  # seconds at most
_NAMING_WAIT = 2.0  # seconds new gloo threads get to name themselves before distamp warns
_TASKS = "/proc/self/task"
_SWITCH_COUNTS = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")


def gloo_worker_threads() -> list[int] | None:
    """Thread ids of this process's gloo worker threads; ``None`` where ``/proc`` cannot be read (not Linux)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    found = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER_THREAD_NAME:
                    found.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


def check_gloo_workers_found(group: dist.ProcessGroup | None = None) -> None:
    """Warn when ``group`` (default: the world) runs on gloo but its worker threads cannot be found.

    gloo starts them when the group is built, so right after that at least
    one must be visible; if not, :func:`wait_for_comm_threads` cannot wait
    for them and a job may hang at exit.
    """
    if not sys.platform.startswith("linux") or "gloo" not in str(dist.get_backend(group)):
        return
    if not _named_workers_appear(_NAMING_WAIT):
        warnings.warn(
            f"distamp cannot find torch's gloo worker threads (named {GLOO_WORKER_THREAD_NAME!r}) in {_TASKS}, "
            "so it cannot wait for them before a process group is freed or the process exits; with DDP comm "
            "hooks a job may hang there. This torch may have renamed them: please report it with your torch "
            "version",
            RuntimeWarning,
            stacklevel=2,
        )


def _named_workers_appear(timeout: float) -> bool:
    """Whether gloo worker threads show up within ``timeout`` seconds.

    Each thread names itself once it runs, which on a loaded host can come
    after ``new_group`` has returned: one look right away can miss them.
    """
    deadline = time.monotonic() + timeout
    while not gloo_worker_threads():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _snapshot(tids: list[int]) -> dict[int, tuple[str, int]]:
    """Each live thread's scheduler state and context-switch count (voluntary + involuntary)."""
    seen = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if line.startswith(_SWITCH_COUNTS))
        except (OSError, IndexError, ValueError):  # ended meanwhile: nothing to wait for
            continue
        seen[tid] = (state, switches)
    return seen


def _idle(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> bool:
    """Every thread seen twice was asleep both times without running in between; one seen once is not judged yet."""
    return all(
        tid in before and before[tid][0] == "S" and state == "S" and before[tid][1] == switches
        for tid, (state, switches) in after.items()
    )


def wait_for_idle_threads(tids: list[int], timeout: float) -> bool:
    """Wait, with the GIL released, until the threads ``tids`` of this process are idle; False after ``timeout`` s.

    Idle: asleep at two looks, with no context switch in between (a thread
    gone counts as idle). Each look is one sleep of at least two switch
    intervals, so a thread waiting for the GIL is seen waking, and gets the
    GIL meanwhile.
    """
    interval = max(0.01, 2 * sys.getswitchinterval())
    deadline = time.monotonic() + timeout
    before = _snapshot(tids)
    while time.monotonic() < deadline:
        time.sleep(interval)
        after = _snapshot(tids)
        if _idle(before, after):
            return True
        before = after
    return False


def wait_for_comm_threads(timeout: float = _EXIT_WAIT) -> None:
    """Wait until this process's gloo worker threads are idle (``timeout`` s at most; at once when there are none).

    Called before a DDP model's reducer may free its process group, and at
    exit before distamp destroys the group ``fleet.init`` created.
    """
    tids = gloo_worker_threads()
    if tids:
        wait_for_idle_threads(tids, timeout)
