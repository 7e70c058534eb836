"""``save_checkpoint``: every rank hands over its state, rank 0 writes and commits, all return together."""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from . import rng, storage
from .collective import Coordinator, check_timeout
from .manifest import COMMON, Manifest
from .state import build_payload, check_extra, check_objects, check_plain

__all__ = ["save_checkpoint"]

logger = logging.getLogger("distamp")


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
    timeout: float | timedelta | None = None,
) -> str:
    """Save checkpoint ``step`` atomically and keep only the newest ``keep``.

    Collective: call it on every rank (it gathers each rank's RNG states).
    Rank 0 writes the payload under a new name, then commits it by renaming
    the manifest ``step-<step>.json`` into place (temporary file, fsync,
    rename, directory fsync), then deletes older checkpoints beyond
    ``keep``, any with a step greater than ``step`` (left by a run that was
    resumed from an earlier one) and what the new manifest replaced. Every
    rank returns only once the checkpoint is durable, and raises the same
    ``RuntimeError`` if rank 0 could not write it; a failed save removes
    what it wrote and leaves the previous checkpoints as they were.

    The other ranks wait for rank 0 on the process group's store, not in a
    collective, so a slow write does not run into the process group's
    timeout (NCCL's default is 10 minutes); ``timeout`` bounds that wait.

    What is saved: ``model.state_dict()`` (of the module inside a
    DataParallel/DDP wrapper), ``optimizer.state_dict()`` (for distamp's
    AmpOptimizer: inner state, FP32 masters, loss scaler and counters),
    ``scheduler.state_dict()``, the RNG states of every rank (Python
    ``random``, NumPy, torch CPU and the rank's current CUDA device) and
    ``extra``.

    Example::

        save_checkpoint("ckpt", step, model=model, optimizer=optimizer,
                        scheduler=scheduler, extra={"epoch": epoch, "batch": i + 1})

    Args:
        directory: where checkpoints live; created if missing. On several
            nodes it must be a shared file system.
        step: the step number (int >= 0) to save under, e.g. optimizer
            steps done so far.
        model: the model (wrapped or not).
        optimizer: the optimizer, usually ``fleet.distributed_optimizer``'s.
        scheduler: an LR scheduler, or None.
        extra: the caller's data position and anything else to restore:
            a dict of None/bool/int/float/str/bytes/tensors and
            lists/tuples/dicts of them.
        keep: how many complete checkpoints to keep (>= 1).
        timeout: how long a rank waits for the others, in seconds or as a
            ``datetime.timedelta``; None means 30 minutes.

    Returns:
        The path of the payload file (on every rank).
    """
    path = storage.check_directory(directory)
    step = _check_count(step, "step", 0, "")
    keep = _check_count(keep, "keep", 1, ": the newest checkpoint is always kept")
    wait = check_timeout(timeout)
    check_objects(model, optimizer, scheduler)
    extra = check_extra(extra)
    # Checked on every rank (the states are replicated), so all raise alike.
    optimizer_state = optimizer.state_dict()
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    check_plain(optimizer_state, "optimizer.state_dict()")
    check_plain(scheduler_state, "scheduler.state_dict()")

    coordinator = Coordinator(f"save step {step}", wait)
    rng_states = coordinator.gather(rng.get_rng_state())
    outcome, failure = None, None
    if coordinator.rank == 0:
        try:
            payload = build_payload(step, coordinator.world_size, model, type(optimizer).__name__,
                                    optimizer_state, scheduler_state, rng_states, extra)
            outcome = ("saved", _write(path, step, payload, keep))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            outcome, failure = ("failed", f"{type(exc).__name__}: {exc}"), exc
    kind, detail = coordinator.broadcast(outcome)
    if kind == "failed":
        raise RuntimeError(f"rank 0 could not save checkpoint {step} in {path!r}: {detail}") from failure
    return os.path.join(path, detail)


def _check_count(value: Any, name: str, minimum: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}{why}")
    return int(value)


def _write(directory: str, step: int, payload: dict, keep: int) -> str:
    """Write and commit checkpoint ``step``, then rotate; returns the payload's file name.

    A failure before the commit removes the payload it wrote (a full disk
    stays no fuller) and leaves every committed checkpoint as it was.
    """
    os.makedirs(directory, exist_ok=True)
    written: list[str] = []
    try:
        common = storage.write_payload(directory, step, COMMON, lambda f: torch.save(payload, f))
        written.append(common.name)
        storage.commit(directory, Manifest(step=step, world_size=payload["world_size"], files=(common,)))
    except BaseException:
        storage.discard(directory, step, written)
        raise
    try:
        storage.rotate(directory, step, keep)
    except OSError as exc:
        # The checkpoint is committed; failing the save now would report a loss that did not happen.
        logger.warning("checkpoint %d saved, but removing old files in %s failed: %s", step, directory, exc)
    return common.name
