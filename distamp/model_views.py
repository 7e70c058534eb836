"""Views of the user's model: through data-parallel and compile wrappers, and its state with FP32 masters."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["CONTIGUOUS_FIX", "ExactFp32Source", "fp32_model_state_dict", "known_name", "non_contiguous",
           "parameters_device", "unwrap_model", "user_name", "wrapper_prefix"]

_WRAPPED_ATTRIBUTES = ("module", "_orig_mod")  # DataParallel/DDP, torch.compile's OptimizedModule


def _peel(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, user's module)``: the wrappers' qualified-name prefix (``"_orig_mod."``) and the module inside."""
    prefix = ""
    while next(model.parameters(recurse=False), None) is None:
        children = list(model.named_children())
        if len(children) != 1 or children[0][0] not in _WRAPPED_ATTRIBUTES:
            break
        name, model = children[0]
        prefix += f"{name}."
    return prefix, model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside ``fleet.distributed_model`` / DDP / ``torch.compile`` wrappers.

    A wrapper is a module whose only child is ``.module`` (DataParallel,
    DDP) or ``._orig_mod`` (a compiled module) and which has no parameters
    of its own; a user model that merely has a submodule called ``module``
    is not unwrapped.
    """
    return _peel(model)[1]


def wrapper_prefix(model: nn.Module) -> str:
    """What the wrappers around :func:`unwrap_model`'s module put before its qualified names.

    ``""`` for a bare model, ``"_orig_mod."`` for a compiled one,
    ``"module._orig_mod."`` for a compiled model inside a DDP wrapper: a
    name ``n`` of the user's module is ``wrapper_prefix(model) + n`` in
    ``model.named_modules()`` (its root, ``""``, is the prefix without its
    final dot).
    """
    return _peel(model)[0]


def user_name(model: nn.Module, name: str) -> str:
    """``name``, qualified in ``model`` (wrappers included), as qualified in :func:`unwrap_model`'s module.

    A name outside the user's module (a wrapper's own) is returned unchanged.
    """
    prefix = wrapper_prefix(model)
    if prefix and name == prefix[:-1]:
        return ""
    return name.removeprefix(prefix)


def known_name(name: str, known: Container[str]) -> str:
    """``name`` as one of ``known``: itself, or without the wrappers' components it starts with.

    A name saved by a version of distamp that spelled parameters inside
    ``torch.compile``'s wrapper (``"_orig_mod.head.weight"``) is known as
    ``"head.weight"``; a name that is neither is returned unchanged.
    """
    found = name
    while found not in known:
        first, dot, rest = found.partition(".")
        if not dot or first not in _WRAPPED_ATTRIBUTES:
            return name
        found = rest
    return found


class ExactFp32Source(Protocol):
    """FP32 master weights, whole or sharded: exact FP32 values by ``id`` of their model parameter."""

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        """``{id(model parameter): FP32 value}`` (collective for sharded masters)."""
        ...


CONTIGUOUS_FIX = ("model.to(memory_format=torch.contiguous_format) for 4-d and 5-d weights, "
                  "p.data = p.data.contiguous() for others (sharding off and PowerSGD train any memory format).")
"""How to make parameters contiguous again, for the sharded stages' refusals."""


def non_contiguous(named_params: Iterable[tuple[str, nn.Parameter]]) -> list[str]:
    """``'name' (shape ..., strides ...)`` for each of ``named_params`` that is not contiguous."""
    return [f"{name!r} (shape {tuple(p.shape)}, strides {p.stride()})" for name, p in named_params
            if not p.is_contiguous()]


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
