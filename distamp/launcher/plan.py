"""Validate parsed ``distrun`` arguments into a :class:`LaunchPlan`.

Every check that can fail runs here, before any process or rendezvous
starts. A failed check raises :class:`UsageError` whose message quotes the
flag and the value and says how to fix it; ``distrun`` prints it and exits
with code 2.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import ipaddress
import os
import re
import socket
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MASTER_PORT", "WORKERS_PER_CPU", "LaunchPlan", "UsageError", "available_cpus",
    "build_plan",
]

#: Port used with ``--ips`` when ``--master`` is not given (torchrun's default).
DEFAULT_MASTER_PORT = 29500

#: Most workers per CPU that ``--nproc_per_node`` may ask for without
#: ``--allow_oversubscribe``. Beyond that every worker (a Python process with
#: torch loaded, its threads and its log file) competes for a sliver of a
#: core; a typo such as 100000 used to exhaust the host's memory.
WORKERS_PER_CPU = 4

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class UsageError(ValueError):
    """Bad command-line input; ``distrun`` exits with code 2 and this message."""


@dataclass(frozen=True)
class LaunchPlan:
    """A validated launch: everything :func:`distamp.launcher.run.launch` needs."""

    command: tuple[str, ...]
    """What each worker runs after ``python -u``: ``(script, *args)`` or
    ``("-m", module, *args)``, the user's arguments untouched."""
    nproc_per_node: int
    """Workers started on this node."""
    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """This node's rank, ``0 <= node_rank < nnodes``."""
    master_addr: str | None = None
    """Rendezvous host; ``None`` means a single-node job on 127.0.0.1."""
    master_port: int | None = None
    """Rendezvous port; ``None`` means a free one chosen by the OS."""
    gpus: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` entries the workers see (one per worker),
    already mapped through the caller's ``CUDA_VISIBLE_DEVICES``; ``None``
    without ``--gpus``."""
    log_dir: str = "log"
    """Directory of ``workerlog.N``."""
    tee: frozenset[int] = frozenset({0})
    """Global ranks whose output is also printed on the console."""
    max_restarts: int = 0
    """Times a failed worker group is restarted."""
    grace_period: int = 30
    """Seconds workers get to exit after distrun forwards SIGINT/SIGTERM,
    before SIGKILL (torch's agent uses a fixed 30 s after a worker failure)."""

    @property
    def world_size(self) -> int:
        """Total number of workers over all nodes."""
        return self.nnodes * self.nproc_per_node

    @property
    def local_rendezvous(self) -> bool:
        """True when no ``--master``/``--ips`` was given: everything on loopback."""
        return self.master_addr is None


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), which workers inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive_int(flag: str, value: int, minimum: int) -> int:
    if value < minimum:
        raise UsageError(f"{flag} {value!r} is invalid: it must be an integer >= {minimum}.")
    return value


def _parse_gpu_ids(text: str) -> list[int]:
    items = text.split(",")
    ids = []
    for item in items:
        if not item.strip().isdigit():
            raise UsageError(
                f"--gpus {text!r} is invalid: expected comma-separated GPU ids "
                f"such as '0,1,2,3', got {item!r}."
            )
        ids.append(int(item.strip()))
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise UsageError(
            f"--gpus {text!r} lists GPU {duplicates[0]} more than once; give each id once."
        )
    return ids


def _visible_gpu_count() -> int:
    import torch  # deferred: only --gpus needs it, and it is slow to import

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _resolve_gpus(
    text: str, environ: Mapping[str, str], gpu_count: Callable[[], int]
) -> tuple[str, ...]:
    """Map ``--gpus`` ids (indices into what is visible) to device entries."""
    ids = _parse_gpu_ids(text)
    count = gpu_count()
    if count == 0:
        raise UsageError(
            f"--gpus {text!r}: no CUDA GPU is visible on this machine "
            f"(torch.cuda.is_available() is False). To run CPU workers, use "
            f"--nproc_per_node {len(ids)} instead of --gpus."
        )
    unseen = [i for i in ids if i >= count]
    if unseen:
        where = environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={where!r})" if where is not None else ""
        raise UsageError(
            f"--gpus {text!r}: GPU {unseen[0]} is not visible; this process sees "
            f"{count} GPU(s), ids 0 to {count - 1}{hint}."
        )
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return tuple(str(i) for i in ids)
    entries = [e.strip() for e in visible.split(",")]
    return tuple(entries[i] for i in ids)


def _parse_master(text: str) -> tuple[str, int]:
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    fix = "Use --master HOST:PORT, e.g. --master 10.0.0.1:29500."
    if not sep or not host or not port_text:
        raise UsageError(f"--master {text!r} is malformed: expected HOST:PORT. {fix}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UsageError(
            f"--master {text!r} has port {port_text!r}: it must be an integer "
            f"from 1 to 65535. {fix}"
        )
    if not _valid_host(host):
        raise UsageError(f"--master {text!r} has an invalid host {host!r}. {fix}")
    return host, int(port_text)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOST_NAME.match(host)) and len(host) <= 253


def _is_this_host(host: str) -> bool:
    """True when ``host`` names an address of this machine.

    Binding a socket (without listening) succeeds only for local addresses,
    which avoids listing interfaces.
    """
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0) + tuple(sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def _resolve_ips(args: argparse.Namespace) -> tuple[int, int, str, int]:
    """``--ips`` to (nnodes, node_rank, master host, master port)."""
    ips = [h.strip() for h in args.ips.split(",")]
    bad = [h for h in ips if not _valid_host(h)]
    if bad:
        raise UsageError(
            f"--ips {args.ips!r} has an invalid host {bad[0]!r}: expected "
            f"comma-separated host names or addresses, e.g. --ips 10.0.0.1,10.0.0.2."
        )
    if len(set(ips)) != len(ips):
        raise UsageError(f"--ips {args.ips!r} lists a host more than once.")
    if args.nnodes is not None and args.nnodes != len(ips):
        raise UsageError(
            f"--nnodes {args.nnodes!r} conflicts with --ips {args.ips!r}, which "
            f"names {len(ips)} node(s); drop --nnodes."
        )
    host, port = ips[0], DEFAULT_MASTER_PORT
    if args.master is not None:
        host, port = _parse_master(args.master)
        if host != ips[0]:
            raise UsageError(
                f"--master {args.master!r} conflicts with --ips {args.ips!r}: "
                f"the master is the first host of --ips ({ips[0]!r})."
            )
    if args.node_rank is not None:
        node_rank = args.node_rank
    else:
        mine = [i for i, h in enumerate(ips) if _is_this_host(h)]
        if len(mine) != 1:
            found = "none" if not mine else f"several ({[ips[i] for i in mine]})"
            raise UsageError(
                f"--ips {args.ips!r}: cannot tell which entry is this host "
                f"({socket.gethostname()!r}); {found} matched. Pass --node_rank."
            )
        node_rank = mine[0]
    return len(ips), node_rank, host, port


def _resolve_nodes(args: argparse.Namespace) -> tuple[int, int, str | None, int | None]:
    if args.ips is not None:
        nnodes, node_rank, host, port = _resolve_ips(args)
    else:
        nnodes = _positive_int("--nnodes", args.nnodes if args.nnodes is not None else 1, 1)
        node_rank = args.node_rank if args.node_rank is not None else 0
        host, port = _parse_master(args.master) if args.master is not None else (None, None)
        if nnodes > 1 and host is None:
            raise UsageError(
                f"--nnodes {nnodes!r} needs a rendezvous address: add "
                f"--master HOST:PORT (the host of node rank 0) or --ips h1,h2,..."
            )
    if not 0 <= node_rank < nnodes:
        raise UsageError(
            f"--node_rank {node_rank!r} is out of range: with {nnodes} node(s) it "
            f"must be from 0 to {nnodes - 1}."
        )
    if host is not None:
        given = f"--ips {args.ips!r}" if args.ips is not None else f"--master {args.master!r}"
        _check_master_host(given, host, node_rank)
    return nnodes, node_rank, host, port


def _check_master_host(given: str, host: str, node_rank: int) -> None:
    """The master must resolve, and node rank 0 (which hosts the store) must be it."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise UsageError(
            f"{given}: the master host {host!r} cannot be resolved to an address; "
            f"check the name or give an IP address."
        ) from None
    if node_rank == 0 and not _is_this_host(host):
        raise UsageError(
            f"{given}: node rank 0 hosts the rendezvous, but the master {host!r} is "
            f"not an address of this host ({socket.gethostname()!r}). Run node rank 0 "
            f"on {host!r}, or pass this node's --node_rank."
        )


def _check_oversubscription(nproc: int, cpus: int, allowed: bool) -> None:
    """Refuse far more workers than CPUs unless ``--allow_oversubscribe`` was given."""
    limit = WORKERS_PER_CPU * cpus
    if nproc > limit and not allowed:
        raise UsageError(
            f"--nproc_per_node {nproc!r} is more than {WORKERS_PER_CPU} workers per CPU: "
            f"this host has {cpus} CPU(s), so at most {limit} workers start without "
            f"--allow_oversubscribe. Use --nproc_per_node {cpus} (one per CPU), "
            f"or add --allow_oversubscribe if you really want {nproc} processes here."
        )


def _resolve_workers(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    gpu_count: Callable[[], int],
    cpu_count: Callable[[], int],
) -> tuple[int, tuple[str, ...] | None]:
    gpus = None
    if args.gpus is not None:
        # Check the conflict first: it is a mistake whatever the hardware.
        wanted = len(_parse_gpu_ids(args.gpus))
        if args.nproc_per_node is not None and args.nproc_per_node != wanted:
            raise UsageError(
                f"--gpus {args.gpus!r} starts one worker per GPU ({wanted}), which "
                f"conflicts with --nproc_per_node {args.nproc_per_node!r}; use only one of them."
            )
        gpus = _resolve_gpus(args.gpus, environ, gpu_count)
        return len(gpus), gpus
    nproc = args.nproc_per_node if args.nproc_per_node is not None else 1
    _positive_int("--nproc_per_node", nproc, 1)
    # --gpus needs no such check: it starts one worker per distinct visible GPU.
    _check_oversubscription(nproc, cpu_count(), args.allow_oversubscribe)
    return nproc, gpus


def _parse_tee(text: str, world_size: int) -> frozenset[int]:
    if text.strip().lower() == "all":
        return frozenset(range(world_size))
    if text.strip().lower() == "none":
        return frozenset()
    ranks = set()
    for item in text.split(","):
        if not item.strip().isdigit():
            raise UsageError(
                f"--tee {text!r} is invalid: expected 'all', 'none' or "
                f"comma-separated ranks such as '0,1', got {item!r}."
            )
        ranks.add(int(item.strip()))
    too_big = sorted(r for r in ranks if r >= world_size)
    if too_big:
        raise UsageError(
            f"--tee {text!r} names rank {too_big[0]}, but the world size is "
            f"{world_size} (ranks 0 to {world_size - 1})."
        )
    return frozenset(ranks)


def _resolve_command(args: argparse.Namespace) -> tuple[str, ...]:
    target, rest = args.script, list(args.script_args)
    if args.module:
        if target is None:
            raise UsageError("-m needs a module name, e.g. distrun -m package.train --lr 0.1.")
        spec = _find_module(target) if _MODULE_NAME.match(target) else None
        if spec is None:
            raise UsageError(
                f"-m {target!r}: no module of that name can be imported here; "
                f"check the name and that its package is installed or on PYTHONPATH."
            )
        source = _module_source(target, spec)
        if source is not None:
            _check_compiles(source, f"-m {target!r}")
        return ("-m", target, *rest)
    if target is None:
        raise UsageError(
            "missing the training script: usage is distrun [options] SCRIPT [ARGS...] "
            "or distrun [options] -m MODULE [ARGS...]."
        )
    if not os.path.isfile(target):
        what = "is a directory" if os.path.isdir(target) else "does not exist"
        raise UsageError(
            f"training script {target!r} {what} (looked from {os.getcwd()!r}); "
            f"give the path of a Python file, or use -m MODULE to run a module."
        )
    _check_compiles(target, f"training script {target!r}")
    return (target, *rest)


def _check_compiles(path: str, what: str) -> None:
    """Byte-compile ``path`` so a syntax error stops the launch before any worker starts.

    Every worker would otherwise fail the same way after the rendezvous, and
    the report would name only one of them.
    """
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise UsageError(f"{what} cannot be read: {exc.strerror}.") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings are the worker's to print
            compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{exc.filename or path}, line {exc.lineno}" if exc.lineno else (exc.filename or path)
        code = f": {exc.text.strip()!r}" if exc.text and exc.text.strip() else ""
        raise UsageError(
            f"{what} has a syntax error ({where}{code}): {exc.msg}. Fix it and run "
            f"distrun again; no worker was started."
        ) from None
    except ValueError as exc:  # e.g. null bytes on Python < 3.12
        raise UsageError(f"{what} cannot be compiled: {exc}; no worker was started.") from None


def _check_log_dir(log_dir: str) -> str:
    """Refuse a log directory that cannot be created or written, creating nothing."""
    fix = "choose another directory with --log_dir."
    if not log_dir or "\0" in log_dir:
        raise UsageError(f"--log_dir {log_dir!r} is not a valid directory path; {fix}")
    path = os.path.abspath(log_dir)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path):
        raise UsageError(f"--log_dir {log_dir!r}: {path!r} exists and is not a directory; {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--log_dir {log_dir!r}: {path!r} is not writable; {fix}")
    return log_dir


def _find_module(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec ``python -m name`` would run from here, found without importing anything.

    ``importlib.util.find_spec`` would import (run) the parent packages of a
    dotted name, so the path is walked one package at a time. The worker
    runs ``python -m`` from this directory, which puts it first on
    ``sys.path``; distrun's own ``sys.path`` does not have it. Returns
    ``None`` when the top-level package cannot be found; a submodule that
    cannot be found this way (a package that extends ``__path__`` at
    import time) yields the deepest package found.
    """
    parts = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd()])
    if spec is None:
        spec = importlib.util.find_spec(parts[0])
    if spec is None:
        return None
    for i in range(1, len(parts)):
        if spec.submodule_search_locations is None:
            return None  # a plain module has no submodules
        child = importlib.machinery.PathFinder.find_spec(
            ".".join(parts[: i + 1]), list(spec.submodule_search_locations)
        )
        if child is None:
            return spec
        spec = child
    return spec


def _module_source(name: str, spec: importlib.machinery.ModuleSpec) -> str | None:
    """The ``.py`` file ``python -m name`` runs, or ``None`` when it is not a known source file."""
    if spec.name != name:
        return None  # only a parent package was found: nothing certain to compile
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        spec = importlib.machinery.PathFinder.find_spec(
            f"{name}.__main__", list(spec.submodule_search_locations)
        )
        if spec is None:
            return None
    origin = spec.origin if spec.has_location else None
    return origin if origin is not None and origin.endswith(".py") else None


def build_plan(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    gpu_count: Callable[[], int] = _visible_gpu_count,
    cpu_count: Callable[[], int] = available_cpus,
) -> LaunchPlan:
    """Validate parsed arguments into a :class:`LaunchPlan`.

    Args:
        args: the namespace from :func:`distamp.launcher.cli.build_parser`.
        environ: environment to read ``CUDA_VISIBLE_DEVICES`` from
            (default ``os.environ``).
        gpu_count: how many CUDA devices this process sees (injectable so
            tests can check GPU validation on a machine without GPUs).
        cpu_count: how many CPUs the workers may run on (injectable so tests
            can check the oversubscription limit for any host).

    Raises:
        UsageError: on any bad input, with a message naming the flag.
    """
    environ = os.environ if environ is None else environ
    nnodes, node_rank, host, port = _resolve_nodes(args)
    nproc, gpus = _resolve_workers(args, environ, gpu_count, cpu_count)
    max_restarts = _positive_int("--max_restarts", args.max_restarts, 0)
    grace = _positive_int("--grace_period", args.grace_period, 1)
    tee = _parse_tee(args.tee, nnodes * nproc)
    log_dir = _check_log_dir(args.log_dir)
    command = _resolve_command(args)
    return LaunchPlan(
        command=command,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=host,
        master_port=port,
        gpus=gpus,
        log_dir=log_dir,
        tee=tee,
        max_restarts=max_restarts,
        grace_period=grace,
    )
