"""``distrun`` end to end: real CPU workers in gloo groups on 127.0.0.1.

Each test starts ``python -m distamp.launcher`` on a small worker script
written to a temporary directory and checks what a user sees: exit code,
console lines, log files, and which processes are left.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.multiprocess import free_port
from tests.processes import grace_period_args

ALLREDUCE = """
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "DISTAMP_SELECTED_GPUS", "PYTHONUNBUFFERED",
             "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"]
    print("ENV", {n: os.environ.get(n) for n in names})
    print("ARGS", sys.argv[1:])
    print(f"rank {dist.get_rank()} sum {t.item()}")
    print(f"rank {dist.get_rank()} says hi on stderr", file=sys.stderr)
    dist.destroy_process_group()
"""

RANK1_RAISES = """
    import os, time
    print(f"rank {os.environ['RANK']} started", flush=True)
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 cannot go on")
    time.sleep(120)
"""

RANK1_KILLED = """
    import os, signal, time
    if os.environ["RANK"] == "1":
        print("about to die", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
"""

# Rank 1 leaves after the first collective (as with fewer batches than its
# peers); rank 0 then fails in the second one ("Connection closed by peer").
RANK1_EXITS_EARLY = """
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        print("rank 1 is done", flush=True)
        os._exit(0)
    dist.all_reduce(t)
"""

# Rank 1 fails, and its clean-up closes the group before a slow rest (as a
# data loader's shutdown would be): rank 0 loses its peer and exits first,
# and distrun stops rank 1.
RANK1_CLOSES_THE_GROUP_THEN_LINGERS = """
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        print("rank 1 is failing", flush=True)
        dist.destroy_process_group()
        time.sleep(120)
    dist.all_reduce(t)
"""

# Each worker starts a child (as a data loader would), writes both pids to a
# file and waits; the test then signals distrun.
WAITS_WITH_CHILD = """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(f"pids.{os.environ['RANK']}.tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(f"pids.{os.environ['RANK']}.tmp", f"pids.{os.environ['RANK']}")
    time.sleep(120)
"""

# Rank 1 is killed partway through the first attempt, after a collective.
FAILS_ONCE = """
    import os, signal, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"attempt {attempt} rank {dist.get_rank()} sum {t.item()}", flush=True)
    if attempt == 0 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
    print(f"attempt {attempt} rank {dist.get_rank()} finished with {t.item()}", flush=True)
    dist.destroy_process_group()
"""


def write(tmp_path, name, source):
    (tmp_path / name).write_text(textwrap.dedent(source))
    return name


def distrun_cmd(*args):
    return [sys.executable, "-m", "distamp.launcher", *args]


def worker_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DISTAMP"))}
    env.pop("OMP_NUM_THREADS", None)
    env.update(extra)
    return env


def distrun(tmp_path, *args, timeout=60, **env):
    return subprocess.run(
        distrun_cmd(*args), check=False, cwd=tmp_path, capture_output=True, text=True,
        timeout=timeout, env=worker_env(**env),
    )


def gone(pid):
    """True when ``pid`` no longer runs (zombies waiting for a reaper count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


@pytest.mark.timeout(90)
def test_two_rank_allreduce_succeeds_and_tees_rank0(tmp_path):
    script = write(tmp_path, "job.py", ALLREDUCE)
    proc = distrun(tmp_path, "--nproc_per_node", "2", script, "--lr", "0.1", "a$$b", "${local_rank}")
    assert proc.returncode == 0, proc.stderr
    console = proc.stdout.splitlines()
    assert "[rank0]: rank 0 sum 3.0" in console
    assert "[rank0]: rank 0 says hi on stderr" in console
    assert not any("rank 1" in line for line in console), "only rank 0 is tee'd by default"
    assert "OMP_NUM_THREADS=" in proc.stderr
    assert "set OMP_NUM_THREADS to override" in proc.stderr
    log1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert "rank 1 sum 3.0" in log1
    assert "rank 1 says hi on stderr" in log1
    env = ast.literal_eval(re.search(r"^ENV (.*)$", log1, re.MULTILINE).group(1))
    cores = len(os.sched_getaffinity(0))
    assert env == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": env["MASTER_PORT"],
        "DISTAMP_SELECTED_GPUS": "", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, cores // 2)), "TORCHELASTIC_RESTART_COUNT": "0",
    }
    assert 0 < int(env["MASTER_PORT"]) < 65536
    # The script's arguments arrive untouched (torch would expand $-macros in argv).
    assert "ARGS ['--lr', '0.1', 'a$$b', '${local_rank}']" in log1


@pytest.mark.timeout(90)
def test_failing_rank_is_named_with_its_traceback(tmp_path):
    script = write(tmp_path, "job.py", RANK1_RAISES)
    start = time.monotonic()
    proc = distrun(tmp_path, "--nproc_per_node", "2", *grace_period_args(5), script)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.rstrip().splitlines()
    assert re.match(
        r"distrun: rank 1 \(local rank 1, pid \d+\) exited with code 1; full log: "
        r"log/workerlog\.1\. The other workers were stopped; exiting with code 1\.$",
        err[-1],
    ), err[-1]
    tail = "\n".join(err[-25:])
    assert "last 20 lines of log/workerlog.1 (rank 1)" in tail
    assert "Traceback (most recent call last):" in tail
    assert 'raise ValueError("rank 1 cannot go on")' in tail
    assert "ValueError: rank 1 cannot go on" in tail
    # Rank 0 was sleeping for 120 s: it was stopped, not waited for.
    assert elapsed < 60


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_early_exit_0_is_named_as_the_root_cause_and_tracebacks_have_one_prefix(tmp_path):
    script = write(tmp_path, "job.py", RANK1_EXITS_EARLY)
    proc = distrun(tmp_path, "--nproc_per_node", "2", *grace_period_args(5), script)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert re.match(
        r"distrun: rank 1 exited 0 at \d+\.\d s while rank 0 was still running; rank 0 then "
        r"failed: rank 0 \(local rank 0, pid \d+\) exited with code 1; full log: log/workerlog\.0\. "
        r".*see log/workerlog\.1\. The other workers were stopped; exiting with code 1\.$",
        last,
    ), last
    # rank 0's log tail: gloo says "Connection closed by peer" or "Connection reset by peer"
    assert "by peer" in proc.stderr
    # torch's excepthook already writes "[rank0]: " before each traceback
    # line; the console tee must not add a second one.
    console = proc.stdout.splitlines()
    assert "[rank0]: Traceback (most recent call last):" in console, console
    assert all(line.startswith("[rank0]: ") for line in console), console
    assert not [line for line in console if line.startswith("[rank0]: [rank")], console


@pytest.mark.timeout(90)
def test_worker_killed_by_signal_is_reported_by_name(tmp_path):
    script = write(tmp_path, "job.py", RANK1_KILLED)
    proc = distrun(tmp_path, "--nproc_per_node", "2", "--tee", "none", script)
    assert proc.returncode == 128 + signal.SIGKILL
    last = proc.stderr.rstrip().splitlines()[-1]
    assert "rank 1 (local rank 1" in last
    assert "was killed by SIGKILL (signal 9)" in last
    assert "exiting with code 137" in last
    assert "about to die" in proc.stderr  # the log tail
    assert proc.stdout == ""  # --tee none


@pytest.mark.timeout(90)
def test_the_rank_that_failed_first_is_named_even_when_its_peer_exits_first(tmp_path):
    script = write(tmp_path, "job.py", RANK1_CLOSES_THE_GROUP_THEN_LINGERS)
    proc = distrun(tmp_path, "--nproc_per_node", "2", *grace_period_args(5), script)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    err = proc.stderr.rstrip().splitlines()
    assert err[-2] == "distrun: also failed: rank 0 exited with code 1.", err[-2]
    assert err[-1].startswith("distrun: rank 1 (local rank 1, pid "), err[-1]
    assert "rank 1 is failing" in proc.stderr  # rank 1's log tail


def start_two_nodes(tmp_path, script, *flags, node_flags=lambda rank: ()):
    """Two distrun 'nodes' on this host (node ranks 0 and 1, one --master), each with ``flags`` and its
    ``node_flags(rank)``; text pipes for stdout and stderr."""
    master = f"127.0.0.1:{free_port()}"
    return [
        subprocess.Popen(
            distrun_cmd("--nnodes", "2", "--node_rank", str(rank), "--master", master, *flags, *node_flags(rank),
                        script),
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
        )
        for rank in (0, 1)
    ]


def start_waiting_job(tmp_path):
    script = write(tmp_path, "job.py", WAITS_WITH_CHILD)
    proc = subprocess.Popen(
        distrun_cmd("--nproc_per_node", "2", *grace_period_args(5), script),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=worker_env(),
    )
    pid_files = [tmp_path / "pids.0", tmp_path / "pids.1"]
    ok = wait_until(lambda: all(p.exists() for p in pid_files), 60)
    if not ok:
        proc.kill()
        pytest.fail(f"workers did not start: {proc.communicate()}")
    pids = [int(x) for p in pid_files for x in p.read_text().split()]
    assert len(pids) == 4
    assert not any(gone(p) for p in pids)
    return proc, pids


@pytest.mark.timeout(90)
def test_sigint_stops_every_worker_and_their_children(tmp_path):
    proc, pids = start_waiting_job(tmp_path)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT; stopped every worker" in err
    assert wait_until(lambda: all(gone(p) for p in pids), 10), [p for p in pids if not gone(p)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("node_rank", "sig"), [(0, signal.SIGTERM), (1, signal.SIGINT)])
def test_a_stop_signal_ends_a_wait_for_the_other_nodes(tmp_path, node_rank, sig):
    """Torch's static rendezvous waits in C++ (TCPStore) for the other nodes, up to 15 minutes,
    where Python runs no signal handler: Ctrl-C or SIGTERM must still end distrun at once."""
    script = write(tmp_path, "job.py", ALLREDUCE)
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen(
        distrun_cmd("--nnodes", "2", "--node_rank", str(node_rank), "--master", f"127.0.0.1:{free_port()}",
                    script),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=worker_env(TMPDIR=str(tmp_path / "tmp")),
    )
    assert proc.stderr.readline().startswith(
        "distrun: 1 worker(s) on this node, world size from the rendezvous; rendezvous")
    time.sleep(2)  # well inside the rendezvous's wait by now
    start = time.monotonic()
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"distrun ignored {sig.name} during the rendezvous: {proc.communicate()}")
    assert proc.returncode == 128 + sig, err
    assert time.monotonic() - start < 10
    assert f"distrun: received {sig.name} before the workers started; nothing was left running." in err
    assert list((tmp_path / "tmp").iterdir()) == [], "distrun's temporary directories are removed"
    assert not (tmp_path / "log" / "workerlog.0").exists()


