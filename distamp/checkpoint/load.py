"""``load_latest_checkpoint``: the ranks agree on the newest usable checkpoint and restore it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from distamp.distributed.process_group import validate_timeout
from distamp.model_views import unwrap_model
from distamp.optim.optimizer import AmpOptimizer
from distamp.optim.state import check_optimizer_state
from distamp.user_warning import warn_user

from . import dcp_tensors, flat_state, model_shards, param_names, rng, storage
from .collective import Coordinator
from .manifest import COMMON, CheckpointCorrupt, Manifest, manifest_name, rank_part
from .state import (
    UnusablePayload,
    apply_restore,
    check_fits,
    check_model_fits,
    check_objects,
    check_payload,
    check_shard_payload,
    prepare_restore,
    restore_from_dcp,
)

__all__ = ["CheckpointInfo", "load_latest_checkpoint"]


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_latest_checkpoint` loaded.

    Attributes:
        step: the step number the checkpoint was saved with.
        path: the payload file (``.../step-<N>.common.<hash>.pt``).
        extra: the caller's ``extra`` dict (data position, seeds, ...).
        world_size: the number of ranks of the job that saved it.
        rng_restored: True when every RNG state this rank draws from was
            restored: the world size is unchanged and, where CUDA is used,
            the checkpoint has this rank's CUDA state and a CUDA device is
            here to take it. False otherwise (a warning says which).
        skipped: why each newer checkpoint was passed over (file and reason).
        manifest: the manifest file (``.../step-<N>.json``).
    """

    step: int
    path: str
    extra: dict = field(default_factory=dict)
    world_size: int = 1
    rng_restored: bool = False
    skipped: tuple[str, ...] = ()
    manifest: str = ""


