"""Views of the user's model: through data-parallel and compile wrappers, and its state with FP32 masters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ExactFp32Source", "fp32_model_state_dict", "parameters_device", "unwrap_model"]

_WRAPPED_ATTRIBUTES = ("module", "_orig_mod")  # DataParallel/DDP, torch.compile's OptimizedModule


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside ``fleet.distributed_model`` / DDP / ``torch.compile`` wrappers.

    A wrapper is a module whose only child is ``.module`` (DataParallel,
    DDP) or ``._orig_mod`` (a compiled module) and which has no parameters
    of its own; a user model that merely has a submodule called ``module``
    is not unwrapped.
    """
    while next(model.parameters(recurse=False), None) is None:
        children = list(model.named_children())
        if len(children) != 1 or children[0][0] not in _WRAPPED_ATTRIBUTES:
            break
        model = children[0][1]
    return model


class ExactFp32Source(Protocol):
    """FP32 master weights, whole or sharded: exact FP32 values by ``id`` of their model parameter."""

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        """``{id(model parameter): FP32 value}`` (collective for sharded masters)."""
        ...


def parameters_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter; CPU for a module without parameters."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def fp32_model_state_dict(module: nn.Module, master_weights: Sequence[ExactFp32Source]) -> dict:
    """``module.state_dict()`` with each parameter replaced by an FP32 copy of its master.

    Parameters without a master (O1, AMP off, other dtypes) are copied as
    they are, in FP32 when a narrower float; float64 ones stay float64 (FP32
    would round them). Buffers are left unchanged.
    Sharded (DTensor) parameters are gathered whole: collective, every rank
    calls it.
    """
    masters: dict[int, torch.Tensor] = {}
    for weights in master_weights:
        masters.update(weights.exact_fp32())  # collective for sharded masters
    state = module.state_dict()
    for name, p in module.named_parameters(remove_duplicate=False):
        if name in state:
            source = masters.get(id(p), p).detach()
            if isinstance(source, DTensor):
                source = source.full_tensor()
            narrower = source.is_floating_point() and source.element_size() < 4
            state[name] = source.float() if narrower else source.clone()
    return state
