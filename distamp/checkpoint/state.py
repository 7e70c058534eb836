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

from distamp.model_views import unwrap_model
from distamp.optim.optimizer import AmpOptimizer
from distamp.optim.state import check_optimizer_state

from . import dcp_tensors, flat_state, model_shards, param_names
from .manifest import FORMAT, LEGACY_FORMAT

__all__ = [
    "UnusablePayload",
    "apply_restore",
    "build_payload",
    "build_shard_payload",
    "check_extra",
    "check_fits",
    "check_model_fits",
    "check_objects",
    "check_payload",
    "check_plain",
    "check_shard_payload",
    "model_state",
    "prepare_restore",
    "restore",
    "restore_from_dcp",
]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_KEYS = ("format", "step", "world_size", "model", "optimizer_type", "optimizer", "scheduler", "rng", "extra")


class UnusablePayload(Exception):
    """A payload that loaded but is not a distamp checkpoint payload of the expected step."""


def model_state(model: nn.Module) -> dict[str, Any]:
    """``state_dict()`` of the module inside ``model``'s wrappers (references, nothing copied). Collective.

    With ``overlap_param_gather`` the model's state-dict pre-hook finishes
    the parameter all-gather of every optimizer ``fleet.distributed_model``
    attached to it, not only of the optimizer being saved or loaded. Where
    that gather goes in collective rounds (NCCL) no rank may finish it
    alone: the others would never join its rounds. So a checkpoint takes it
    on every rank before any rank works on the model by itself.
    """
    return unwrap_model(model).state_dict()


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
    dcp_directory: str | None = None,
    scheduler_type: str | None = None,
    parameter_names: dict | None = None,
) -> dict[str, Any]:
    """The common payload: everything but per-rank shards, identical on every rank but the RNG.

    ``model_state_dict``: the model's state with slots for the tensors in
    DCP files (stage 3, :func:`~distamp.checkpoint.dcp_tensors.split`'s);
    None: ``model``'s own ``state_dict()``. ``dcp_directory``: the DCP
    directory holding those tensors, recorded as ``"dcp"``. ``scheduler_type``:
    the scheduler's class name, which :func:`check_fits` compares.
    ``parameter_names``: the optimizer's parameters by name, in the order its
    state numbers them (:func:`~distamp.checkpoint.param_names.record`'s),
    by which a load renumbers that state; None records none.
    """
    index = {} if dcp_directory is None else {"dcp": dcp_directory}
    names = {} if parameter_names is None else {param_names.KEY: parameter_names}
    scheduler_kind = {} if scheduler_type is None else {"scheduler_type": scheduler_type}
    return {
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "model": model_state(model) if model_state_dict is None else model_state_dict,
        **index,
        "optimizer_type": optimizer_type,
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        **scheduler_kind,
        **names,
        "rng": rng_states,
        "extra": extra,
    }


def build_shard_payload(step: int, rank: int, shard: dict) -> dict[str, Any]:
    """A rank's part: its share of the sharded optimizer state (see :mod:`distamp.checkpoint.flat_state`)."""
    return {"format": FORMAT, "step": step, "rank": rank, "optimizer_shard": shard}


