"""Unscaling the gradients before ``step()``, and clipping them: ``AmpOptimizer.unscale_`` and ``clip_grad_norm_``."""

from __future__ import annotations

import math

import torch

from distamp.core.precision import FullPrecision
from distamp.optim.accumulation import GradientMerge
from distamp.optim.step_policy import StepPolicy

__all__ = ["GradClipper"]



class GradClipper:
    """Unscales the gradients once per step, on request, and clips the unscaled ones.

    Args:
        precision: the precision plugin (exposes and clips the unscaled gradients).
        policy: the step policy (unscales, checks and agrees on the verdict).
        merge: the gradient-merge window (no unscaling in the middle of one).
    """

    def __init__(self, precision: FullPrecision, policy: StepPolicy, merge: GradientMerge) -> None:
        self.precision, self.policy, self.merge = precision, policy, merge
        self.last_norm: float | None = None

    def unscale_(self) -> None:
        """Unscale now and decide on the step; see ``AmpOptimizer.unscale_``."""
        if self.merge.is_accumulating:
            raise RuntimeError(
                f"unscale_()/clip_grad_norm_() called in the middle of a gradient-merge window "
                f"(micro-batch {self.merge.micro_steps} of {self.merge.k_steps}); call it only "
                "before the step that completes the window: with gradient_merge the loop's backward and step() "
                f"run every micro-batch, so clip after every {self.merge.k_steps}-th backward only (or leave "
                "clipping out of the other micro-batches), as a torch accumulation loop clips once per window"
            )
        if not self.policy.unscaled:
            self.policy.unscale_and_check()
            if not self.policy.found_inf:
                self.precision.expose_unscaled_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the unscaled gradients to ``max_norm``; see ``AmpOptimizer.clip_grad_norm_``."""
        if not self.policy.unscaled:
            self.unscale_()
        grads_owner = [m for m in self.precision.master_weights.masters if m.grad is not None]
        if self.policy.found_inf:
            device = grads_owner[0].device if grads_owner else torch.device("cpu")
            return torch.full((), math.inf, device=device)
        norm = self.precision.clip_grad_norm_(
            grads_owner, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )
        self.last_norm = float(norm)
        return norm
