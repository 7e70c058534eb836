"""Checkpoints that survive a killed job: atomic, verified, rotated, rank-consistent.

A training loop saves every N steps and resumes from the newest complete
checkpoint at start-up::

    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    model = Net().to(fleet.device())
    optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters()), strategy)
    model = fleet.distributed_model(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)

    info = load_latest_checkpoint("ckpt", model=model, optimizer=optimizer, scheduler=scheduler)
    step = info.step if info is not None else 0
    epoch = info.extra["epoch"] if info is not None else 0
    while step < total_steps:
        ...                                      # one training step
        step += 1
        if step % 100 == 0:                      # on every rank: it is collective
            save_checkpoint("ckpt", step, model=model, optimizer=optimizer,
                            scheduler=scheduler, extra={"epoch": epoch})

On disk, checkpoint ``N`` is two files: ``step-<N>.pt`` (everything, one
``torch.save``) and then ``step-<N>.json``, a small manifest with the
payload's size and SHA-256. Each is written to a temporary file in the same
directory, flushed, fsynced and renamed over its final name (``os.replace``),
and the directory is fsynced, so a final name never shows a partial file and
a checkpoint whose manifest exists is complete. Loading verifies the hash;
a truncated or corrupted newest checkpoint is skipped, with a warning naming
the file, in favour of the previous one.

Rank 0 writes; every rank reads, so on several nodes ``directory`` must be
on a file system every node sees (NFS, Lustre, ...). Both functions are
collective when ``torch.distributed`` is initialised: call them on every
rank, at the same point of the loop.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import numbers
import os
import random
import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CheckpointInfo", "list_checkpoints", "load_latest_checkpoint", "save_checkpoint"]

logger = logging.getLogger("distamp")

_FORMAT = "distamp.checkpoint/1"
_NAME = re.compile(r"^step-(\d{8,})\.(pt|json)$")
_TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_latest_checkpoint` loaded.

    Attributes:
        step: the step number the checkpoint was saved with.
        path: the payload file (``.../step-<N>.pt``).
        extra: the caller's ``extra`` dict (data position, seeds, ...).
        world_size: the number of ranks of the job that saved it.
        rng_restored: True when this rank's RNG states were restored (the
            world size is unchanged); False otherwise.
        skipped: newer checkpoint files that were found bad and passed over.
    """

    step: int
    path: str
    extra: dict = field(default_factory=dict)
    world_size: int = 1
    rng_restored: bool = False
    skipped: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- helpers


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (the value itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, ordered by rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _payload_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def _manifest_name(step: int) -> str:
    return f"step-{step:08d}.json"


def _fsync_dir(directory: str) -> None:
    # Makes the renames themselves durable (POSIX: a rename lives in the directory).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # e.g. platforms that cannot open directories
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the data files are synced
    finally:
        os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A write-only file object that hashes what passes through it."""

    def __init__(self, raw) -> None:
        super().__init__()
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            self._write_raw(view)
        except BaseException as exc:
            # torch's C++ writer replaces our exception with "unexpected pos";
            # keep it so the caller can report the real cause (e.g. disk full).
            self.error = exc
            raise
        self.sha256.update(view)
        self.size += view.nbytes
        return view.nbytes

    def _write_raw(self, view: memoryview) -> None:
        self._raw.write(view)

    def flush(self) -> None:
        self._raw.flush()


def _write_atomically(directory: str, name: str, write) -> tuple[str, int]:
    """Write a file with ``write(fileobj)``, fsync it and rename it to ``name``.

    Returns ``(sha256 hex, size)``. On any failure the temporary file is
    removed and the final name is untouched.
    """
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.getpid()}-{name}")
    writer = None
    try:
        with open(tmp, "wb") as raw:
            writer = _HashingWriter(raw)
            write(writer)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if writer is not None and writer.error is not None and writer.error is not exc:
            raise writer.error from exc
        raise
    _fsync_dir(directory)
    return writer.sha256.hexdigest(), writer.size


def _sha256_of(path: str) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _check_plain(value: Any, where: str) -> None:
    """Refuse values ``torch.load(weights_only=True)`` could not read back.

    Exact types only: a NumPy scalar, a ``defaultdict`` or a namedtuple
    pickles fine but is refused by the weights-only loader, which would
    make the checkpoint unloadable long after it was saved.
    """
    kind = type(value)
    if kind in _PLAIN or isinstance(value, torch.Tensor):
        return
    if kind in (list, tuple, set, frozenset):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            _check_plain(key, f"key {key!r} of {where}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    hint = "int(...)" if isinstance(value, numbers.Integral) else "float(...)" if isinstance(value, numbers.Real) else (
        ".tolist(), torch.as_tensor(...) or a plain dict/list/tuple")
    raise TypeError(
        f"{where} is a {kind.__name__} ({_short_repr(value)}), which torch.load(..., weights_only=True) "
        f"cannot read back; checkpoints hold only None, bool, int, float, str, bytes, tensors and "
        f"lists/tuples/dicts of them. Convert it with {hint}"
    )


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - only for the message
        text = object.__repr__(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_objects(model: Any, optimizer: Any, scheduler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (e.g. the AmpOptimizer returned by "
            f"fleet.distributed_optimizer), got {type(optimizer).__name__}"
        )
    if scheduler is not None and not (
        callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))
    ):
        raise TypeError(
            f"scheduler must have state_dict() and load_state_dict() (a torch LR scheduler), "
            f"got {type(scheduler).__name__}"
        )


def _check_directory(directory: Any) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    path = os.fspath(directory)
    if isinstance(path, bytes) or not path:
        raise ValueError(f"directory={directory!r} is not a usable directory path; pass a non-empty str")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"directory={path!r} exists and is not a directory; choose another checkpoint directory")
    return path


# ----------------------------------------------------------------------------- RNG states


def _rng_state() -> dict:
    """This process's RNG states as tensors and plain numbers."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: Mapping) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            s = state["numpy"]
            np.random.set_state(
                (s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
            )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d device(s) but %d are visible; "
                "CUDA RNG not restored", len(cuda_states), torch.cuda.device_count()
            )


# ----------------------------------------------------------------------------- listing


def list_checkpoints(directory: str | os.PathLike) -> list[int]:
    """Step numbers with a payload or manifest in ``directory``, newest first.

    Presence is not completeness: :func:`load_latest_checkpoint` verifies.
    Returns ``[]`` when the directory does not exist.
    """
    path = _check_directory(directory)
    if not os.path.isdir(path):
        return []
    steps = {int(m.group(1)) for name in os.listdir(path) if (m := _NAME.match(name))}
    return sorted(steps, reverse=True)


def _verify(directory: str, step: int) -> str | None:
    """``None`` when checkpoint ``step`` is complete and intact, else why not."""
    payload = os.path.join(directory, _payload_name(step))
    manifest = os.path.join(directory, _manifest_name(step))
    if not os.path.exists(manifest):
        return f"{payload}: no manifest {os.path.basename(manifest)} (the save did not finish)"
    if not os.path.exists(payload):
        return f"{payload}: payload missing (manifest {manifest} exists)"
    try:
        with open(manifest) as f:
            meta = json.load(f)
        expected_sha, expected_size = str(meta["sha256"]), int(meta["size"])
        if meta.get("format") != _FORMAT or int(meta["step"]) != step:
            return f"{manifest}: not a {_FORMAT} manifest for step {step}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest}: unreadable manifest ({type(exc).__name__}: {exc})"
    try:
        sha, size = _sha256_of(payload)
    except OSError as exc:
        return f"{payload}: unreadable ({exc})"
    if size != expected_size:
        return f"{payload}: {size} bytes but the manifest says {expected_size} (truncated?)"
    if sha != expected_sha:
        return f"{payload}: SHA-256 {sha[:12]}... does not match the manifest's {expected_sha[:12]}... (corrupted)"
    return None


# ----------------------------------------------------------------------------- save


def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> str:
    """Save checkpoint ``step`` atomically and keep only the newest ``keep``.

    Collective: call it on every rank (it gathers each rank's RNG states).
    Rank 0 writes ``directory/step-<step>.pt`` then its manifest
    ``step-<step>.json`` (temporary file, fsync, rename, directory fsync),
    then deletes older checkpoints beyond ``keep`` and any with a step
    greater than ``step`` (left by a run that was resumed from an earlier
    one). Every rank returns only once the checkpoint is durable, and raises
    the same ``RuntimeError`` if rank 0 could not write it.

    What is saved: ``model.state_dict()`` (of the module inside a
    DataParallel/DDP wrapper), ``optimizer.state_dict()`` (for distamp's
    AmpOptimizer: inner state, FP32 masters, loss scaler and counters),
    ``scheduler.state_dict()``, the RNG states of every rank (Python
    ``random``, NumPy, torch CPU and CUDA) and ``extra``.

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

    Returns:
        The payload path (on every rank).
    """
    path = _check_directory(directory)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__} ({step!r})")
    if step < 0:
        raise ValueError(f"step={step!r} must be >= 0")
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
        raise TypeError(f"keep must be an int, got {type(keep).__name__} ({keep!r})")
    if keep < 1:
        raise ValueError(f"keep={keep!r} must be >= 1: the newest checkpoint is always kept")
    _check_objects(model, optimizer, scheduler)
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    extra = dict(extra)
    _check_plain(extra, "extra")
    step = int(step)

    # Checked on every rank (the states are replicated), so all raise alike.
    optimizer_state = optimizer.state_dict()
    scheduler_state = scheduler.state_dict() if scheduler is not None else None
    _check_plain(optimizer_state, "optimizer.state_dict()")
    _check_plain(scheduler_state, "scheduler.state_dict()")

    rank, world_size = _rank_and_world()
    rng_states = _all_gather(_rng_state())
    error, failure = None, None
    if rank == 0:
        try:
            payload = {
                "format": _FORMAT,
                "step": step,
                "world_size": world_size,
                "model": _unwrap(model).state_dict(),
                "optimizer_type": type(optimizer).__name__,
                "optimizer": optimizer_state,
                "scheduler": scheduler_state,
                "rng": rng_states,
                "extra": extra,
            }
            _write(path, step, payload, keep)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error, failure = f"{type(exc).__name__}: {exc}", exc
    error = _broadcast(error)
    if error is not None:
        raise RuntimeError(
            f"rank 0 could not save checkpoint {step} in {path!r}: {error}"
        ) from failure
    return os.path.join(path, _payload_name(step))