# Node rank 1's worker outlives node rank 0's by a minute.
NODE1_RUNS_LONGER = """
    import os, time
    if os.environ["GROUP_RANK"] == "1":
        time.sleep(60)
    print("done", os.environ["RANK"], flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stop_signal_ends_the_wait_for_the_other_nodes_to_finish(tmp_path):
    """A node whose workers are done waits in torch's exit barrier (C++, up to 300 s) for the others."""
    script = write(tmp_path, "job.py", NODE1_RUNS_LONGER)
    nodes = start_two_nodes(tmp_path, script, *grace_period_args(5))
    try:
        log0 = tmp_path / "log" / "workerlog.0"
        assert wait_until(lambda: log0.exists() and "done 0" in log0.read_text(), 60)
        time.sleep(2)  # rank 0 has exited; node 0 waits for node 1
        start = time.monotonic()
        nodes[0].send_signal(signal.SIGTERM)
        _, err = nodes[0].communicate(timeout=30)
        assert nodes[0].returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - start < 15
        assert ("distrun: received SIGTERM after this node's workers had exited, while waiting for the other "
                "nodes to finish; nothing was left running here (logs in log).") in err
    finally:
        for node in nodes:
            node.kill()
            node.communicate()


@pytest.mark.timeout(90)
def test_sigkill_of_distrun_leaves_no_orphans(tmp_path):
    proc, pids = start_waiting_job(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    # Workers die by their death signal, their children by the guardian.
    assert wait_until(lambda: all(gone(p) for p in pids), 15), [p for p in pids if not gone(p)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_max_restarts_recovers_from_a_killed_worker(tmp_path):
    script = write(tmp_path, "job.py", FAILS_ONCE)
    proc = distrun(tmp_path, "--nproc_per_node", "2", "--max_restarts", "1", "--tee", "all", script, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "[rank0]: attempt 1 rank 0 finished with 4.0" in proc.stdout.splitlines()
    assert "[rank1]: attempt 1 rank 1 finished with 4.0" in proc.stdout.splitlines()
    log1 = (tmp_path / "log" / "workerlog.1").read_text().splitlines()
    separators = [i for i, line in enumerate(log1) if line.startswith("===== distrun: rank 1")]
    assert len(separators) == 2
    assert "start 1, TORCHELASTIC_RESTART_COUNT=0" in log1[separators[0]]
    assert "start 2, TORCHELASTIC_RESTART_COUNT=1" in log1[separators[1]]
    first, second = log1[separators[0]:separators[1]], log1[separators[1]:]
    assert "attempt 0 rank 1 sum 2.0" in first
    assert "attempt 1 rank 1 finished with 4.0" in second


@pytest.mark.timeout(60)
def test_module_and_log_dir(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    write(tmp_path, "pkg/job.py", "import os, sys\nprint('module rank', os.environ['RANK'], sys.argv[1:])\n")
    proc = distrun(tmp_path, "--nproc_per_node", "2", "--log_dir", "out/logs", "--tee", "1", "-m", "pkg.job", "-x")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[rank1]: module rank 1 ['-x']"]
    assert "module rank 0 ['-x']" in (tmp_path / "out" / "logs" / "workerlog.0").read_text()


# Rank 0 keeps printing after the console's reader is gone; rank 1 ends
# with code 3 (or 0) once rank 0 is well past its first line.
PRINTS_THEN_RANK1_EXITS = """
    import os, sys, time
    rank = os.environ["RANK"]
    for i in range(20):
        print(f"rank {rank} line {i}", flush=True)
        time.sleep(0.05)
    if rank == "1":
        sys.exit(int(sys.argv[1]))
    time.sleep(0 if sys.argv[1] == "0" else 60)
"""


def run_with_console_closed(tmp_path, code, stderr_too):
    """distrun whose console reader leaves after one line, as in ``distrun ... | head -1``."""
    script = write(tmp_path, "job.py", PRINTS_THEN_RANK1_EXITS)
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err:
        proc = subprocess.Popen(
            distrun_cmd("--nproc_per_node", "2", *grace_period_args(5), script, str(code)),
            cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if stderr_too else err, env=worker_env(),
        )
        first = proc.stdout.readline()
        proc.stdout.close()
        returncode = proc.wait(timeout=60)
    return returncode, first, err_file.read_text()


@pytest.mark.timeout(90)
def test_a_closed_console_does_not_change_the_outcome(tmp_path):
    """``distrun ... | head -1``: the tee stops, the job finishes, the exit code is the job's."""
    returncode, first, err = run_with_console_closed(tmp_path, 0, stderr_too=False)
    assert first == b"[rank0]: rank 0 line 0\n"
    assert returncode == 0, err
    assert "Traceback" not in err, err
    assert "BrokenPipeError" not in err, err
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert "rank 0 line 19" in log0, "the workers' logs are complete"


@pytest.mark.timeout(90)
def test_a_failure_keeps_its_exit_code_when_the_console_is_closed(tmp_path):
    """``distrun ... 2>&1 | head -1``: the report cannot be shown, its exit code still comes back."""
    returncode, first, _ = run_with_console_closed(tmp_path, 3, stderr_too=True)
    assert first.startswith(b"distrun: 2 worker(s) on this node")
    assert returncode == 3


@pytest.mark.timeout(120)
def test_two_nodes_with_the_two_hosts_recipe(tmp_path):
    """launch/two_hosts.sh on this host twice: two 'nodes' of one worker each."""
    script = write(tmp_path, "job.py", ALLREDUCE)
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "two_hosts.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "distrun").write_text(f"#!/bin/sh\nexec {sys.executable} -m distamp.launcher \"$@\"\n")
    (bindir / "distrun").chmod(0o755)
    env = worker_env(
        HOSTS="127.0.0.1,localhost", PORT=str(free_port()), NPROC="1",
        PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")),
    )
    nodes = [
        subprocess.Popen(
            ["bash", recipe, str(rank), script], cwd=tmp_path, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env,
        )
        for rank in (0, 1)
    ]
    results = [node.communicate(timeout=100) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], results
    assert "[rank0]: rank 0 sum 3.0" in results[0][0]
    log1 = (tmp_path / "log" / "workerlog.1").read_text()
    assert "rank 1 sum 3.0" in log1
    assert "'WORLD_SIZE': '2'" in log1
    assert "'LOCAL_RANK': '0'" in log1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_nodes_restart_together(tmp_path):
    """--max_restarts on two 'nodes' (two distrun on this host): both nodes restart."""
    script = write(tmp_path, "job.py", FAILS_ONCE)
    nodes = start_two_nodes(tmp_path, script, "--max_restarts", "1", node_flags=lambda r: ("--log_dir", f"node{r}"))
    results = [node.communicate(timeout=100) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], results
    logs = "".join((tmp_path / f"node{r}").joinpath(name).read_text()
                   for r in (0, 1) for name in os.listdir(tmp_path / f"node{r}"))
    assert "attempt 0 rank 1 sum 2.0" in logs
    for rank in (0, 1):
        assert re.search(rf"attempt \d rank {rank} finished with 4.0", logs), logs
    assert "all nodes restart together" in results[0][1]


@pytest.mark.timeout(120)
def test_nodes_running_different_worker_counts_get_the_rendezvous_world_size_and_tee(tmp_path):
    """As with torchrun, each node may run its own --nproc_per_node: node 0 runs ranks 0-1 and node 1 rank 2.
    distrun names the world size the rendezvous set, tees rank 2 on the node running it (a check against
    nnodes x nproc_per_node refused '--tee 2' there, and '--tee all' left it out) and says which named
    ranks no worker has."""
    script = write(tmp_path, "job.py", ALLREDUCE)
    nodes = start_two_nodes(tmp_path, script, node_flags=lambda r: (
        ("--nproc_per_node", "2", "--tee", "all", "--log_dir", "node0") if r == 0
        else ("--tee", "2,5", "--log_dir", "node1")))
    (out0, err0), (out1, err1) = [node.communicate(timeout=100) for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], (err0, err1)
    for err, ranks in ((err0, "0,1"), (err1, "2")):
        assert "world size from the rendezvous" in err.splitlines()[0], err
        assert f"distrun: world size 3; this node runs rank(s) {ranks}." in err, err
    assert "--tee names rank 5, but the world size is 3 (ranks 0 to 2); no worker has that rank." in err1
    assert "--tee names" not in err0
    assert "[rank0]: rank 0 sum 6.0" in out0
    assert "[rank1]: rank 1 sum 6.0" in out0
    assert "[rank2]: rank 2 sum 6.0" in out1, out1
    assert "'WORLD_SIZE': '3'" in (tmp_path / "node1" / "workerlog.2").read_text()


# A job that prints its own lines, the second half once the file "release" exists (when
# that is asked for: it keeps the job running meanwhile).
PRINTS_ITS_NAME = """
    import os, sys, time
    name, lines, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "wait"
    for i in range(lines):
        if wait and i == lines // 2:
            deadline = time.monotonic() + 60
            while not os.path.exists("release") and time.monotonic() < deadline:
                time.sleep(0.1)
        print(f"{name} line {i}", flush=True)
"""


@pytest.mark.timeout(150)
def test_a_second_job_on_a_log_dir_in_use_is_refused_and_lines_never_mix(tmp_path):
    script = write(tmp_path, "job.py", PRINTS_ITS_NAME)
    first = subprocess.Popen(distrun_cmd(script, "JOB-A", "6", "wait"), cwd=tmp_path, env=worker_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        log = tmp_path / "log" / "workerlog.0"
        assert wait_until(lambda: log.exists() and "JOB-A line 2" in log.read_text(), 60), "job A did not start"
        second = distrun(tmp_path, script, "JOB-B", "4", "go")  # while job A runs
        (tmp_path / "release").touch()
        a_out, a_err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, a_err
    assert [line for line in a_out.splitlines() if "JOB-" in line] == [f"[rank0]: JOB-A line {i}" for i in range(6)]
    a_log = log.read_text()
    assert "JOB-B" not in a_log
    assert all(f"JOB-A line {i}" in a_log for i in range(6))
    assert second.returncode == 2, second.stderr
    assert "JOB-" not in second.stdout + second.stderr
    assert re.search(r"--log_dir 'log' is in use by another distrun job \(pid \d+ on .*, started .*\)",
                     second.stderr), second.stderr
    assert second.stderr.splitlines()[0].startswith("distrun: error: --log_dir 'log' is in use")
    # Once the first job has ended, the directory is free again.
    third = distrun(tmp_path, script, "JOB-C", "2", "go")
    assert third.returncode == 0, third.stderr
    assert [line for line in third.stdout.splitlines() if "JOB-" in line] == ["[rank0]: JOB-C line 0",
                                                                              "[rank0]: JOB-C line 1"]
    assert "JOB-A" not in log.read_text()
