"""launcher._bootstrap: its helpers in this process, main() in a real child process started as the agent does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from unittest import mock

import pytest

from distamp.launcher import _bootstrap

BOOTSTRAP = os.path.abspath(_bootstrap.__file__)


def test_stamp_exit_writes_the_time_atomically(tmp_path):
    path = str(tmp_path / "exit.0")
    before = time.time()
    _bootstrap._stamp_exit(path)
    stamped = float((tmp_path / "exit.0").read_text())
    assert before <= stamped <= time.time()
    assert sorted(os.listdir(tmp_path)) == ["exit.0"]


def test_stamp_exit_ignores_an_unwritable_place(tmp_path):
    _bootstrap._stamp_exit(str(tmp_path / "missing" / "exit.0"))
    assert os.listdir(tmp_path) == []


def test_alive_counts_zombies_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert _bootstrap._alive(os.getpid())
    deadline = time.monotonic() + 30
    while _bootstrap._alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _bootstrap._alive(child.pid)  # exited, not yet reaped: a zombie
    assert os.path.exists(f"/proc/{child.pid}")
    child.wait()
    assert not _bootstrap._alive(child.pid)


def test_others_in_group():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert _bootstrap._others_in_group(child.pid)  # the child leads its own group
    finally:
        child.kill()
        child.wait()
    assert not _bootstrap._others_in_group(child.pid)


def test_launcher_exits_within():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _bootstrap._launcher_exits_within(child.pid, 0.05)
    finally:
        child.kill()
        child.wait()
    assert _bootstrap._launcher_exits_within(child.pid, 0.05)  # reaped: no such process


def test_launcher_died_is_false_when_the_worker_exits_first():
    worker = subprocess.Popen([sys.executable, "-c", "pass"])
    seen = []
    with mock.patch.object(_bootstrap, "_LAUNCHER_EXIT_GRACE", 0.01):
        assert not _bootstrap._launcher_died(os.getpid(), worker.pid, lambda: seen.append(True))
    worker.wait()
    assert seen == [True]


def _env(tmp_path, command, launcher_pid, exit_file=None):
    env = {
        **os.environ,
        "RANK": "3",
        _bootstrap.COMMAND_VAR: json.dumps(command),
        _bootstrap.LOG_DIR_VAR: str(tmp_path),
        _bootstrap.LAUNCHER_PID_VAR: str(launcher_pid),
    }
    if exit_file is not None:
        env[_bootstrap.EXIT_FILE_VAR] = exit_file
    return env


PROBE = (
    "import json, os, sys; print(json.dumps({'argv': sys.argv, 'pid': os.getpid(), 'env': sorted(k for k in os.environ"
    " if k.startswith('DISTAMP_WORKER') or k == 'DISTAMP_LAUNCHER_PID')})); print('to stderr', file=sys.stderr);"
    " sys.exit(7)"
)


def test_main_redirects_output_and_execs_the_command_with_its_arguments(tmp_path):
    (tmp_path / "workerlog.3").write_text("earlier attempt\n")
    exit_file = str(tmp_path / "exit.3")
    # A session of its own, as the agent gives each worker: the bootstrap's guardian SIGKILLs its
    # process group once the "launcher" (this pytest process) exits, which must not be pytest's group.
    proc = subprocess.Popen(
        [sys.executable, BOOTSTRAP],
        env=_env(tmp_path, ["-c", PROBE, "$x", "--lr", "0.1"], os.getpid(), exit_file),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7  # the command's own exit code: exec, not a child
    assert (out, err) == (b"", b"")
    lines = (tmp_path / "workerlog.3").read_text().splitlines()
    assert lines[0] == "earlier attempt"  # appended, not truncated
    assert len(lines) == 3
    assert "to stderr" in lines[1:]
    report = json.loads(next(line for line in lines[1:] if line.startswith("{")))
    assert report["argv"] == ["-c", "$x", "--lr", "0.1"]  # python -u -c CODE: argv[0] is '-c'; $x untouched
    assert report["pid"] == proc.pid
    assert report["env"] == []  # the bootstrap's variables are not passed on
    deadline = time.monotonic() + 30
    while not os.path.exists(exit_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert float((tmp_path / "exit.3").read_text()) <= time.time()


def test_main_exits_at_once_when_the_launcher_is_already_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = subprocess.run(
        [sys.executable, BOOTSTRAP],
        env=_env(tmp_path, ["-c", "open('ran', 'w')"], gone.pid),
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=False,
        start_new_session=True,
    )
    assert proc.returncode == 128 + 9
    assert os.listdir(tmp_path) == []  # no log opened, the command never ran


@pytest.mark.parametrize("missing", [_bootstrap.COMMAND_VAR, _bootstrap.LOG_DIR_VAR, _bootstrap.LAUNCHER_PID_VAR])
def test_main_needs_its_variables(tmp_path, missing):
    env = _env(tmp_path, ["-c", "pass"], os.getpid())
    with mock.patch.dict(os.environ, env, clear=True):
        del os.environ[missing]
        with mock.patch.object(_bootstrap, "_die_with_launcher") as die, pytest.raises(KeyError, match=missing):
            _bootstrap.main()
    assert die.call_count == 0  # all three are read before anything is done


def test_main_in_process_steps_in_order(tmp_path):
    env = _env(tmp_path, ["train.py", "--x"], 4242, "/tmp/e")
    calls = []
    with mock.patch.dict(os.environ, env, clear=True), \
            mock.patch.object(_bootstrap, "_die_with_launcher", lambda pid: calls.append(("die", pid))), \
            mock.patch.object(_bootstrap, "_start_guardian", lambda pid, f: calls.append(("guard", pid, f))), \
            mock.patch.object(_bootstrap, "_redirect_output", lambda d, r: calls.append(("log", d, r))), \
            mock.patch.object(_bootstrap.os, "execve", lambda exe, argv, e: calls.append(("exec", exe, argv, e))):
        _bootstrap.main()
        assert os.environ[_bootstrap.COMMAND_VAR]  # main leaves its own environment alone
    assert calls[:3] == [("die", 4242), ("guard", 4242, "/tmp/e"), ("log", str(tmp_path), "3")]
    exe, argv, passed = calls[3][1:]
    assert (exe, argv) == (sys.executable, [sys.executable, "-u", "train.py", "--x"])
    assert not {k for k in passed if k.startswith(("DISTAMP_WORKER", "DISTAMP_LAUNCHER"))}
    assert passed["RANK"] == "3"
