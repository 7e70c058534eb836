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


# Rank 0's log when rank 1 closed the group before it exited (seen with gloo on torch 2.13).
LOST_PEER = (
    "[rank0]:     work.wait()\n"
    "[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:46765: Connection reset by peer. This is typically caused by a remote "
    "worker crashing. Check the logs of the remote worker before reporting an error.\n"
)


def test_a_stopped_rank_comes_before_one_that_lost_it_as_its_peer(tmp_path):
    # Rank 1 failed and closed its connections, then was slow to exit: rank 0
    # lost its peer and exited first, and the agent stopped rank 1 (SIGTERM).
    (tmp_path / "workerlog.0").write_text(LOST_PEER)
    (tmp_path / "workerlog.1").write_text("rank 1 failing at iteration 50\n")
    error = failed(r0=1, r1=-int(signal.SIGTERM))
    code, last = summary(tmp_path, error, {0: START + 3.093, 1: START + 3.139}, nproc=2)
    assert code == 128 + signal.SIGTERM
    assert last.startswith("distrun: rank 1 (local rank 1, pid 101) was killed by SIGTERM (signal 15);"), last


def test_a_failure_of_its_own_comes_before_an_earlier_lost_peer(tmp_path):
    # The agent saw rank 0 (lost its peer) a second before rank 1 (its own failure).
    (tmp_path / "workerlog.0").write_text(LOST_PEER)
    error = failed(r0=1, r1=7)
    error.failures[1].timestamp = error.failures[0].timestamp + 1
    code, last = summary(tmp_path, error, {0: START + 3.9, 1: START + 4.1}, nproc=2)
    assert code == 7
    assert last.startswith("distrun: rank 1 (local rank 1, pid 101) exited with code 7;"), last


def test_failures_in_the_same_second_are_ordered_by_the_guardians_stamps(tmp_path):
    # The agent stamps both to the same second and recorded rank 0 first.
    error = failed(r0=1, r1=2)
    error.failures[1].timestamp = error.failures[0].timestamp
    code, last = summary(tmp_path, error, {0: START + 3.5, 1: START + 3.1}, nproc=2)
    assert code == 2
    assert last.startswith("distrun: rank 1 (local rank 1, pid 101) exited with code 2;"), last


def test_a_lost_peer_that_left_early_is_not_blamed_on_a_stopped_rank(tmp_path):
    # Rank 1 exited 0; rank 0 lost it as a peer; the agent stopped rank 2, a bystander.
    (tmp_path / "workerlog.0").write_text(LOST_PEER)
    error = failed(r0=1, r2=-int(signal.SIGTERM))
    exits = {1: START + 2.0, 0: START + 2.1, 2: START + 2.3}
    _, last = summary(tmp_path, error, exits, nproc=3)
    assert last.startswith(
        "distrun: rank 1 exited 0 at 2.0 s while ranks 0 and 2 were still running; rank 0 then failed: "
    ), last


def test_a_peer_lost_on_another_node_is_not_blamed_on_a_stopped_rank(tmp_path):
    # Two nodes: rank 0 here lost a peer on the other node; the agent stopped rank 1.
    (tmp_path / "workerlog.0").write_text(LOST_PEER)
    error = failed(r0=1, r1=-int(signal.SIGTERM))
    plan = LaunchPlan(command=("job.py",), nproc_per_node=2, nnodes=2, master_addr="10.0.0.1",
                      master_port=29500, log_dir=str(tmp_path))
    _, report = describe_failure(plan, error, {0: START + 3.0, 1: START + 3.2}, START)
    assert report.splitlines()[-1].startswith("distrun: rank 0 (local rank 0, pid 100) exited with code 1;")


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