def _write(directory: str, step: int, payload: dict, keep: int) -> None:
    os.makedirs(directory, exist_ok=True)
    sha, size = _write_atomically(directory, _payload_name(step), lambda f: torch.save(payload, f))
    manifest = {
        "format": _FORMAT,
        "step": step,
        "file": _payload_name(step),
        "size": size,
        "sha256": sha,
        "world_size": payload["world_size"],
    }
    text = json.dumps(manifest, indent=1).encode()
    _write_atomically(directory, _manifest_name(step), lambda f: f.write(text))
    _rotate(directory, step, keep)


def _rotate(directory: str, newest: int, keep: int) -> None:
    """Delete checkpoints newer than ``newest`` and all but ``keep`` complete ones."""
    kept = 0
    for step in list_checkpoints(directory):
        stale = step > newest
        complete = os.path.exists(os.path.join(directory, _manifest_name(step)))
        if not stale and kept < keep and complete:
            kept += 1
            continue
        if stale:
            logger.info("removing checkpoint %d: newer than the step being saved (%d)", step, newest)
        # Manifest first: a half-deleted checkpoint must not look complete.
        for name in (_manifest_name(step), _payload_name(step)):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    for name in os.listdir(directory):
        if name.startswith(_TMP_PREFIX):  # left by a writer that was killed
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    _fsync_dir(directory)