def load_latest_checkpoint(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    timeout: float | timedelta | None = None,
) -> CheckpointInfo | None:
    """Restore the newest usable checkpoint in ``directory`` on every rank.

    Collective: call it on every rank after building the model, the
    optimizer (``fleet.distributed_optimizer``) and the scheduler, before
    training. Each rank reads the newest checkpoint rank 0 lists: the
    manifest (with its own checksum), the payload's size and SHA-256, then
    ``torch.load(..., weights_only=True)`` to the CPU. The ranks then decide
    together, so all resume from the same one:

    - a checkpoint that cannot be read (no or damaged manifest, truncated
      or corrupted payload, one that ``weights_only`` refuses to unpickle)
      is skipped on every rank with a warning naming the file, the reason
      and the step passed over, in favour of the next older one; nothing
      else falls back (an intact manifest that lists no part its own common
      payload says was saved raises, as below);
    - one that reads but does not fit the model, optimizer or scheduler
      (shapes, parameter names, optimizer type, O1 vs O2) raises the same
      ``RuntimeError`` on every rank: falling back would silently train
      something else;
    - each rank verifies the files it reads (the manifest, the common
      payload, the shards overlapping its slice) and the verdicts are
      combined: a file found bad by one rank and read by no other (e.g. a
      damaged shard of rank 1) makes the checkpoint skipped by every rank,
      with one warning naming the file and the rank that found it; a file
      one rank finds bad and another verified intact raises on every rank
      instead (the ranks see different files: on several nodes, the
      directory must be shared).

    Sharded state (``strategy.sharding``): each rank reads, besides the
    common payload, only the ranks' parts that overlap what it holds (its
    slice of the flat parameter space at stages 1 and 2), and the state is
    re-sliced for its layout. A stage-3 checkpoint's tensors are read by
    ``torch.distributed.checkpoint`` (collective): into this rank's own
    shards when loading at stage 3, at any world size, so no rank holds a
    whole parameter; as whole tensors when loading at stages 0-2 or
    unsharded, which hold them whole anyway. So a checkpoint saved at any
    stage and world size loads at any stage and world size. DCP reads the
    tensors with ``weights_only=True`` but unpickles its ``.metadata`` file
    (after distamp checked its SHA-256 against the manifest): load stage-3
    checkpoints only from directories you trust.

    Parameter order: the model loads by name, and so does the optimizer
    state, which torch numbers by position: a model that lists the same
    parameters (names, shapes, param groups) in another order gets each
    one's own state (moments, FP32 masters), at any stage and world size;
    other names, shapes or group members raise, as above, naming the first
    that differ. Checkpoints saved without names (before they were
    recorded, or over tensors the model does not have) load by position.

    Different world size: model, optimizer, scheduler and ``extra`` are
    restored exactly (data parallelism keeps them identical on every rank),
    but the RNG states are not, since the saved per-rank streams do not map
    onto a different number of ranks; rank 0 warns once. Each rank keeps the
    RNG state it had, so seed before calling this. How the data order
    continues is the caller's business (e.g. a ``DistributedSampler``
    re-partitions each epoch over the new number of ranks).

    Example::

        info = load_latest_checkpoint("ckpt", model=model, optimizer=optimizer)
        start = info.step if info is not None else 0

    Args:
        directory: where :func:`save_checkpoint` saved.
        model: the model (wrapped or not).
        optimizer: the optimizer, built as in the saving run.
        scheduler: an LR scheduler, or None (as in the saving run).
        timeout: how long a rank waits for the others, in seconds or as a
            ``datetime.timedelta``; None means 30 minutes.

    Returns:
        A :class:`CheckpointInfo`, or None when there is no usable
        checkpoint (nothing to resume: start from scratch).

    Raises:
        RuntimeError: on every rank, when the checkpoint does not fit the
            model/optimizer, or some rank finds bad a file that another rank
            verified intact (e.g. a directory not shared between nodes).
    """
    path = storage.check_directory(directory)
    check_objects(model, optimizer, scheduler)
    target = flat_state.describe(optimizer)
    names = param_names.record(model, optimizer)
    coordinator = Coordinator("load", validate_timeout(timeout))
    candidates, failure = coordinator.broadcast(_list(path) if coordinator.rank == 0 else None)
    if failure is not None:
        coordinator.finish()
        raise RuntimeError(f"rank 0 could not list checkpoints in {path!r}: {failure}")
    manifest, payload, shards, skipped = _choose(coordinator, path, candidates, target, model, names)
    if manifest is None:
        coordinator.finish()
        if skipped:
            warn_user(f"no intact checkpoint in {path!r}; starting from scratch")
        return None

    payload_path = os.path.join(path, manifest.file(COMMON).name)
    if payload.get("dcp"):
        errors = _restore_dcp(coordinator, os.path.join(path, payload["dcp"]), payload, model, optimizer, scheduler)
    else:
        errors = _restore(coordinator, payload, model, optimizer, scheduler, shards)
    coordinator.finish()
    if errors:
        raise RuntimeError(f"could not resume from {payload_path}: " + "; ".join(errors))
    return CheckpointInfo(
        step=manifest.step,
        path=payload_path,
        extra=dict(payload["extra"]),
        world_size=int(payload["world_size"]),
        rng_restored=_restore_rng(payload, payload_path, coordinator),
        skipped=tuple(skipped),
        manifest=os.path.join(path, manifest_name(manifest.step)),
    )


def _collectively(coordinator: Coordinator, action: Any) -> list[str]:
    """Run ``action()`` on every rank; every rank's error message (the same list on all ranks)."""
    error = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - made collective below
        error = f"rank {coordinator.rank}: {type(exc).__name__}: {exc}"
    return coordinator.decide(error, lambda found: [e for e in found if e is not None])


