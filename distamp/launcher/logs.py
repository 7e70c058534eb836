"""Per-rank log files ``log_dir/workerlog.N`` and the console tee.

Workers write their own stdout and stderr to ``workerlog.RANK`` in append
mode (see ``_bootstrap.py``), so a restart adds to the file. Torch's
default log layout opens files with ``"w"`` per attempt and tails them from
the start; :class:`RankLogs` replaces it: it starts each job with fresh
files, writes a separator line before every attempt, and tails only the new
part of the tee'd ranks' files to the console, each line prefixed with
``[rankN]:`` exactly once (torch's own exception hook already prefixes a
worker's traceback lines with it once the process group exists).

It also hands each worker the files the launcher reads after an attempt:
torch's error file and the exit stamp written by the bootstrap's guardian.

:func:`claim_log_dir` keeps two jobs from writing the same files: a second
``distrun`` on a log directory that a live job on the same node rank holds
is refused, naming it and the job that holds it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from distamp.launcher import _bootstrap

__all__ = [
    "LogDirInUseError", "RankLogs", "claim_log_dir", "discard_output", "log_path", "say", "tail_lines",
]


def log_path(log_dir: str, rank: int) -> str:
    """Path of global rank ``rank``'s log file."""
    return os.path.join(log_dir, f"workerlog.{rank}")


class LogDirInUseError(RuntimeError):
    """Another live ``distrun`` job writes its logs to the directory this one was given."""