# ----------------------------------------------------------------------------- load


def load_latest_checkpoint(
    directory: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
) -> CheckpointInfo | None:
    """Restore the newest intact checkpoint in ``directory`` on every rank.

    Collective: call it on every rank after building the model, the
    optimizer (``fleet.distributed_optimizer``) and the scheduler, before
    training. Rank 0 picks the newest checkpoint whose manifest exists and
    whose payload matches the recorded size and SHA-256, warning (on every
    rank) about each newer one it passed over, and broadcasts its step, so
    all ranks load the same one; each rank then verifies and loads that
    file itself with ``torch.load(..., weights_only=True)`` to the CPU
    (state is copied onto the parameters' devices).

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

    Returns:
        A :class:`CheckpointInfo`, or None when there is no usable
        checkpoint (nothing to resume: start from scratch).

    Raises:
        RuntimeError: on every rank, when some rank cannot read the chosen
            checkpoint (e.g. a directory that is not shared between nodes),
            or the checkpoint does not fit the model/optimizer.
    """
    path = _check_directory(directory)
    _check_objects(model, optimizer, scheduler)
    rank, world_size = _rank_and_world()

    decision: tuple[int | None, list[str]] = (None, [])
    if rank == 0:
        bad: list[str] = []
        chosen = None
        for step in list_checkpoints(path):
            reason = _verify(path, step)
            if reason is None:
                chosen = step
                break
            bad.append(reason)
        decision = (chosen, bad)
    chosen, bad = _broadcast(decision)
    for reason in bad:
        warnings.warn(f"skipping bad checkpoint {reason}; falling back to an older one", stacklevel=2)
    if chosen is None:
        if bad:
            warnings.warn(f"no intact checkpoint in {path!r}; starting from scratch", stacklevel=2)
        return None

    payload_path = os.path.join(path, _payload_name(chosen))
    error, payload = None, None
    try:
        reason = _verify(path, chosen) if rank != 0 else None
        if reason is not None:
            raise RuntimeError(
                f"rank {rank} sees a different file: {reason}. On several nodes the checkpoint "
                "directory must be on a file system shared by every node"
            )
        payload = torch.load(payload_path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("step") != chosen:
            raise RuntimeError(f"{payload_path} is not a {_FORMAT} payload for step {chosen}")
        _restore(payload, model, optimizer, scheduler)
    except Exception as exc:  # noqa: BLE001 - made collective below
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    errors = [e for e in _all_gather(error) if e is not None]
    if errors:
        raise RuntimeError(f"could not resume from {payload_path}: " + "; ".join(errors))

    saved_world = int(payload["world_size"])
    rng_restored = saved_world == world_size
    if rng_restored:
        _set_rng_state(payload["rng"][rank])
    elif rank == 0:
        warnings.warn(
            f"checkpoint {payload_path} was saved by {saved_world} rank(s) and is resumed by "
            f"{world_size}: model, optimizer, scheduler and extra are restored exactly, but the "
            "per-rank RNG states are not (each rank keeps its current ones), and the data order "
            "from here on differs from a run with the original world size",
            stacklevel=2,
        )
    return CheckpointInfo(
        step=chosen,
        path=payload_path,
        extra=dict(payload["extra"]),
        world_size=saved_world,
        rng_restored=rng_restored,
        skipped=tuple(bad),
    )


def _restore(payload: Mapping, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    saved_opt = payload["optimizer_type"]
    if saved_opt != type(optimizer).__name__:
        raise ValueError(
            f"the checkpoint's optimizer is a {saved_opt}, this one is a {type(optimizer).__name__}; "
            "build the optimizer the way the saving run did (fleet.distributed_optimizer with the "
            "same strategy)"
        )
    if (payload["scheduler"] is None) != (scheduler is None):
        raise ValueError(
            "the checkpoint "
            + ("has no" if payload["scheduler"] is None else "has an")
            + " LR scheduler state but scheduler="
            + ("a scheduler" if scheduler is not None else "None")
            + " was passed; pass the same kind of scheduler the saving run used"
        )
    # Model first: in O2 the optimizer then overwrites the 16-bit weights from its exact masters.
    _unwrap(model).load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