def _restore(coordinator: Coordinator, payload: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any, shards: dict[int, dict]) -> list[str]:
    """Restore a checkpoint read whole by this rank; the errors, as for :func:`_collectively`.

    In two rounds: every rank first checks that the checkpoint fits its model and optimizer, and only if it fits
    on all does any rank load it, so a refused checkpoint leaves every rank's model and optimizer as they were.
    """
    prepared: list[tuple[dict, dict]] = []
    errors = _collectively(
        coordinator, lambda: prepared.append(prepare_restore(payload, model, optimizer, scheduler, shards))
    )
    if errors:
        return errors
    return _collectively(coordinator, lambda: apply_restore(prepared[0], payload, model, optimizer, scheduler))


def _restore_dcp(coordinator: Coordinator, directory: str, payload: dict, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any) -> list[str]:
    """Restore a checkpoint whose stage-3 tensors are in the DCP ``directory``; the errors, as for
    :func:`_collectively`.

    In two rounds: every rank first makes the tensors DCP reads into (checking the checkpoint fits), and only if
    all could, all enter ``dcp.load``, a collective no rank may skip.
    """
    tensors: dict[str, torch.Tensor] = {}

    def prepare() -> None:
        check_fits(payload, optimizer, scheduler)
        check_model_fits(payload["model"], unwrap_model(model))
        flat_state.check_fits(payload["optimizer"], flat_state.describe(optimizer))
        if isinstance(optimizer, AmpOptimizer):
            check_optimizer_state(optimizer, payload["optimizer"])
        tensors.update(dcp_tensors.targets(payload["model"], payload["optimizer"], unwrap_model(model), optimizer))

    errors = _collectively(coordinator, prepare)
    if errors:
        return errors

    def read_and_restore() -> None:
        dcp_tensors.read(tensors, directory)
        restore_from_dcp(payload, tensors, model, optimizer, scheduler)

    return _collectively(coordinator, read_and_restore)


def _list(path: str) -> tuple[list[int], str | None]:
    """Rank 0's candidates, newest first, and why they could not be listed (sent to every rank)."""
    try:
        return storage.list_checkpoints(path), None
    except OSError as exc:
        return [], f"{type(exc).__name__}: {exc}"


_Outcome = tuple[str, str | None, str | None, dict[str, str]]
"""One rank's reading of a checkpoint: ``(kind, message, the bad file's name, {name: SHA-256} of the files it
verified intact)``."""


def _choose(
    coordinator: Coordinator, path: str, candidates: list[int], target: flat_state.Target | None, model: nn.Module,
    names: dict | None,
) -> tuple[Manifest | None, Any, dict[int, dict], list[str]]:
    """The newest checkpoint every rank read intact: ``(manifest, payload, rank parts, skipped reasons)``.

    ``names``: the loading optimizer's parameters (:func:`~distamp.checkpoint.param_names.record`'s), by which
    the optimizer state is renumbered where the saving model listed them in another order.
    """
    skipped: list[str] = []
    for step in candidates:
        manifest: Manifest | None = None
        payload: Any = None
        shards: dict[int, dict] = {}
        intact: dict[str, str] = {}  # the files this rank verified: name in the directory -> SHA-256
        outcome: _Outcome = ("ok", None, None, intact)
        try:
            manifest, payload, shards = _read(path, step, target, model, names, intact, coordinator)
        except CheckpointCorrupt as exc:
            outcome = ("bad", str(exc), os.path.basename(exc.path), intact)
        except Exception as exc:  # noqa: BLE001 - made collective below
            outcome = ("error", f"{type(exc).__name__}: {exc}", None, intact)
        verdict, message = coordinator.decide(outcome, _verdict)
        if verdict == "use":
            return manifest, payload, shards, skipped
        if verdict == "skip":
            warn_user(f"skipping bad checkpoint {message}; step {step} is not resumed, falling back to an older one")
            skipped.append(message)
            continue
        coordinator.finish()
        raise RuntimeError(f"could not resume from {os.path.join(path, manifest_name(step))}: {message}")
    return None, None, {}, skipped


_UNSHARED = "On several nodes the checkpoint directory must be on a file system shared by every node"


