"""One global gradient norm from each rank's part of a sharded gradient (``clip_grad_norm_`` at stages 1-3)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from distamp.distributed.groups import group_size

__all__ = ["global_clip"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_clip(local: torch.Tensor, max_norm: float, norm_type: float, group: dist.ProcessGroup | None,
                error_if_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total norm, clip coefficient)`` from each rank's part of a sharded gradient's norm.

    ``local`` is a one-element FP32 tensor: this rank's ``sum |g|^p`` (or its
    ``max |g|`` for the infinity norm). The parts are gathered and combined
    in rank order, so every rank computes the same bits.

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is inf or NaN.
    """
    parts = local.repeat(group_size(group))
    if group is not None and group_size(group) > 1:
        _all_gather(parts, local, group=group)
    total = parts.max() if math.isinf(norm_type) else parts.sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
            "set error_if_nonfinite=False to skip this check"
        )
    return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)
