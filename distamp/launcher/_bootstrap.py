"""First code every distrun worker runs, before it becomes the user's script.

The elastic agent starts ``python _bootstrap.py`` for each worker. This file:

1. asks the kernel to SIGKILL the worker when the launcher dies
   (``PR_SET_PDEATHSIG``), and leaves a tiny guardian process in the
   worker's process group that SIGKILLs the whole group (the worker's own
   children too) when the launcher dies, so a ``kill -9`` of distrun leaves
   no orphan; when the worker exits, the guardian stamps the time in a file
   for the launcher's report and stays while anything is left in the
   group, then exits;
2. sends stdout and stderr to ``log_dir/workerlog.RANK``, opened in append
   mode so restarts add to the same file (the launcher writes the separator);
3. ``exec``s the interpreter on the user's script or module, so the worker's
   pid, exit code and signals are the script's own.

It is run by path (not ``-m``) and imports only the standard library so it
works without ``distamp`` on ``sys.path`` and costs a few milliseconds.
The command travels in the environment, not in argv, because the agent
rewrites ``$``-macros in argv and the user's arguments must stay untouched.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable

COMMAND_VAR = "DISTAMP_WORKER_COMMAND"
LOG_DIR_VAR = "DISTAMP_WORKER_LOG_DIR"
LAUNCHER_PID_VAR = "DISTAMP_LAUNCHER_PID"
EXIT_FILE_VAR = "DISTAMP_WORKER_EXIT_FILE"
GUARDIAN_NAME = b"distrun-guard"  # its /proc/PID/comm, as ps and top show it
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_PR_SET_NAME = 15
_LAUNCHER_EXIT_GRACE = 1.0  # seconds; see _launcher_died
_GROUP_POLL = 1.0  # seconds between looks at what a finished worker left behind


def _die_with_launcher(launcher_pid: int) -> None:
    """Get SIGKILL when the launcher exits; exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            print(f"distrun bootstrap: prctl(PR_SET_PDEATHSIG) failed: "
                  f"{os.strerror(errno)}", file=sys.stderr)
    # The launcher may have died between fork and prctl: the death signal
    # would then never come, so check the parent after arming it.
    if os.getppid() != launcher_pid:
        os._exit(128 + int(signal.SIGKILL))


def _launcher_died(launcher_pid: int, worker_pid: int, on_worker_exit: Callable[[], None]) -> bool:
    """Block until the launcher or the worker exits; True if it was the launcher.

    Exit is judged by pidfd readiness (or ``/proc`` state), not ``kill(pid,
    0)``, because a dead launcher stays a zombie until its parent reaps it.
    ``on_worker_exit`` runs as soon as the worker is seen to have exited,
    before the grace spent telling the two cases apart.
    """
    try:
        launcher_fd = os.pidfd_open(launcher_pid)
        worker_fd = os.pidfd_open(worker_pid)
    except ProcessLookupError:
        return not _alive(launcher_pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): poll instead
        while _alive(launcher_pid) and _alive(worker_pid):
            time.sleep(0.5)
        if _alive(launcher_pid):
            on_worker_exit()
            time.sleep(_LAUNCHER_EXIT_GRACE)
        return not _alive(launcher_pid)
    ready, _, _ = select.select([launcher_fd, worker_fd], [], [])
    if launcher_fd in ready:
        return True
    on_worker_exit()
    # The kernel sends the worker its death signal before it marks the dying
    # launcher as exited, so a worker that just died may be the first sign.
    ready, _, _ = select.select([launcher_fd], [], [], _LAUNCHER_EXIT_GRACE)
    return bool(ready)


def _launcher_exits_within(launcher_pid: int, seconds: float) -> bool:
    """Wait up to ``seconds``; True as soon as the launcher has exited."""
    try:
        fd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        time.sleep(seconds)
        return not _alive(launcher_pid)
    try:
        return bool(select.select([fd], [], [], seconds)[0])
    finally:
        os.close(fd)


def _others_in_group(group: int) -> bool:
    """True while a live process other than this one is in process group ``group``."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _stamp_exit(path: str) -> None:
    """Write the current time to ``path`` (atomically): when the worker exited."""
    try:
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # only the launcher's report loses precision


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _start_guardian(launcher_pid: int, exit_file: str | None) -> None:
    """Fork a guardian that kills this worker's process group if the launcher dies.

    The death signal reaches the worker only, not processes it starts (data
    loader workers, tools); the guardian shares the worker's process group
    and SIGKILLs all of it. It is double-forked so it is never the user's
    child (a user ``os.wait()`` cannot reap it). It ignores the signals the
    launcher sends the group to stop it, so it still guards what does not
    stop; it exits once the worker has exited and nothing else is left in
    the group. When the worker exits it writes the time to ``exit_file``:
    the launcher learns of exits only by polling, and its report needs the
    order in which workers ended.
    """
    worker_pid = os.getpid()
    first = os.fork()
    if first:
        os.waitpid(first, 0)
        return
    try:
        if os.fork():
            os._exit(0)
        os.closerange(0, 3)
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_NAME, GUARDIAN_NAME, 0, 0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN)
        group = os.getpgid(0)
        stamp = (lambda: _stamp_exit(exit_file)) if exit_file else (lambda: None)
        launcher_died = _launcher_died(launcher_pid, worker_pid, stamp)
        # Processes the worker started may outlive it; the launcher kills them
        # when the job ends, and this guardian if the launcher dies first.
        while not launcher_died and _others_in_group(group):
            launcher_died = _launcher_exits_within(launcher_pid, _GROUP_POLL)
        if launcher_died:
            os.killpg(group, signal.SIGKILL)
    finally:
        os._exit(0)


def _redirect_output(log_dir: str, rank: str) -> None:
    """Point fds 1 and 2 at ``log_dir/workerlog.RANK`` (append mode)."""
    path = os.path.join(log_dir, f"workerlog.{rank}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    """Arm the death signal, redirect output, then exec the user's command."""
    env = dict(os.environ)
    command = json.loads(env.pop(COMMAND_VAR))
    log_dir = env.pop(LOG_DIR_VAR)
    launcher_pid = int(env.pop(LAUNCHER_PID_VAR))
    exit_file = env.pop(EXIT_FILE_VAR, None)
    _die_with_launcher(launcher_pid)
    _start_guardian(launcher_pid, exit_file)
    _redirect_output(log_dir, env["RANK"])
    argv = [sys.executable, "-u", *command]
    os.execve(sys.executable, argv, env)


if __name__ == "__main__":
    main()