def _verdict(outcomes: list[_Outcome]) -> tuple[str, str | None]:
    """Rank 0's decision on one checkpoint from every rank's outcome.

    Each rank verifies only the files it reads (the manifest, the common
    payload, the shards overlapping its slice), so a file one rank finds
    bad and no other rank read is a bad checkpoint, whichever rank it
    belongs to: skipped by all. Only a file that fails its size or checksum
    on one rank and passes them on another, or a file of one name intact
    with different contents on two ranks, shows that the ranks see
    different files (a file whose checksum matches everywhere but which
    ``torch.load`` refuses is the same bad file for all).
    """
    errors = [f"rank {r}: {message}" for r, (kind, message, _, _) in enumerate(outcomes) if kind == "error"]
    if errors:
        # Not a property of the file (out of memory, ...): falling back could discard good checkpoints.
        return "raise", "; ".join(errors)
    first: dict[str, tuple[int, str]] = {}  # name -> (the first rank that verified it, its SHA-256 there)
    for r, (_, _, _, intact) in enumerate(outcomes):
        for file, digest in intact.items():
            w, seen = first.setdefault(file, (r, digest))
            if seen != digest:  # two intact files of one name: each rank reads its own directory
                return "raise", (
                    f"rank {r} sees a different file than rank {w}: {file} has SHA-256 {digest[:12]}... on rank "
                    f"{r} and {seen[:12]}... on rank {w}, both intact. {_UNSHARED}"
                )
    bad = [(r, message, name) for r, (kind, message, name, _) in enumerate(outcomes) if kind == "bad"]
    for r, message, name in bad:
        if name in outcomes[r][3]:  # its checksum matched here too: the same bytes, refused when loaded
            continue
        witnesses = [w for w, (_, _, _, intact) in enumerate(outcomes) if name in intact]
        if witnesses:
            w = witnesses[0]
            return "raise", (
                f"rank {r} sees a different file than rank {w}, which read it intact: {message}. {_UNSHARED}"
            )
    if bad:
        r, message, _ = bad[0]
        return "skip", f"{message} (as rank {r} read it)"
    return "use", None


def _read(
    path: str, step: int, target: flat_state.Target | None, model: nn.Module, names: dict | None,
    intact: dict[str, str], coordinator: Coordinator,
) -> tuple[Manifest, dict, dict[int, dict]]:
    """Manifest, common payload and the rank parts this rank needs; ``CheckpointCorrupt`` if unusable.

    The optimizer state comes back numbered as the loading optimizer numbers its parameters
    (:mod:`~distamp.checkpoint.param_names`); ``ValueError`` when the names do not match.

    Each file verified goes into ``intact`` (name and SHA-256) as soon as its checksum matched. The DCP files of
    a stage-3 checkpoint are verified by the ranks in turn (file ``i`` by rank ``i % world size``): ``dcp.load``
    reads them later, each rank what its shards need.
    """
    manifest = storage.read_manifest(path, step)
    intact[manifest_name(step)] = hashlib.sha256(manifest.to_bytes()).hexdigest()  # of its content, canonical
    _verify(path, manifest, [COMMON], intact)
    payload = _load(path, manifest, COMMON, lambda p: check_payload(p, step))
    # ValueError when the parameter names do not match: raised on every rank, never skipped.
    renumber = param_names.order(payload.get(param_names.KEY), names)
    saved_layout = payload["optimizer"].get("sharding") if isinstance(payload["optimizer"], dict) else None
    if renumber is not None:
        payload = {**payload, "optimizer": param_names.reorder_common(payload["optimizer"], renumber)}
    if payload.get("dcp"):
        files = [f.part for f in manifest.files if f.part.startswith("dcp-")]
        if not files:
            raise ValueError(f"{os.path.join(path, manifest_name(step))} lists no DCP file, which its common "
                             "payload says was saved: the checkpoint is inconsistent as written, not damaged")
        _verify(path, manifest, files[coordinator.rank::coordinator.world_size], intact)
        return manifest, payload, {}
    # ValueError when it does not fit the optimizer: raised on every rank, never skipped.
    needed = sorted({*flat_state.parts_needed(payload["optimizer"], target, int(payload["world_size"])),
                     *model_shards.parts_needed(payload.get("model_shards"), unwrap_model(model))})
    _check_listed(path, manifest, needed)
    _verify(path, manifest, [rank_part(r) for r in needed], intact)
    parts = {r: _load(path, manifest, rank_part(r), lambda p, r=r: check_shard_payload(p, step, r)) for r in needed}
    if renumber is not None and saved_layout is not None:
        parts = {r: _renumbered(p, renumber, saved_layout["numels"]) for r, p in parts.items()}
    return manifest, payload, parts


