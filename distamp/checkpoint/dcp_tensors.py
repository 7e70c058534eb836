"""Stage-3 tensors on ``torch.distributed.checkpoint`` (DCP): each rank writes its shards, any layout reads them.

At sharding stage 3 the model's parameters and the optimizer's per-element
state are DTensors. A save hands them to DCP (:func:`write`): each rank
writes its own local shards into the checkpoint's DCP directory, and DCP's
coordinator writes ``.metadata``, the map of every shard; nothing is
gathered. The rest of the state goes to the common payload as always, with
each tensor given to DCP replaced by a *slot* ``{"dcp": key, "shape": [...],
"dtype": ...}`` (:func:`split`): the model's ``state_dict()`` and the
optimizer's whole-form ``state_dict()`` with holes.

A load fills the holes. :func:`targets` gives, for each slot, the tensor
the loading rank holds for it: at stage 3 a DTensor laid out as this rank's
shard (the model's own parameters, read in place, and fresh optimizer
state), otherwise a whole tensor. :func:`read` lets DCP read into them what
each rank needs, resharding on read at any world size, and :func:`fill`
puts them back into the payload. So a stage-3 load never materialises a
whole parameter; a load into stages 0-2 or an unsharded model reads whole
tensors, as those hold them whole anyway.

The DCP calls (``save``/``load`` with ``storage_writer``/``storage_reader``
and ``no_dist``, ``FileSystemWriter(path, sync_files=...)``,
``FileSystemReader(path)``) are public API with the same signatures on
torch 2.11.0, 2.13.0 and 2.14.1 (checked on those builds; 2.15 was not
available to check), so nothing goes through :mod:`distamp.torch_compat`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.core.shard_rows import like_local_rows

__all__ = ["fill", "is_slot", "read", "slots", "split", "targets", "write"]

_SLOT_KEYS = frozenset({"dcp", "shape", "dtype"})


def _slot(key: str, value: torch.Tensor) -> dict:
    return {"dcp": key, "shape": list(value.shape), "dtype": value.dtype}


def is_slot(value: Any) -> bool:
    """Whether ``value`` is a slot: a tensor held by the checkpoint's DCP files."""
    return isinstance(value, dict) and set(value) == _SLOT_KEYS


def slots(tree: Any) -> list[dict]:
    """Every slot in ``tree`` (dicts, lists and tuples of values), in order."""
    if is_slot(tree):
        return [tree]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in slots(v)]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in slots(v)]
    return []


def fill(tree: Any, tensors: Mapping[str, torch.Tensor], convert: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
         ) -> Any:
    """``tree`` with each slot replaced by ``convert(tensors[its key])``."""
    if is_slot(tree):
        return convert(tensors[tree["dcp"]])
    if isinstance(tree, dict):
        return {k: fill(v, tensors, convert) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(fill(v, tensors, convert) for v in tree)
    return tree


def _same_data(a: DTensor, b: DTensor) -> bool:
    la, lb = a.to_local(), b.to_local()
    return (la.data_ptr() == lb.data_ptr() and la.shape == lb.shape and la.dtype == lb.dtype
            and a.shape == b.shape)


def split(module: nn.Module, optimizer: Any) -> tuple[dict, dict, dict[str, DTensor]] | None:
    """``(model state, optimizer state, tensors)`` for a stage-3 save; None when ``module`` holds no DTensor.

    The two states are ``module.state_dict()`` and ``optimizer.state_dict()``
    (whole form, no ``"sharding"``) with a slot where ``tensors`` (by DCP key)
    holds a DTensor; no collective, nothing copied. An O2 master that is the
    model's own parameter (FSDP2 keeps the FP32 parameter sharded) points to
    the model's key, so it is written once.
    """
    state = module.state_dict()
    if not any(isinstance(v, DTensor) for v in state.values()):
        return None
    tensors: dict[str, DTensor] = {}
    model: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            tensors[key := f"model/{name}"] = value
            model[name] = _slot(key, value)
        else:
            model[name] = value
    local = optimizer.local_state_dict()
    inner = optimizer.inner_opt.state_dict()
    entries: dict[Any, dict] = {}
    for index, entry in inner["state"].items():
        entries[index] = {}
        for name, value in entry.items():
            if isinstance(value, DTensor):
                tensors[key := f"optimizer/state/{index}/{name}"] = value
                value = _slot(key, value)
            entries[index][name] = value
    masters = []
    owners = optimizer.precision.master_weights.model_params if local["master_weights"] else []  # O2 only
    for i, (master, param) in enumerate(zip(local["master_weights"], owners, strict=True)):
        value = like_local_rows(master, param) if isinstance(param, DTensor) else master
        key = next((k for k, t in tensors.items() if k.startswith("model/") and _same_data(t, value)),
                   f"optimizer/master/{i}")
        tensors.setdefault(key, value)
        masters.append(_slot(key, value))
    optimizer_state = {k: v for k, v in local.items() if k != "sharding"}
    optimizer_state.update(inner={**inner, "state": entries}, master_weights=masters)
    return model, optimizer_state, tensors


def write(tensors: dict[str, DTensor], directory: str) -> None:
    """``dcp.save`` of ``tensors`` into ``directory``: each rank writes its local shards, rank 0 the metadata.

    Collective over the default process group, like ``dcp.save``; every
    rank raises ``RuntimeError`` when any rank failed to write (DCP's writer also makes
    ``directory`` inside that protocol, so a rank that cannot still reaches
    every collective of the others).
    """
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    except dcp.CheckpointException as exc:
        raise _failure("write", exc) from exc


def read(tensors: dict[str, torch.Tensor], directory: str) -> None:
    """``dcp.load`` into ``tensors`` (in place) from ``directory``: each rank reads what its tensors hold.

    Collective over the default process group, like ``dcp.load``; every rank raises ``RuntimeError`` when any
    rank failed to read.
    """
    try:
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(directory),
                 no_dist=not (dist.is_available() and dist.is_initialized()))
    except dcp.CheckpointException as exc:
        raise _failure("read", exc) from exc


