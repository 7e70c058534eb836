"""What a checkpoint holds and how it is put back: model, optimizer, scheduler, RNG, ``extra``.

This module knows training state, not files. Everything saved must load
with ``torch.load(..., weights_only=True)``: :func:`check_plain` refuses
anything else at save time, when the caller can still fix it, rather than
at resume time, when the checkpoint would be lost.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.optim import flat_state

from .manifest import FORMAT, LEGACY_FORMAT

__all__ = [
    "UnusablePayload",
    "build_payload",
    "build_shard_payload",
    "check_extra",
    "check_objects",
    "check_payload",
    "check_plain",
    "check_shard_payload",
    "model_state",
    "restore",
    "unwrap",
]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_KEYS = ("format", "step", "world_size", "model", "optimizer_type", "optimizer", "scheduler", "rng", "extra")


class UnusablePayload(Exception):
    """A payload that loaded but is not a distamp checkpoint payload of the expected step."""


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DistributedDataParallel wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def check_plain(value: Any, where: str) -> None:
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
            check_plain(item, f"{where}[{i}]")
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            check_plain(key, f"key {key!r} of {where}")
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, numbers.Integral):
        hint = "int(...)"
    elif isinstance(value, numbers.Real):
        hint = "float(...)"
    else:
        hint = ".tolist(), torch.as_tensor(...) or a plain dict/list/tuple"
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


def check_objects(model: Any, optimizer: Any, scheduler: Any) -> None:
    """``TypeError`` unless these are a module, an optimizer and None or an LR scheduler."""
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


def check_extra(extra: Any) -> dict:
    """``extra`` as a plain dict; ``TypeError`` when it is not one of storable values."""
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    extra = dict(extra)
    check_plain(extra, "extra")
    return extra


def model_state(model: nn.Module) -> dict:
    """``state_dict()`` of the module inside the wrappers, sharded (DTensor) entries gathered whole.

    Collective when the model is sharded (stage 3): every rank calls it.
    """
    return {key: value.full_tensor() if isinstance(value, DTensor) else value
            for key, value in unwrap(model).state_dict().items()}


def build_payload(
    step: int,
    world_size: int,
    model: nn.Module,
    optimizer_type: str,
    optimizer_state: dict,
    scheduler_state: Any,
    rng_states: list[dict],
    extra: dict,
    *,
    model_state_dict: dict | None = None,
) -> dict[str, Any]:
    """The common payload: everything but per-rank shards, identical on every rank but the RNG.

    ``model_state_dict``: the model's state as :func:`model_state` gathered it
    (on every rank, beforehand); None: ``model``'s own ``state_dict()``.
    """
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "model": unwrap(model).state_dict() if model_state_dict is None else model_state_dict,
        "optimizer_type": optimizer_type,
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "rng": rng_states,
        "extra": extra,
    }


def build_shard_payload(step: int, rank: int, shard: dict) -> dict[str, Any]:
    """A rank's part: its slice of the sharded optimizer state (see :mod:`distamp.optim.flat_state`)."""
    return {"format": FORMAT, "step": step, "rank": rank, "optimizer_shard": shard}


def check_shard_payload(payload: Any, step: int, rank: int) -> None:
    """``UnusablePayload`` unless ``payload`` is rank ``rank``'s part of checkpoint ``step``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise UnusablePayload(f"not a {FORMAT} shard payload (found {found!r})")
    shard = payload.get("optimizer_shard")
    if payload.get("step") != step or payload.get("rank") != rank or not isinstance(shard, dict):
        raise UnusablePayload(
            f"payload is for step {payload.get('step')!r} rank {payload.get('rank')!r}; "
            f"expected step {step} rank {rank}"
        )


def check_payload(payload: Any, step: int) -> None:
    """``UnusablePayload`` unless ``payload`` is a common payload of checkpoint ``step``."""
    if not isinstance(payload, dict) or payload.get("format") not in (FORMAT, LEGACY_FORMAT):
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise UnusablePayload(f"not a {FORMAT} payload (found {found!r})")
    missing = [k for k in _KEYS if k not in payload]
    if missing:
        raise UnusablePayload(f"payload lacks {missing}")
    if payload["step"] != step:
        raise UnusablePayload(f"payload is for step {payload['step']!r}, its manifest for step {step}")
    if not isinstance(payload["rng"], list) or len(payload["rng"]) != payload["world_size"]:
        raise UnusablePayload(f"payload of {payload['world_size']!r} rank(s) lacks their RNG states")


def restore(
    payload: Mapping, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, shards: Mapping | None = None
) -> None:
    """Load model, optimizer and scheduler state; ``ValueError`` (or torch's error) on a mismatch.

    ``shards`` maps saving ranks to the optimizer shard parts this rank
    needs (sharded checkpoints); the optimizer state is re-sliced for this
    optimizer's own layout.
    """
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
    unwrap(model).load_state_dict(payload["model"])
    target = flat_state.describe(optimizer)
    optimizer.load_state_dict(flat_state.join(payload["optimizer"], dict(shards or {}), target))
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