def check_shard_payload(payload: Any, step: int, rank: int) -> None:
    """``UnusablePayload`` unless ``payload`` is rank ``rank``'s part of checkpoint ``step``."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise UnusablePayload(f"not a {FORMAT} shard payload (found {found!r})")
    shard, model = payload.get("optimizer_shard"), payload.get("model_shard")
    # An optimizer shard, a stage-3 model shard or both; each a dict.
    holds = (shard is not None or model is not None) and all(isinstance(x, (dict, type(None))) for x in (shard, model))
    if payload.get("step") != step or payload.get("rank") != rank or not holds:
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
    payload: Mapping, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, parts: Mapping | None = None
) -> None:
    """Load model, optimizer and scheduler state; ``ValueError`` (``RuntimeError`` for the model, as torch's
    ``load_state_dict``) on a mismatch, found before anything changes.

    ``parts`` maps saving ranks to the rank parts this rank needs (sharded
    checkpoints, :func:`build_shard_payload`'s); the optimizer state is
    re-sliced for this optimizer's own layout, and a stage-3 model's rows
    for this model (whole, or this rank's shards).
    """
    apply_restore(prepare_restore(payload, model, optimizer, scheduler, parts), payload, model, optimizer, scheduler)


def prepare_restore(
    payload: Mapping, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, parts: Mapping | None = None
) -> tuple[dict, dict]:
    """The ``(model state, optimizer state)`` :func:`apply_restore` loads, once checked to fit; changes nothing.

    ``parts`` as for :func:`restore`.

    Raises:
        RuntimeError: the checkpoint's model does not fit (keys, shapes), as ``load_state_dict`` says it.
        ValueError: its optimizer (type, inner optimizer, O1/O2, parameters) or scheduler does not fit.
    """
    check_fits(payload, optimizer, scheduler)
    parts = dict(parts or {})
    module = unwrap_model(model)
    model_state = dict(payload["model"])
    if payload.get("model_shards"):
        rows = {r: p["model_shard"] for r, p in parts.items() if p.get("model_shard") is not None}
        model_state.update(model_shards.assemble(payload["model_shards"], rows, module))
    check_model_fits(model_state, module)
    target = flat_state.describe(optimizer)
    shards = {r: p["optimizer_shard"] for r, p in parts.items() if p.get("optimizer_shard") is not None}
    optimizer_state = flat_state.join(payload["optimizer"], shards, target, int(payload["world_size"]))
    if isinstance(optimizer, AmpOptimizer):
        check_optimizer_state(optimizer, optimizer_state)
    return model_state, optimizer_state


def apply_restore(
    prepared: tuple[dict, dict], payload: Mapping, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """Load :func:`prepare_restore`'s states into ``model`` and ``optimizer``, and the scheduler's."""
    model_state, optimizer_state = prepared
    # Model first: in O2 the optimizer then overwrites the 16-bit weights from its exact masters.
    unwrap_model(model).load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])


def check_model_fits(model_state: Mapping[str, Any], module: nn.Module) -> None:
    """``RuntimeError`` when ``module`` cannot take ``model_state``, listing what ``load_state_dict(strict=True)``
    would, in its words and error type (it reports them only after copying every entry that fits).

    Shapes are compared where both sides are plain tensors (a DTensor's, or a
    stage-3 slot's, is checked when it is read).
    """
    own = module.state_dict()
    problems = []
    unexpected = [k for k in model_state if k not in own]
    if unexpected:
        problems.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    missing = [k for k in own if k not in model_state]
    if missing:
        problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    problems += [
        f"size mismatch for {k}: copying a param with shape {model_state[k].shape} from checkpoint, the shape in "
        f"current model is {own[k].shape}."
        for k in own
        if k in model_state and _plain_tensor(own[k]) and _plain_tensor(model_state[k])
        and model_state[k].shape != own[k].shape
    ]
    if problems:
        name = type(module).__name__
        raise RuntimeError(
            f"Error(s) in loading state_dict for {name}:\n\t" + "\n\t".join(problems) + "\n\tNothing was "
            "loaded: build the model the way the saving run did, or move the checkpoint directory away to start "
            "from scratch"
        )


def _plain_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def restore_from_dcp(
    payload: Mapping, tensors: Mapping[str, torch.Tensor], model: nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: Any
) -> None:
    """:func:`restore` of a checkpoint whose stage-3 tensors DCP has read into ``tensors`` (by key, laid out as
    :func:`~distamp.checkpoint.dcp_tensors.targets` made them).

    A stage-3 optimizer takes them as its local shards, with its own layout;
    any other takes whole tensors, re-sliced as from an unsharded checkpoint.
    """
    target = flat_state.describe(optimizer)
    model_state = dcp_tensors.fill(payload["model"], tensors)
    if target is None or not target.fully_sharded:
        restore({**payload, "model": model_state, "optimizer": dcp_tensors.fill(payload["optimizer"], tensors)},
                model, optimizer, scheduler)
        return
    check_fits(payload, optimizer, scheduler)
    local = dcp_tensors.fill(payload["optimizer"], tensors, lambda t: t.to_local() if isinstance(t, DTensor) else t)
    unwrap_model(model).load_state_dict(model_state)
    optimizer.load_state_dict({**local, "sharding": target.sharding})
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])


def check_fits(payload: Mapping, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """``ValueError`` unless the checkpoint's optimizer type and its scheduler's presence and type match these."""
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
    saved_scheduler = payload.get("scheduler_type")  # absent from checkpoints saved before it was recorded
    if scheduler is not None and saved_scheduler is not None and saved_scheduler != type(scheduler).__name__:
        raise ValueError(
            f"the checkpoint's LR scheduler is a {saved_scheduler}, this one is a {type(scheduler).__name__}, "
            f"whose load_state_dict would take the other's state without a word; pass a {saved_scheduler} built "
            "as the saving run did"
        )