def _failure(what: str, exc: dcp.CheckpointException) -> RuntimeError:
    """DCP's error (a ``BaseException``, the same on every rank) as a ``RuntimeError`` naming each failed rank's
    error in one line, so the checkpoint layer reports it like any other."""
    failures = getattr(exc, "failures", {}) or {}
    found = "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, error in sorted(failures.items()))
    return RuntimeError(f"torch.distributed.checkpoint could not {what}: {found or exc}")


def targets(model_state: Mapping[str, Any], optimizer_state: Mapping[str, Any], module: nn.Module,
            optimizer: Any) -> dict[str, torch.Tensor]:
    """The tensor each slot of the saved states is read into, by DCP key.

    Model entries: the loading model's own ``state_dict()`` tensor where it
    is a DTensor (read in place: no copy of the model), else a whole tensor.
    Optimizer state and masters: at stage 3 a DTensor laid out as the
    loading parameter's shard, at the other stages a whole tensor.

    Raises:
        ValueError: the loading model or optimizer lacks an entry the
            checkpoint has, or its shape differs.
    """
    own = module.state_dict()
    found: dict[str, torch.Tensor] = {}
    for name, value in model_state.items():
        if not is_slot(value):
            continue
        if name not in own:
            raise ValueError(f"the checkpoint's model has entry {name!r}, which this model lacks; build the model "
                             "as the saving run did")
        found[value["dcp"]] = _fitting(own[name], value, f"model entry {name!r}", in_place=True)
    if optimizer.precision.stage != 3:
        # Stages 0-2 hold the optimizer state whole or as flat slices: read it whole, flat_state re-slices it.
        for value in slots(optimizer_state):
            found.setdefault(value["dcp"], torch.empty(value["shape"], dtype=value["dtype"]))
        return found
    params = [p for group in optimizer.inner_opt.param_groups for p in group["params"]]
    for index, entry in optimizer_state["inner"]["state"].items():
        for name, value in entry.items():
            if is_slot(value) and value["dcp"] not in found:
                if int(index) >= len(params):
                    raise ValueError(f"the checkpoint's optimizer has state for parameter {index}, this optimizer "
                                     f"{len(params)} parameters; build the optimizer as the saving run did")
                found[value["dcp"]] = _fitting(params[int(index)], value, f"optimizer state {name!r} of "
                                               f"parameter {index}", in_place=False)
    model_params = optimizer.precision.master_weights.model_params
    for i, value in enumerate(optimizer_state["master_weights"]):
        if is_slot(value) and value["dcp"] not in found:
            if i >= len(model_params):
                raise ValueError(f"the checkpoint has {len(optimizer_state['master_weights'])} FP32 masters, this "
                                 f"optimizer {len(model_params)} parameters; build the optimizer as the saving run did")
            found[value["dcp"]] = _fitting(model_params[i], value, f"FP32 master {i}", in_place=False)
    return found


def _fitting(like: torch.Tensor, slot: dict, what: str, *, in_place: bool) -> torch.Tensor:
    """``like`` itself (``in_place``, a DTensor) or a new tensor of the slot's dtype laid out as ``like``."""
    if list(like.shape) != list(slot["shape"]):
        raise ValueError(f"the checkpoint's {what} has shape {list(slot['shape'])}, this one "
                         f"{list(like.shape)}; build the model and optimizer as the saving run did")
    if isinstance(like, DTensor):
        if in_place and like.dtype == slot["dtype"]:
            return like.detach()
        local = torch.empty(like.to_local().shape, dtype=slot["dtype"], device=like.device)
        return like_local_rows(local, like)
    return torch.empty(slot["shape"], dtype=slot["dtype"])
