"""Looking through data-parallel and compile wrappers to the user's model."""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap_model"]

_WRAPPED_ATTRIBUTES = ("module", "_orig_mod")  # DataParallel/DDP, torch.compile's OptimizedModule


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside ``fleet.distributed_model`` / DDP / ``torch.compile`` wrappers.

    A wrapper is a module whose only child is ``.module`` (DataParallel,
    DDP) or ``._orig_mod`` (a compiled module) and which has no parameters
    of its own; a user model that merely has a submodule called ``module``
    is not unwrapped.
    """
    while not model._parameters and len(model._modules) == 1:
        (name, inner), = model._modules.items()
        if name not in _WRAPPED_ATTRIBUTES or not isinstance(inner, nn.Module):
            break
        model = inner
    return model