@contextmanager
def claim_log_dir(log_dir: str, node_rank: int = 0) -> Iterator[None]:
    """Hold ``log_dir`` (which must exist) for this job's node ``node_rank`` while the block runs.

    The claim is an exclusive ``flock`` on ``log_dir/.distrun-node{node_rank}.lock``:
    the kernel drops it when the holder exits, even by SIGKILL, so only a
    live job can hold it. Each node of one job claims its own file (its
    workers write their own ranks' files), so the nodes of a job may share
    the directory on a shared file system. The lock file keeps the holder's
    pid, host and start time for the message a second job gets.

    Raises:
        LogDirInUseError: a live job holds it, naming the directory and that job.
    """
    path = os.path.join(log_dir, f".distrun-node{node_rank}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip() or "a process"
            raise LogDirInUseError(
                f"--log_dir {log_dir!r} is in use by another distrun job ({holder}), whose workers write "
                f"{os.path.join(log_dir, 'workerlog.N')} there: two jobs would mix their lines in the same files. "
                f"Wait for it to finish, or give this job its own directory, e.g. --log_dir "
                f"{log_dir.rstrip(os.sep) + '-2'!r}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # drops the lock


def tail_lines(path: str, count: int = 20) -> list[str]:
    """The last ``count`` lines of ``path`` (empty when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", errors="replace").splitlines()[-count:]


def discard_output(stream: TextIO) -> None:
    """Send what is still to be written to ``stream`` to /dev/null: its reader is gone.

    For a console whose pipe was closed (``distrun ... | head``). Text still
    buffered in ``stream`` would otherwise fail again when Python flushes it
    at exit: a traceback, and exit code 120 instead of the job's. This is
    the ``signal`` module docs' advice for SIGPIPE. A stream without a
    descriptor (a ``StringIO``) is left as it is.
    """
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation is both
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def say(stream: TextIO, text: str) -> None:
    """Print ``text`` on ``stream`` and flush it; nothing when its reader is gone.

    distrun's messages must not turn a job's exit code into a traceback
    because the console was closed before the job ended.
    """
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        discard_output(stream)


def _with_prefix(prefix: str, line: str) -> str:
    """``line`` with ``prefix`` in front, once.

    After ``init_process_group`` torch's ``sys.excepthook`` writes every
    traceback line as ``[rankN]: ...`` into the worker's own stderr, and its
    C++ warnings start with ``[rankN]:[W...``; adding the tee's prefix again
    would double it.
    """
    tag = prefix.rstrip()
    if line.startswith(tag):
        line = line[len(tag):].removeprefix(" ")
    return prefix + line


@dataclass
class _TeeFile:
    """A tee'd file: its line prefix, how far it has been read, and a trailing partial line."""

    prefix: str
    offset: int
    partial: bytes = b""


class _Tee:
    """Copy new lines of some files to a stream, each with a prefix.

    One thread polls every file; :meth:`stop` drains what is left (including
    a last line without a newline) before returning. When the stream's
    reader goes away (``distrun ... | head``) the tee stops copying and the
    job goes on: the workers write to their log files, not to the console.
    """

    def __init__(self, files: dict[str, tuple[str, int]], out: TextIO, interval: float = 0.05):
        self._files = {p: _TeeFile(prefix, offset) for p, (prefix, offset) in files.items()}
        self._out = out
        self._interval = interval
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distrun-tee", daemon=True)
        self._thread.start()

    def _pump(self, final: bool) -> None:
        if self._closed:
            return
        try:
            self._copy_new_lines(final)
        except BrokenPipeError:
            self._closed = True
            discard_output(self._out)

    def _copy_new_lines(self, final: bool) -> None:
        for path, state in self._files.items():
            try:
                with open(path, "rb") as f:
                    f.seek(state.offset)
                    data = f.read()
            except OSError:
                continue
            state.offset += len(data)
            lines = (state.partial + data).split(b"\n")
            state.partial = lines.pop()
            if final and state.partial:
                lines.append(state.partial)
                state.partial = b""
            for line in lines:
                self._out.write(_with_prefix(state.prefix, line.decode("utf-8", errors="replace")) + "\n")
        self._out.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._pump(final=False)

    def stop(self) -> None:
        """Stop polling after copying everything written so far."""
        self._stop.set()
        self._thread.join()
        self._pump(final=True)


class RankLogs(LogsSpecs):
    """Torch ``LogsSpecs`` for distrun: ``log_dir/workerlog.RANK`` plus a tee.

    Args:
        log_dir: where ``workerlog.N`` files go (must exist).
        tee_ranks: global ranks whose new lines are copied to ``out``
            (``None``: every rank).
        out: console stream for the tee (default ``sys.stdout``).
        before_start: called before each attempt's workers start, after its
            rendezvous (:attr:`ranks` and :attr:`world_size` are the attempt's):
            distrun stops there whatever the previous attempt left running.
    """

    def __init__(
        self,
        log_dir: str,
        tee_ranks: frozenset[int] | None,
        out: TextIO | None = None,
        before_start: Callable[[], None] | None = None,
    ):
        super().__init__(log_dir=log_dir)
        self._log_dir = log_dir
        self._tee_ranks = tee_ranks
        self._out = out if out is not None else sys.stdout
        self._before_start = before_start
        self._tee_copier: _Tee | None = None
        self._started: set[str] = set()
        self._round = 0
        self._ranks: tuple[int, ...] = ()
        self._world_size = 0
        self._round_started = 0.0
        # Torch's error-reply files (written by @record-decorated workers) and
        # the guardians' exit stamps; not logs, so they live outside log_dir
        # and go away with the launch.
        self._error_dir = tempfile.mkdtemp(prefix="distrun-errors-")

    @property
    def attempts(self) -> int:
        """How many times workers were started (0 until the first start)."""
        return self._round

    @property
    def started_at(self) -> float:
        """``time.time()`` when the latest attempt's workers were started."""
        return self._round_started

    @property
    def ranks(self) -> tuple[int, ...]:
        """Global ranks of the latest attempt's workers on this node."""
        return self._ranks

    @property
    def world_size(self) -> int:
        """The latest attempt's world size, as its rendezvous set it (0 before the first)."""
        return self._world_size

    def exit_times(self, wait_for: Collection[int] = (), timeout: float = 2.0) -> dict[int, float]:
        """``time.time()`` at which the latest attempt's workers on this node
        exited, by global rank, for those whose guardian recorded it.

        A guardian writes its stamp a moment after its worker exits, so this
        waits up to ``timeout`` seconds for the stamps of ``wait_for``.
        """
        deadline = time.monotonic() + timeout
        while True:
            times = {}
            for rank in self._ranks:
                try:
                    with open(self._exit_file(self._round, rank), encoding="utf-8") as f:
                        times[rank] = float(f.read())
                except (OSError, ValueError):
                    continue
            if set(wait_for) <= times.keys() or time.monotonic() >= deadline:
                return times
            time.sleep(0.02)

    def _exit_file(self, round_: int, rank: int) -> str:
        return os.path.join(self._error_dir, f"start{round_}.rank{rank}.exit")

    @property
    def root_log_dir(self) -> str:
        """The directory holding ``workerlog.N``."""
        return self._log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Called by the agent before each attempt: write separators, start the tee."""
        self._stop_tee()
        self._ranks = tuple(int(env["RANK"]) for env in envs.values())
        self._world_size = int(next(iter(envs.values()))["WORLD_SIZE"]) if envs else 0
        if self._before_start is not None:
            self._before_start()
        self._round += 1
        tee_files = {}
        error_files = {}
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
            path = log_path(self._log_dir, rank)
            # A new job starts a fresh file; later rounds append to it. Not
            # keyed on the restart count: on several nodes a node restarted
            # because another node failed keeps its count.
            mode = "a" if path in self._started else "w"
            self._started.add(path)
            with open(path, mode, encoding="utf-8") as f:
                f.write(
                    f"===== distrun: rank {rank} (local rank {local_rank}), start "
                    f"{self._round}, TORCHELASTIC_RESTART_COUNT={restarts}, "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
                )
                offset = f.tell()
            if self._tee_ranks is None or rank in self._tee_ranks:
                tee_files[path] = (f"[rank{rank}]: ", offset)
            error_file = os.path.join(self._error_dir, f"start{self._round}.rank{rank}.json")
            error_files[local_rank] = error_file
            env["TORCHELASTIC_ERROR_FILE"] = error_file
            env[_bootstrap.EXIT_FILE_VAR] = self._exit_file(self._round, rank)
        self._round_started = time.time()
        if tee_files:
            self._tee_copier = _Tee(tee_files, self._out)
        # Empty stdouts/stderrs: torch leaves the workers' streams alone and
        # the bootstrap redirects them into the files above.
        return LogsDest(
            stdouts=dict.fromkeys(envs, ""),
            stderrs=dict.fromkeys(envs, ""),
            error_files=error_files,
        )

    def _stop_tee(self) -> None:
        if self._tee_copier is not None:
            self._tee_copier.stop()
            self._tee_copier = None

    def close(self) -> None:
        """Flush the tee and remove the temporary error-file directory."""
        self._stop_tee()
        shutil.rmtree(self._error_dir, ignore_errors=True)
