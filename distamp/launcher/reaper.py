"""distrun as the reaper of everything its workers start.

The elastic agent stops a worker by signalling the worker's process group,
and the bootstrap's guardian kills that group if distrun dies. A process
that outlives its worker escapes both once the worker has exited: it is
re-parented (to init) and nobody stops it. :class:`Reaper` makes distrun a
*child subreaper* (``PR_SET_CHILD_SUBREAPER``, Linux), so such orphans
become distrun's children instead; it reaps the ones that exit while the job
runs and, when an attempt or the job ends, SIGKILLs whatever is still below
distrun. Processes that leave their worker's process group or session are
caught the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from distamp.launcher._bootstrap import GUARDIAN_NAME

if TYPE_CHECKING:
    # typing.Self is Python 3.11+; mypy checks for 3.10 (setup.cfg).
    import typing_extensions

__all__ = ["Reaper"]

_PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>
_PR_GET_CHILD_SUBREAPER = 37
_REAP_INTERVAL = 1.0  # seconds between reaps of exited orphans while the job runs
_KILL_ROUNDS = 100  # a process forking as fast as it is killed still ends


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of ``pid``, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[3])


def _parents() -> dict[int, list[int]]:
    """Every process's children, from one pass over ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None:
                children.setdefault(info[1], []).append(int(entry))
    return children


def _is_guardian(pid: int) -> bool:
    """True for a bootstrap guardian: part of distrun, not something a worker started."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() == GUARDIAN_NAME
    except OSError:
        return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    text = shlex.join(argv) or "?"
    return text if len(text) <= 80 else text[:77] + "..."


class Reaper:
    """Make this process the subreaper of what it starts, and clean up after it.

    Use it around the launch::

        with Reaper() as reaper:
            ...  # start and run workers
            left = reaper.kill_leftovers()

    Children this process already had when the reaper was created (and
    their descendants) are never touched, so a program that calls
    ``launch()`` keeps its own processes. Elsewhere than on Linux it does
    nothing.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._linux = sys.platform.startswith("linux")
        self._keep = set(_parents().get(self._pid, [])) if self._linux else set()
        self._was_subreaper: bool | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> typing_extensions.Self:
        if not self._linux:
            return self
        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(old), 0, 0, 0) == 0:
            self._was_subreaper = bool(old.value)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            print(f"distrun: warning: prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(errno)}; "
                  f"processes left by finished workers may survive the job.", file=sys.stderr)
        self._thread = threading.Thread(target=self._run, name="distrun-reaper", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._linux and self._was_subreaper is False:
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def _run(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL):
            self.reap(workers_done=False)

    def reap(self, workers_done: bool) -> None:
        """Collect the exit status of orphans that have exited (zombies).

        While workers run, their exit status belongs to the elastic agent
        (``Popen.poll``); workers are session leaders (the agent starts them
        with ``start_new_session``), so a zombie that leads its own session
        is left to the agent until ``workers_done``.
        """
        with self._lock:
            for pid in _parents().get(self._pid, []):
                info = _stat(pid)
                if pid in self._keep or info is None or info[0] != "Z":
                    continue
                if info[2] == pid and not workers_done:
                    continue
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def _descendants(self) -> list[int]:
        children, out = _parents(), []
        todo = [p for p in children.get(self._pid, []) if p not in self._keep]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def kill_leftovers(self) -> list[str]:
        """SIGKILL every process below this one (once the agent has stopped the workers).

        Returns ``"pid (command)"`` for each live process that was killed, so
        the caller can say what the workers had left behind (the bootstrap's
        guardians, which exit on their own a moment after their worker, are
        killed without being listed).
        """
        if not self._linux:
            return []
        killed: dict[int, str | None] = {}
        for _ in range(_KILL_ROUNDS):
            live = [p for p in self._descendants() if (_stat(p) or ("X",))[0] not in ("Z", "X")]
            if not live:
                break
            for pid in live:
                if pid not in killed:
                    killed[pid] = None if _is_guardian(pid) else _command(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # Killed processes' children are re-parented here; reaping lets
            # the next round see the tree as it now is.
            time.sleep(0.01)
            self.reap(workers_done=True)
        self.reap(workers_done=True)
        return [f"{pid} ({cmd})" for pid, cmd in sorted(killed.items()) if cmd is not None]
