"""Optimizer state on DTensor parameters (sharding stage 3): whole, or as each rank holds it.

Two forms of a stage-3 ``AmpOptimizer`` state:

* **whole** (``state_dict()``): what an unsharded optimizer holds, whole
  tensors per parameter index. :func:`gather_full` makes the inner
  optimizer's DTensor state whole (collective: every rank gathers every
  tensor, one at a time), and :func:`reshard_loaded` cuts the whole tensors
  a load put into the inner optimizer back into each rank's shard.
* **local** (``local_state_dict()``, what checkpoints save): each rank's
  own local shards, no collective, with the layout (``"sharding"``, stage 3)
  they belong to. :func:`local_inner` takes the local shards of the inner
  state, :func:`wrap_loaded` turns loaded local shards back into DTensors,
  and :func:`stage3_ranges` says which flat ranges each rank holds (one per
  parameter: FSDP2 cuts every parameter on dim 0, see
  :mod:`distamp.core.shard_rows`), so :mod:`distamp.checkpoint.flat_state`
  can re-slice the state for any world size and stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from distamp.core.shard_rows import like_local_rows, row_numel, rows_of_every_rank

__all__ = ["gather_full", "local_inner", "reshard_loaded", "shard_like", "stage3_ranges", "wrap_loaded"]


def gather_full(inner_state: dict) -> dict:
    """``inner_opt.state_dict()`` with every DTensor state value gathered whole (collective).

    The gathers go in parameter-index order: the inner optimizer's ``state``
    is in the order each rank first stepped its parameters, which differs
    between ranks (the chunked step takes the smallest local shards first),
    and every rank must gather the same tensor at the same time.
    """
    state = {
        index: {key: value.full_tensor() if isinstance(value, DTensor) else value
                for key, value in inner_state["state"][index].items()}
        for index in sorted(inner_state["state"])
    }
    return {**inner_state, "state": state}


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` laid out as ``param`` (a DTensor) is; ``full`` itself for a plain ``param``.

    Local: every rank holds ``full`` and keeps its own part (no collective).
    """
    if not isinstance(param, DTensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def reshard_loaded(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of whole tensors: each state tensor shaped like its DTensor parameter
    becomes that parameter's shard."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not entry or not isinstance(param, DTensor):
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    entry[key] = shard_like(value, param)


def local_inner(inner_state: dict) -> dict:
    """``inner_opt.state_dict()`` with every DTensor state value replaced by this rank's local shard (no collective)."""
    state = {
        index: {key: value.to_local() if isinstance(value, DTensor) else value for key, value in entry.items()}
        for index, entry in inner_state["state"].items()
    }
    return {**inner_state, "state": state}


def wrap_loaded(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of local shards: each state tensor shaped like its DTensor parameter's
    local shard becomes a DTensor laid out as that parameter (no collective)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not entry or not isinstance(param, DTensor):
                continue
            local_shape = param.to_local().shape
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0 \
                        and value.shape == local_shape:
                    entry[key] = like_local_rows(value, param)


def stage3_ranges(shapes: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """Per rank, the ``[lo, hi)`` flat ranges (one per parameter it holds rows of) of parameters of ``shapes``
    laid end to end, each cut on dim 0 over ``world_size`` ranks as FSDP2 cuts it; empty ranges left out."""
    ranges: list[list[list[int]]] = [[] for _ in range(world_size)]
    offset = 0
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        if numel:
            per_row = row_numel(tuple(shape))
            for rank, (start, stop) in enumerate(rows_of_every_rank(int(shape[0]) if len(shape) else 1, world_size)):
                if stop > start:
                    ranges[rank].append([offset + start * per_row, offset + stop * per_row])
        offset += numel
    return ranges
