"""Nothing a worker started outlives ``distrun``, whichever way the job ends.

Each worker starts a child that would sleep for five minutes (a stand-in
for a data-loader worker or a tool), then plays a role: it exits 0 at
once, crashes, or hangs. A unique value in the job's environment finds
every process the job started, wherever it was re-parented. The paths:

- a worker exits 0 early, another hangs, a third crashes (the failure
  path): the early and the crashed worker's children are orphans, and the
  hanging worker's child left its process group (``start_new_session``);
- a worker exits 0 early, another ignores SIGTERM, and distrun is stopped
  with SIGTERM (the orphan of the early exit was left behind before);
- distrun gets SIGTERM while it is still starting workers;
- distrun is killed with SIGKILL after a worker exited 0 early: the
  guardian of that worker kills what it left.

Workers import nothing heavy, so each job costs little more than distrun's
own start-up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from distamp.launcher import _bootstrap
from tests.launcher.test_distrun import distrun_cmd, gone, wait_until, worker_env
from tests.processes import grace_period_args, with_environ

MARK = "DISTAMP_TEST_JOB"

# argv[1 + RANK] is this rank's role.
WORKER = """
    import os, signal, subprocess, sys, time
    rank = int(os.environ["RANK"])
    role = sys.argv[1 + rank]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             start_new_session=role.startswith("hang"))
    with open(f"pids.{rank}.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(f"pids.{rank}.tmp", f"pids.{rank}")

    def gone(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    if role == "exit0":
        sys.exit(0)
    if role == "hang_ignoring_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if role == "crash":
        # Crash only once every rank has written its pids and the early exit has happened, so every path is
        # taken (a rank still starting on a loaded host would be torn down before it wrote them).
        while (not all(os.path.exists(f"pids.{r}") for r in range(len(sys.argv) - 1))
               or not gone(int(open("pids.0").read().split()[0]))):
            time.sleep(0.05)
        raise RuntimeError("rank crashed on purpose")
    time.sleep(300)
"""

# distrun, with torch's spawning patched to send distrun SIGTERM right after
# the second of its workers was started.
SIGNAL_WHILE_SPAWNING = """
    import os, signal, sys
    import torch.distributed.elastic.multiprocessing.api as api

    spawn, started = api.get_subprocess_handler, []

    def spawn_then_signal(*args, **kwargs):
        handler = spawn(*args, **kwargs)
        started.append(handler.proc.pid)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return handler

    api.get_subprocess_handler = spawn_then_signal
    from distamp.launcher.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def job(tmp_path):
    """A directory with the worker script, and a unique marker for the job's processes.

    Whatever the test leaves running (when it fails) is killed afterwards.
    """
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    marker = uuid.uuid4().hex
    yield tmp_path, marker
    for pid in with_environ(MARK, marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start(tmp_path, marker, *args, driver=None):
    cmd = [sys.executable, str(driver), *args] if driver else distrun_cmd(*args)
    return subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=worker_env(**{MARK: marker}),
    )


def pids_of(tmp_path, ranks):
    """{rank: (worker pid, child pid)} once every rank has written its file."""
    files = [tmp_path / f"pids.{r}" for r in ranks]
    assert wait_until(lambda: all(f.exists() for f in files), 60), "workers did not start"
    return {r: tuple(int(x) for x in f.read_text().split()) for r, f in zip(ranks, files, strict=True)}


def finish(proc, timeout=60):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"distrun did not finish:\n{err}")


@pytest.mark.timeout(120)
def test_early_exit_hang_and_crash_leave_nothing(job):
    tmp_path, marker = job
    proc = start(tmp_path, marker, "--nproc_per_node", "3", *grace_period_args(5),
                 "worker.py", "exit0", "hang", "crash")
    pids = pids_of(tmp_path, range(3))
    _, err = finish(proc)
    assert proc.returncode == 1, err
    assert "RuntimeError: rank crashed on purpose" in err
    assert with_environ(MARK, marker) == [], "processes of the job outlived distrun"
    note = next(line for line in err.splitlines() if line.startswith("distrun: killed "))
    for rank, (_, child) in pids.items():
        assert f"{child} (" in note, (rank, note)


@pytest.mark.timeout(120)
def test_sigterm_after_an_early_exit_leaves_nothing(job):
    """The reported failure: rank 0 exits 0, rank 1 hangs, distrun gets SIGTERM."""
    tmp_path, marker = job
    proc = start(tmp_path, marker, "--nproc_per_node", "2", *grace_period_args(1),
                 "worker.py", "exit0", "hang_ignoring_sigterm")
    pids = pids_of(tmp_path, range(2))
    assert wait_until(lambda: gone(pids[0][0]), 30), "rank 0 did not exit"
    proc.send_signal(signal.SIGTERM)
    _, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM; stopped every worker" in err
    assert with_environ(MARK, marker) == [], "processes of the job outlived distrun"
    assert all(gone(pid) for pair in pids.values() for pid in pair)


@pytest.mark.timeout(120)
def test_sigterm_while_workers_start_stops_those_started(job):
    tmp_path, marker = job
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(SIGNAL_WHILE_SPAWNING))
    proc = start(tmp_path, marker, "--nproc_per_node", "4", "worker.py",
                 "wait", "wait", "wait", "wait", driver=driver)
    _, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM" in err
    assert with_environ(MARK, marker) == [], "processes of the job outlived distrun"


@pytest.mark.timeout(120)
def test_sigkill_of_distrun_after_an_early_exit_leaves_nothing(job):
    tmp_path, marker = job
    proc = start(tmp_path, marker, "--nproc_per_node", "2", "worker.py", "exit0", "wait")
    pids = pids_of(tmp_path, range(2))
    assert wait_until(lambda: gone(pids[0][0]), 30), "rank 0 did not exit"
    # Past the moment right after its worker's exit when a guardian still
    # watches for the launcher anyway: the guardian's steady state is tested.
    time.sleep(_bootstrap._LAUNCHER_EXIT_GRACE + 0.5)
    proc.kill()
    proc.communicate(timeout=30)
    # Rank 1 dies by its death signal, its child by its guardian, and rank
    # 0's child by rank 0's guardian, which stayed for it.
    assert wait_until(lambda: with_environ(MARK, marker) == [], 15), with_environ(MARK, marker)
