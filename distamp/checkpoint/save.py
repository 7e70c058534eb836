"""``save_checkpoint``: every rank writes its own part (if sharded), rank 0 writes and commits, all return together."""

from __future__ import annotations

import logging
import numbers
import os
import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from distamp.distributed.process_group import validate_timeout
from distamp.model_views import unwrap_model
from distamp.optim.optimizer import AmpOptimizer

from . import dcp_tensors, flat_state, param_names, rng, storage
from .atomic import sha256_of
from .collective import Coordinator
from .manifest import COMMON, Manifest, PayloadFile, dcp_directory_name, dcp_part, rank_part
from .state import (
    build_payload,
    build_shard_payload,
    check_extra,
    check_objects,
    check_plain,
    model_state,
)

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

    Collective: call it on every rank (it gathers each rank's RNG states;
    with ``overlap_param_gather`` it finishes, on every rank, the parameter
    gather of every optimizer attached to the model, not only ``optimizer``'s).
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

    What is saved: ``model.state_dict()`` (of the module inside
    ``fleet.distributed_model``, DDP and ``torch.compile`` wrappers: a
    module whose one child is ``.module`` or ``._orig_mod`` and which has no
    parameters of its own; a model's own child called ``module`` is saved
    as part of it), ``optimizer.state_dict()`` (for distamp's
    AmpOptimizer: inner state, FP32 masters, loss scaler and counters),
    ``scheduler.state_dict()``, the RNG states of every rank (Python
    ``random``, NumPy, torch CPU and the rank's current CUDA device) and
    ``extra``; and the name, shape and param group of each parameter the
    optimizer state numbers, by which a load renumbers that state for a
    model that lists its parameters in another order.

    With ``strategy.sharding`` each rank also writes its slice of the
    optimizer state (FP32 masters and per-element state of its range of the
    flat parameter space, with the range recorded) as its own part
    ``rank-<R>``; nothing is gathered to rank 0, and the one manifest that
    rank 0 commits lists every part. Any world size, sharded or not, can
    load it (see :func:`~distamp.checkpoint.load_latest_checkpoint`).
    With sharding stage 3 (FSDP2) the DTensors (the model's FP32
    parameters, which are the O2 masters too, and the optimizer's
    per-element state) go through ``torch.distributed.checkpoint``: each
    rank writes its own shards into the save's DCP directory, and every file
    there is listed in the manifest. The common part holds the buffers, the
    scaler and the rest of the optimizer state. Nothing is gathered: no rank
    holds a whole parameter at any point of the save. Any world size and
    stage loads it.

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
    wait = validate_timeout(timeout)
    check_objects(model, optimizer, scheduler)
    if isinstance(optimizer, AmpOptimizer) and optimizer.merge.is_accumulating:
        merge = optimizer.merge
        raise ValueError(
            f"save_checkpoint(step={step}) inside a gradient-merge window: {merge.micro_steps} of its "
            f"{merge.k_steps} micro-batches are accumulated in the gradients, which a checkpoint does not hold, so "
            "a resume would apply the window without them. Save after the optimizer.step() that completes the "
            "window (it returns True or False instead of accumulating)"
        )
    extra = check_extra(extra)
    # Checked on every rank (the states are replicated), so all raise alike.
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    # Stage 3: the DTensors go to DCP, each rank writing its own shards; the rest to the common part.
    fully_sharded = dcp_tensors.split(unwrap_model(model), optimizer) if isinstance(optimizer, AmpOptimizer) else None
    tensors: dict = {}
    if fully_sharded is not None:
        model_entries, optimizer_state, tensors = fully_sharded
        shard = None
    else:
        # On every rank, before rank 0 builds the payload alone: it finishes every attached optimizer's gather.
        model_entries = model_state(model)
        local = optimizer.local_state_dict() if isinstance(optimizer, AmpOptimizer) else optimizer.state_dict()
        optimizer_state, shard = flat_state.split(local)
    names = param_names.record(model, optimizer)
    check_plain(optimizer_state, "optimizer.state_dict()")
    check_plain(shard, "optimizer.state_dict()")
    check_plain(scheduler_state, "scheduler.state_dict()")

    coordinator = Coordinator(f"save step {step}", wait)
    dcp_directory = None
    part: tuple[Any, ...] | None
    if fully_sharded is not None:
        nonce = coordinator.broadcast(secrets.token_hex(8) if coordinator.rank == 0 else None)
        dcp_directory = dcp_directory_name(step, nonce)
        part = _write_dcp(path, dcp_directory, tensors, coordinator.rank, coordinator.world_size)
    else:
        part = _write_part(path, step, coordinator.rank, shard) if shard is not None else None
    gathered = coordinator.gather((rng.get_rng_state(), part))
    outcome, failure = None, None
    if coordinator.rank == 0:
        assert gathered is not None, "rank 0 gets every rank's value"
        try:
            parts = _part_files(gathered)
            payload = build_payload(step, coordinator.world_size, model, type(optimizer).__name__,
                                    optimizer_state, scheduler_state, [g[0] for g in gathered], extra,
                                    model_state_dict=model_entries, dcp_directory=dcp_directory,
                                    scheduler_type=type(scheduler).__name__ if scheduler is not None else None,
                                    parameter_names=names)
            outcome = ("saved", _write(path, step, payload, keep, parts))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            outcome, failure = ("failed", f"{type(exc).__name__}: {exc}"), exc
            if dcp_directory is not None:  # before any rank hears of the failure: none sees the files after
                storage.discard(path, step, [dcp_directory])
    kind, detail = coordinator.broadcast(outcome)
    coordinator.finish()
    if kind == "failed":
        if part is not None and part[0] == "ok" and dcp_directory is None:
            storage.discard(path, step, [part[1][1]])
        raise RuntimeError(f"rank 0 could not save checkpoint {step} in {path!r}: {detail}") from failure
    return os.path.join(path, detail)


def _write_part(path: str, step: int, rank: int, shard: dict) -> tuple[str, Any]:
    """Write this rank's part (its optimizer slice); ``("ok", (part, name, size, sha256))`` or ``("failed", why)``."""
    try:
        os.makedirs(path, exist_ok=True)
        payload = build_shard_payload(step, rank, shard)
        written = storage.write_payload(path, step, rank_part(rank), lambda f: torch.save(payload, f))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the save everywhere
        return "failed", f"rank {rank} could not write its part: {type(exc).__name__}: {exc}"
    return "ok", (written.part, written.name, written.size, written.sha256)


def _write_dcp(path: str, directory: str, tensors: dict, rank: int, world_size: int) -> tuple[Any, ...]:
    """Write the stage-3 tensors through DCP into ``directory`` (collective), then hash this rank's share of the
    files there; ``("dcp", [(name, size, sha256), ...], every name it sees)`` or ``("failed", why)``.

    The files are hashed by every rank in turn (file ``i`` by rank ``i % world_size``), so no rank reads the
    whole checkpoint back.
    """
    where = os.path.join(path, directory)
    try:
        dcp_tensors.write(tensors, where)
        names = sorted(os.listdir(where))
        hashed = []
        for name in names[rank::world_size]:
            sha, size = sha256_of(os.path.join(where, name))
            hashed.append((f"{directory}/{name}", size, sha))
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the save everywhere
        return "failed", f"rank {rank} could not write its DCP shards: {type(exc).__name__}: {exc}"
    return "dcp", hashed, names  # what it saw: every rank must see the same files


def _part_files(gathered: list[tuple[dict, Any]]) -> list[PayloadFile]:
    """The ranks' shard files (rank order), or the DCP files (name order); raises when one failed or the ranks
    disagree on sharding."""
    parts = [g[1] for g in gathered]
    failed = [p[1] for p in parts if p is not None and p[0] == "failed"]
    if failed:
        raise RuntimeError("; ".join(failed))
    if any(p is None for p in parts) and any(p is not None for p in parts):
        sharded = [r for r, p in enumerate(parts) if p is not None]
        raise RuntimeError(f"only ranks {sharded} have sharded state; every rank must use the same strategy")
    if parts and parts[0] is not None and parts[0][0] == "dcp":
        seen = [p[2] for p in parts]
        if any(names != seen[0] for names in seen):
            differ = next(r for r, names in enumerate(seen) if names != seen[0])
            raise RuntimeError(
                f"rank {differ} sees the DCP files {seen[differ]}, rank 0 {seen[0]}: the ranks do not write into one "
                "directory. On several nodes the checkpoint directory must be on a file system shared by every node"
            )
        files = sorted(f for p in parts for f in p[1])
        return [PayloadFile(dcp_part(i), name, size, sha) for i, (name, size, sha) in enumerate(files)]
    return [PayloadFile(*p[1]) for p in parts if p is not None]


def _check_count(value: Any, name: str, minimum: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}{why}")
    return int(value)


def _write(directory: str, step: int, payload: dict, keep: int, parts: list[PayloadFile]) -> str:
    """Write the common payload, commit checkpoint ``step`` with it and ``parts``, rotate; returns its name.

    A failure before the commit removes the payload it wrote (a full disk
    stays no fuller) and leaves every committed checkpoint as it was.
    """
    os.makedirs(directory, exist_ok=True)
    written: list[str] = []
    try:
        common = storage.write_payload(directory, step, COMMON, lambda f: torch.save(payload, f))
        written.append(common.name)
        files = (common, *parts)
        storage.commit(directory, Manifest(step=step, world_size=payload["world_size"], files=files))
    except BaseException:
        storage.discard(directory, step, written)
        raise
    try:
        storage.rotate(directory, step, keep)
    except OSError as exc:
        # The checkpoint is committed; failing the save now would report a loss that did not happen.
        logger.warning("checkpoint %d saved, but removing old files in %s failed: %s", step, directory, exc)
    return common.name
