"""Run a function on N real processes joined in a gloo group on 127.0.0.1.

Tests call :func:`run_workers` with a module-level function; each worker
gets ``(rank, world_size, *args)``, runs inside an initialised
``torch.distributed`` gloo group and returns a picklable value. A worker
that raises fails the test with its traceback; a group that does not finish
within ``timeout`` seconds is killed and fails instead of hanging CI.

Workers start from a ``forkserver`` that has imported torch and distamp
once (per test process), so a worker costs a fork, not a fresh interpreter
importing torch (~0.1 s instead of ~4 s each on the CI's two cores). The
forkserver imports nothing else and runs no torch op, so every worker
starts from a freshly imported torch, as a spawned one would; each worker
also takes the parent's environment of the moment, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import queue
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

_FIRST_TEST_PORT = 10000


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, below the kernel's ephemeral range.

    A port from ``bind(port=0)`` lies in the ephemeral range, where every
    outgoing connection and every listener on port 0 also gets its port (gloo
    opens many of both): between this call and the store binding the port, a
    connection of a test running beside could take it, and rank 0 failed with
    EADDRINUSE. Below that range only another explicit bind takes a port, so
    the port is drawn at random from there (from the OS's entropy: a test may
    seed ``random``) and checked free.
    """
    end = _ephemeral_ports_start()
    draw = random.SystemRandom()
    for _ in range(200 if end - _FIRST_TEST_PORT >= 1000 else 0):
        port = draw.randrange(_FIRST_TEST_PORT, end)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "distamp.fleet", "tests.multiprocess"]
_context: mp.context.BaseContext | None = None


def context() -> mp.context.BaseContext:
    """The multiprocessing context workers start from (a forkserver with torch and distamp loaded)."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _worker(fn, rank, world_size, port, args, env, results, pg_timeout=None):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    succeeded = False
    try:
        if not dist.is_initialized():
            kwargs = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
            dist.init_process_group("gloo", rank=rank, world_size=world_size, **kwargs)
        value = fn(rank, world_size, *args)
        # Bytes, not tensors: torch would share tensor storage by file
        # descriptor, which breaks once this process has exited.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
        succeeded = True
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if succeeded and dist.get_backend() == "gloo":
                # A rank whose fn ran no collective could close its sockets while a peer is still
                # connecting gloo's full mesh ("Connection closed by peer" on the peer): wait for all.
                with contextlib.suppress(Exception):
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes.

    ``pg_timeout`` (seconds) is the process group's collective timeout
    (torch's default when None). Returns the per-rank return values,
    ordered by rank.
    """
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, {**os.environ, **(env or {})}, results, pg_timeout),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: list[str] = []
    try:
        import time

        deadline = time.monotonic() + timeout
        reported: set[int] = set()
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break  # the other ranks had a few seconds to report too
                raise TimeoutError(
                    f"workers did not finish within {timeout}s; "
                    f"finished ranks: {sorted(values)}"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in reported]
                if dead:
                    # A worker died without reporting (e.g. killed by a signal).
                    codes = {i: procs[i].exitcode for i in dead}
                    if not failures:
                        raise RuntimeError(f"worker(s) died without a result: {codes}") from None
                    failures.extend(f"--- rank {i} ---\ndied without a result (exit code {c})"
                                    for i, c in codes.items())
                    reported.update(codes)
                continue
            reported.add(rank)
            if ok:
                import torch

                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
                # One rank's failure often follows another's (a peer gone, a store closed): give the
                # others a few seconds to report theirs, so the first cause is in the message.
                deadline = min(deadline, time.monotonic() + 5.0)
        if failures:
            raise AssertionError("worker failed:\n" + "\n".join(failures))
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def names_distamp(reason: str) -> bool:
    """Whether a torch.compile graph-break reason points at distamp's code (its package directory or a
    ``distamp.`` module), not merely at a path that contains the word (a venv under ~/.cache/distamp-ci)."""
    import distamp

    package = os.path.dirname(os.path.abspath(distamp.__file__))
    return package in reason or "module: distamp" in reason or "`distamp." in reason
