"""Optimizer state on DTensor parameters (sharding stage 3), in the unsharded checkpoint format.

A stage-3 ``AmpOptimizer.state_dict()`` holds what an unsharded one holds:
whole tensors, per parameter index. :func:`gather_full` makes the inner
optimizer's DTensor state whole for saving (collective: every rank gathers
every tensor, one at a time), and :func:`reshard_loaded` cuts the whole
tensors a load put into the inner optimizer back into each rank's shard.
So a stage-3 state loads unsharded, sharded by stages 1 and 2 (which
re-slice unsharded checkpoints) or at stage 3 at any world size, and the
other way round.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["gather_full", "reshard_loaded", "shard_like"]


def gather_full(inner_state: dict) -> dict:
    """``inner_opt.state_dict()`` with every DTensor state value gathered whole (collective)."""
    state = {
        index: {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in entry.items()}
        for index, entry in inner_state["state"].items()
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
