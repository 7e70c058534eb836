"""distrun's failure report from the agent's failures and the guardians' exit stamps;
its report of a failed rendezvous."""

from __future__ import annotations

import io
import signal
import socket

from torch.distributed.elastic.multiprocessing import ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from distamp.launcher.plan import LaunchPlan
from distamp.launcher.run import describe_failure, launch

START = 1000.0


def failed(**ranks):
    """ChildFailedError for {"r<rank>": exitcode}; local rank = global rank."""
    failures = {}
    for key, code in ranks.items():
        rank = int(key[1:])
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
    return ChildFailedError(name="job.py", failures=failures)


def summary(tmp_path, error, exits, nproc):
    plan = LaunchPlan(command=("job.py",), nproc_per_node=nproc, log_dir=str(tmp_path))
    code, report = describe_failure(plan, error, exits, START)
    return code, report.splitlines()[-1]


def test_a_failure_without_an_early_exit_is_the_root_cause(tmp_path):
    error = failed(r1=1, r0=-int(signal.SIGTERM))
    code, last = summary(tmp_path, error, {1: START + 5, 0: START + 5.2}, nproc=2)
    assert code == 1
    assert last.startswith("distrun: rank 1 (local rank 1, pid 101) exited with code 1; full log:")


def test_an_early_exit_0_comes_first_in_the_report(tmp_path):
    error = failed(r0=-int(signal.SIGABRT))
    code, last = summary(tmp_path, error, {1: START + 12.3, 0: START + 12.9}, nproc=2)
    assert code == 128 + signal.SIGABRT
    assert last.startswith(
        "distrun: rank 1 exited 0 at 12.3 s while rank 0 was still running; rank 0 then failed: "
        "rank 0 (local rank 0, pid 100) was killed by SIGABRT (signal 6); full log: "
    )
    assert last.endswith(f"see {tmp_path}/workerlog.1. The other workers were stopped; exiting with code 134.")


def test_the_earliest_early_exit_and_who_was_still_running(tmp_path):
    # Ranks 2 and 3 exit 0 (3 first); rank 0 then fails; rank 1 is stopped by the agent.
    error = failed(r0=1, r1=-int(signal.SIGTERM))
    exits = {3: START + 2.0, 2: START + 3.0, 0: START + 4.0, 1: START + 4.5}
    _, last = summary(tmp_path, error, exits, nproc=4)
    assert last.startswith(
        "distrun: rank 3 exited 0 at 2.0 s while ranks 0, 1 and 2 were still running; rank 0 then failed: "
    )


def test_an_exit_0_after_the_failure_is_not_the_cause(tmp_path):
    error = failed(r0=1)
    _, last = summary(tmp_path, error, {0: START + 4.0, 1: START + 4.1}, nproc=2)
    assert last.startswith("distrun: rank 0 (local rank 0, pid 100) exited with code 1;")


def test_a_rendezvous_port_taken_after_the_checks_is_a_one_line_report(tmp_path):
    """The plan refuses a --master port in use; one taken between that check and the
    rendezvous must still end in distrun's report (exit 1), not torch's traceback."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        plan = LaunchPlan(command=("job.py",), nproc_per_node=1, master_addr="127.0.0.1",
                          master_port=port, log_dir=str(tmp_path / "log"))
        out, err = io.StringIO(), io.StringIO()
        assert launch(plan, out, err) == 1
    last = err.getvalue().rstrip().splitlines()[-1]
    assert last.startswith(f"distrun: rendezvous failed at 127.0.0.1:{port}: "), last
    assert "address already in use" in last
    assert not (tmp_path / "log" / "workerlog.0").exists(), "no worker started"
