"""gloo's worker threads are found by the name this torch gives them, and idle threads are told from busy ones.

distamp's exit and model-freeing waits act only on the threads they find (see
``tests/distributed/test_teardown.py`` for the hang when they find none), so a
torch that renamed the threads fails here, and at set-up distamp warns.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings

import pytest
import torch.distributed as dist

from distamp.distributed import comm_threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


@pytest.fixture
def gloo_world() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # conftest destroys it


@linux_only
def test_a_new_gloo_group_adds_threads_with_the_name_distamp_looks_for(gloo_world):
    before = set(comm_threads.gloo_worker_threads() or ())
    group = dist.new_group(backend="gloo")
    # Each thread names itself once it runs, which on a loaded host can come after new_group returned.
    deadline = time.monotonic() + 10
    added = set(comm_threads.gloo_worker_threads() or ()) - before
    while not added and time.monotonic() < deadline:
        time.sleep(0.01)
        added = set(comm_threads.gloo_worker_threads() or ()) - before
    assert added, f"no new thread named {comm_threads.GLOO_WORKER_THREAD_NAME!r}: did torch rename gloo's workers?"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comm_threads.check_gloo_workers_found(group)


@linux_only
def test_a_gloo_group_whose_workers_cannot_be_found_is_warned_about(gloo_world, monkeypatch):
    monkeypatch.setattr(comm_threads, "GLOO_WORKER_THREAD_NAME", "pt_renamed_loop")
    with pytest.warns(RuntimeWarning, match=r"cannot find torch's gloo worker threads \(named 'pt_renamed_loop'\)"):
        comm_threads.check_gloo_workers_found()


@linux_only
def test_a_thread_competing_for_the_gil_is_busy_and_one_asleep_on_a_lock_is_idle():
    stop = threading.Event()
    tids = {}

    def spin():
        tids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def sleep():
        tids["sleep"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for t in threads:
        t.start()
    try:
        while len(tids) < 2:
            pass
        assert comm_threads.wait_for_idle_threads([tids["sleep"]], timeout=1.0) is True
        assert comm_threads.wait_for_idle_threads([tids["spin"]], timeout=0.3) is False
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert comm_threads.wait_for_idle_threads([tids["spin"], tids["sleep"]], timeout=1.0) is True  # both gone
