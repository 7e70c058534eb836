"""Where a model's tensors must be before a wrapper (DDP, FSDP2) takes it."""

from __future__ import annotations

import torch
from torch import nn

from distamp.model_views import unwrap_model

__all__ = ["check_device"]


def check_device(module: nn.Module, device: torch.device) -> torch.device:
    """Raise ``ValueError`` naming the first parameter or buffer not on ``device``; return ``device``.

    DDP would otherwise fail later with an error that names neither the
    tensor nor the fix, or, with a model on another GPU, train there.
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    user = unwrap_model(module)  # named as in the user's model, inside torch.compile's wrapper
    tensors: list[tuple[str, str, torch.Tensor]] = [("parameter", n, t) for n, t in user.named_parameters()]
    tensors += [("buffer", n, t) for n, t in user.named_buffers()]
    for kind, name, tensor in tensors:
        if tensor.device != device:
            raise ValueError(
                f"{kind} {name!r} is on {tensor.device}, but this process trains on {device} "
                "(fleet.device()); move the model there before wrapping it: model.to(fleet.device())"
            )
    return device
