"""Validate parsed ``distrun`` arguments into a :class:`LaunchPlan`.

Every check that can fail runs before any process or rendezvous starts. A
failed check raises :class:`UsageError` whose message quotes the flag and
the value and says how to fix it; ``distrun`` prints it and exits with code
2. The checks live with what they check: :mod:`~distamp.launcher.nodes`
(nodes and rendezvous), :mod:`~distamp.launcher.workers` (workers and
GPUs), :mod:`~distamp.launcher.command` (the script or module); this module
checks the rest (``--tee``, ``--log_dir``, restarts) and builds the plan.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from distamp.launcher.command import resolve_command
from distamp.launcher.nodes import DEFAULT_MASTER_PORT, resolve_nodes
from distamp.launcher.usage import UsageError, at_least
from distamp.launcher.workers import (
    WORKERS_PER_CPU,
    available_cpus,
    resolve_workers,
    visible_gpu_count,
)
from distamp.torch_compat import TORCH_DEFAULT_GRACE_PERIOD, grace_period_supported

__all__ = [
    "DEFAULT_MASTER_PORT", "WORKERS_PER_CPU", "LaunchPlan", "UsageError", "available_cpus",
    "build_plan",
]


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
    tee: frozenset[int] | None = frozenset({0})
    """Global ranks whose output is also printed on the console; ``None`` for every rank (``--tee all``)."""
    max_restarts: int = 0
    """Times a failed worker group is restarted."""
    grace_period: int = 30
    """Seconds workers get to exit after distrun forwards SIGINT/SIGTERM,
    before SIGKILL (torch's agent uses a fixed 30 s after a worker failure)."""

    @property
    def world_size(self) -> int | None:
        """Total number of workers: known before the rendezvous on one node only.

        ``None`` with several nodes: each node may run its own
        ``--nproc_per_node`` (as with torchrun), and the rendezvous adds them up.
        """
        return self.nproc_per_node if self.nnodes == 1 else None

    @property
    def local_rendezvous(self) -> bool:
        """True when no ``--master``/``--ips`` was given: everything on loopback."""
        return self.master_addr is None


def _parse_tee(text: str, world_size: int | None) -> frozenset[int] | None:
    if text.strip().lower() == "all":
        return None
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
    if world_size is None:  # several nodes: checked once the rendezvous has set the world size
        return frozenset(ranks)
    too_big = sorted(r for r in ranks if r >= world_size)
    if too_big:
        raise UsageError(
            f"--tee {text!r} names rank {too_big[0]}, but the world size is "
            f"{world_size} (ranks 0 to {world_size - 1})."
        )
    return frozenset(ranks)


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


def build_plan(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    gpu_count: Callable[[], int] = visible_gpu_count,
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
    nnodes, node_rank, host, port = resolve_nodes(args)
    nproc, gpus = resolve_workers(args, environ, gpu_count, cpu_count)
    max_restarts = at_least("--max_restarts", args.max_restarts, 0)
    grace = at_least("--grace_period", args.grace_period, 1)
    if grace != TORCH_DEFAULT_GRACE_PERIOD and not grace_period_supported():
        raise UsageError(
            f"--grace_period {grace}: torch {torch.__version__}'s elastic agent always gives the workers "
            f"{TORCH_DEFAULT_GRACE_PERIOD} seconds (a grace period can be set from torch 2.12 on); "
            f"leave --grace_period out or upgrade torch"
        )
    tee = _parse_tee(args.tee, nproc if nnodes == 1 else None)
    log_dir = _check_log_dir(args.log_dir)
    command = resolve_command(args)
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
