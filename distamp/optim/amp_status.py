"""What a training loop can read from ``AmpOptimizer``: the loss scale, the step counters, the merge window."""

from __future__ import annotations

from typing import Any

from distamp.core.master_weights import MasterWeightsSurface
from distamp.core.precision import FullPrecision
from distamp.optim.accumulation import GradientMerge
from distamp.optim.grad_clipping import GradClipper
from distamp.optim.step_policy import StepPolicy

__all__ = ["AmpStatus"]


class AmpStatus:
    """The read-out part of ``AmpOptimizer``'s public API, over the parts it is built from.

    A base class of ``AmpOptimizer``; it only reads (and, for
    :attr:`sync_found_inf`, sets) the state of the parts below.
    """

    precision: FullPrecision
    policy: StepPolicy
    merge: GradientMerge
    clipper: GradClipper

    @property
    def master_weights(self) -> MasterWeightsSurface:
        """The model-parameter / master pairing (masters are params in O1)."""
        return self.precision.master_weights

    @property
    def loss_scaler(self) -> Any:
        """The loss scaler (``None`` when AMP is off)."""
        return self.precision.scaler

    def get_loss_scaling(self) -> float:
        """The current loss scale (1.0 when AMP is off or with BF16)."""
        return self.precision.loss_scale

    loss_scale = property(get_loss_scaling, doc="Same as :meth:`get_loss_scaling`.")

    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step()`` found inf/NaN and skipped (False after one inside a gradient-merge window)."""
        return self.policy.last_step_skipped

    @property
    def steps_applied(self) -> int:
        """Steps whose update was applied."""
        return self.policy.steps_applied

    @property
    def steps_skipped(self) -> int:
        """Steps skipped because a gradient was inf/NaN on some rank."""
        return self.policy.steps_skipped

    @property
    def sync_found_inf(self) -> bool:
        """Whether the inf/NaN verdict is agreed over the group (tests switch it off to show why)."""
        return self.policy.sync_found_inf

    @sync_found_inf.setter
    def sync_found_inf(self, value: bool) -> None:
        self.policy.sync_found_inf = value

    @property
    def is_accumulating(self) -> bool:
        """True inside a gradient-merge window, before its last micro-batch."""
        return self.merge.is_accumulating

    def will_sync_next_backward(self) -> bool:
        """Whether the next ``backward`` closes a gradient-merge window (and communicates)."""
        return self.merge.sync_next_backward

    @property
    def last_grad_norm(self) -> float | None:
        """The last global norm ``clip_grad_norm_`` computed (None before the first)."""
        return self.clipper.last_norm

    def stats(self) -> dict[str, Any]:
        """What a training loop can log.

        ``steps_applied``, ``steps_skipped``, ``loss_scale``; ``overflows``
        (non-finite verdicts, retried attempts included); ``retries``
        (closures called again by ``overflow_retries``); ``last_overflow``
        (``{"step": n, "params": [qualified names]}`` of the last non-finite
        verdict, the same on every rank, or None); ``grad_norm`` (the last
        global norm ``clip_grad_norm_`` computed, or None); with
        ``strategy.powersgd`` on a data-parallel model, ``bytes_sent`` (bytes
        this rank contributed to the gradient all-reduces of the last step,
        every attempt of an ``overflow_retries`` step included:
        uncompressed gradients in the wire dtype, P and Q in FP32) and
        ``compression_rate`` (what an all-reduce of every gradient in the
        wire dtype would send, divided by ``bytes_sent``; 1.0 before
        ``start_step``); None for both otherwise.
        """
        policy = self.policy
        bytes_sent, rate = policy.compressor.step_report() if policy.compressor is not None else (None, None)
        return {
            "steps_applied": policy.steps_applied,
            "steps_skipped": policy.steps_skipped,
            "loss_scale": self.get_loss_scaling(),
            "overflows": policy.overflow.overflows,
            "retries": policy.retries,
            "last_overflow": policy.overflow.copy_of_last(),
            "grad_norm": self.last_grad_norm,
            "bytes_sent": bytes_sent,
            "compression_rate": rate,
        }
