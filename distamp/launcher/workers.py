"""``--nproc_per_node`` and ``--gpus``: how many workers this node starts, and on which GPUs."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

from distamp.launcher.usage import UsageError, at_least

__all__ = ["WORKERS_PER_CPU", "available_cpus", "resolve_workers", "visible_gpu_count"]

#: Most workers per CPU that ``--nproc_per_node`` may ask for without
#: ``--allow_oversubscribe``. Beyond that every worker (a Python process with
#: torch loaded, its threads and its log file) competes for a sliver of a
#: core; a typo such as 100000 used to exhaust the host's memory.
WORKERS_PER_CPU = 4


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask), which workers inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def visible_gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch  # deferred: only --gpus needs it, and it is slow to import

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_workers(
    args: argparse.Namespace,
    environ: Mapping[str, str],
    gpu_count: Callable[[], int],
    cpu_count: Callable[[], int],
) -> tuple[int, tuple[str, ...] | None]:
    """Workers per node and the ``CUDA_VISIBLE_DEVICES`` entry of each (``None`` without ``--gpus``)."""
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
    at_least("--nproc_per_node", nproc, 1)
    # --gpus needs no such check: it starts one worker per distinct visible GPU.
    _check_oversubscription(nproc, cpu_count(), args.allow_oversubscribe)
    return nproc, gpus


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


def _parse_gpu_ids(text: str) -> list[int]:
    items = text.split(",")
    ids = []
    for item in items:
        if not (item.strip().isascii() and item.strip().isdigit()):  # isdigit() alone takes '²'
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