def _renumbered(part: dict, renumber: list[int], saved_numels: list[int]) -> dict:
    """A rank part whose optimizer slice is renumbered (:func:`~distamp.checkpoint.param_names.reorder_part`)."""
    shard = part.get("optimizer_shard")
    if shard is None:
        return part
    return {**part, "optimizer_shard": param_names.reorder_part(shard, renumber, saved_numels)}


def _check_listed(path: str, manifest: Manifest, ranks: list[int]) -> None:
    """``ValueError`` when the intact manifest lists no part that its own common payload says a rank saved.

    Not damage on disk (the manifest passed its checksum): the checkpoint
    was written that way, and an older one would not repair that, so the
    load raises on every rank instead of skipping it.
    """
    names = {f.part for f in manifest.files}
    missing = [rank_part(r) for r in ranks if rank_part(r) not in names]
    if missing:
        raise ValueError(
            f"{os.path.join(path, manifest_name(manifest.step))} (step {manifest.step}, saved by "
            f"{manifest.world_size} rank(s)) lists no {', '.join(missing)} part, which its common payload "
            "says was saved: the checkpoint is inconsistent as written, not damaged; move it away to resume "
            "from an older one"
        )


def _verify(path: str, manifest: Manifest, parts: list[str], intact: dict[str, str]) -> None:
    """``storage.verify`` part by part, recording in ``intact`` the name and SHA-256 of each that passed."""
    for part in parts:
        storage.verify(path, manifest, [part])
        intact[manifest.file(part).name] = manifest.file(part).sha256


def _load(path: str, manifest: Manifest, part: str, check: Any) -> dict:
    """``torch.load(..., weights_only=True)`` of a verified part, then ``check(payload)``."""
    file = os.path.join(path, manifest.file(part).name)
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # any refusal makes the file unusable
        raise CheckpointCorrupt(file, f"torch.load(..., weights_only=True) refused it ({_gist(exc)})") from exc
    try:
        check(payload)
    except UnusablePayload as exc:
        raise CheckpointCorrupt(file, str(exc)) from exc
    return payload


def _gist(exc: Exception) -> str:
    """The informative line of torch.load's long messages."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split(". ")[0]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _restore_rng(payload: dict, payload_path: str, coordinator: Coordinator) -> bool:
    """Restore this rank's RNG states when the world size allows; True when all were."""
    saved_world, world_size = int(payload["world_size"]), coordinator.world_size
    if saved_world != world_size:
        if coordinator.rank == 0:
            warn_user(
                f"checkpoint {payload_path} was saved by {saved_world} rank(s) and is resumed by "
                f"{world_size}: model, optimizer, scheduler and extra are restored exactly, but the "
                "per-rank RNG states are not (each rank keeps its current ones), and the data order "
                "from here on differs from a run with the original world size"
            )
        return False
    missing = rng.set_rng_state(payload["rng"][coordinator.rank])
    if missing:
        warn_user(
            f"rank {coordinator.rank}: the {' and '.join(missing)} RNG state was not restored from "
            f"{payload_path}: for CUDA, either the checkpoint has a CUDA state and no CUDA device is "
            "available here, or this process uses CUDA and the checkpoint was saved without it. "
            "Random draws from it differ from the uninterrupted run"
        )
    return not missing
