"""The step decision: unscale, agree on inf/NaN, apply or skip (or retry), update the scale.

:class:`StepPolicy` is the part of the meta-optimizer that runs between the
last backward of a step and the next one. It owns the step counters, so
``AmpOptimizer`` stays a thin facade over it, the precision plugin, the
gradient-merge window and the model binding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distamp.core.attached import GradCompressor
from distamp.core.precision import FullPrecision
from distamp.distributed.groups import data_parallel_group
from distamp.distributed.timeouts import named_collective
from distamp.optim.accumulation import GradientMerge
from distamp.optim.grad_watch import GradWatch
from distamp.optim.model_binding import ModelBinding
from distamp.scaling.overflow import OverflowLog, nonfinite_parameters

if TYPE_CHECKING:  # replica_watch imports the precision plugins, which import this module's users
    from distamp.optim.replica_watch import ReplicaWatch

__all__ = ["StepPolicy"]


class StepPolicy:
    """Decides every step the same way on every rank.

    Args:
        inner_opt: the inner optimizer (stepped when the verdict is finite).
        precision: the precision plugin (unscale, check, scale updates).
        merge: the gradient-merge window.
        watch: misuse detection on the model's gradients.
        binding: the model's parameter names (for attribution).
        process_group: the data-parallel group (``None``: the default one).
    """

    def __init__(self, inner_opt: torch.optim.Optimizer, precision: FullPrecision, merge: GradientMerge,
                 watch: GradWatch, binding: ModelBinding, process_group: dist.ProcessGroup | None) -> None:
        self.inner_opt, self.precision, self.merge = inner_opt, precision, merge
        self.watch, self.binding = watch, binding
        self.process_group = process_group
        self.overflow = OverflowLog()
        self.sync_found_inf = True
        self.steps_applied = self.steps_skipped = self.retries = 0
        self.unscaled = self.found_inf = self.last_step_skipped = False
        self.grad_max: float | None = None
        self.compressor: GradCompressor | None = None
        """A gradient compressor whose state is kept only for applied steps (``strategy.powersgd``)."""
        self.replicas: ReplicaWatch | None = None
        """The replica check told each agreed verdict (``strategy.check_replicas_every``)."""

    @property
    def step_number(self) -> int:
        """Steps completed (applied or skipped)."""
        return self.steps_applied + self.steps_skipped

    def _group(self) -> dist.ProcessGroup | None:
        return data_parallel_group(self.process_group) if self.sync_found_inf else None

    def unscale_and_check(self) -> None:
        """Unscale, check and agree on the verdict (once per step)."""
        if not self.watch.backward_pending:
            # The gradients came from a plain loss.backward() (or another optimizer's optimizer.backward).
            self.binding.note_plain_backward()
        self.binding.check_grads_reduced(data_parallel_group(self.process_group), self.binding_params())
        self.watch.before_unscale()
        with named_collective(f"the inf/NaN verdict all-reduce of step {self.step_number + 1}"):
            self.found_inf, self.grad_max = self.precision.unscale_and_check(self._group())
        self.unscaled = True

    def attribute_overflow(self, retrying: bool, ran_at: float | None = None) -> None:
        """Name the parameters whose reduced gradient is non-finite (skipped or retried steps only).

        ``ran_at`` is the loss scale the overflowing attempt ran at, when the
        scale was lowered since (a retry); ``None``: the current scale.
        """
        params = self.binding_params()
        names = [self.binding.name_of(p, i) for i, p in enumerate(params)]
        # Under sharding the reduced gradients live in each rank's FP32 slice, not in .grad; in O2 a merge
        # window's earlier micro-batches may sit in an FP32 sum the step adds (either may hold the inf).
        grads = list(self.precision.master_weights.reduced_grads())
        sums = self.precision.merge_sums()
        if sums:
            index = {id(p): i for i, p in enumerate(params)}
            grads += [(index[key], total) for key, total in sums.items() if key in index]
        with named_collective(f"the overflow attribution of step {self.step_number + 1}"):
            bad = nonfinite_parameters(params, names, self._group(), grads)
        # Read before the scale update: whether this overflow can still lower the scale (as the stuck-scale check).
        scaler = self.precision.scaler
        scale_falls = scaler is not None and scaler.can_decrease
        loss_scale = self.precision.loss_scale if ran_at is None else ran_at
        self.overflow.record(self.step_number + 1, bad, loss_scale, retrying=retrying, scale_falls=scale_falls)

    def binding_params(self) -> list[torch.nn.Parameter]:
        """The model parameters, in the masters' order."""
        return self.precision.master_weights.model_params

    def step(self) -> bool:
        """``optimizer.step()``: see :meth:`distamp.optim.optimizer.AmpOptimizer.step`."""
        if self.merge.is_accumulating:
            self.last_step_skipped = False  # nothing was skipped, whatever the last window's verdict
            return False
        self.watch.refuse_cleared()
        if not self.unscaled and not self.watch.before_step(self.precision.loss_scale):
            self.last_step_skipped = True
            return False
        if not self.unscaled:
            self.unscale_and_check()
        return self.finish()

    def step_with_closure(self, closure: Callable[[], Any], retries: int) -> Any:
        """``optimizer.step(closure)``: run the closure, then decide as ``step()`` does; returns its loss.

        An overflowing step is retried up to ``retries`` times at a lower
        loss scale. A closure that produced no new gradients (it never called
        ``optimizer.backward``) is treated like ``step()`` without gradients:
        a warning, nothing applied or counted, ``step_was_skipped`` True.
        """
        if self.merge.k_steps > 1:
            raise RuntimeError(
                "step(closure) runs one micro-batch per call and cannot close a gradient-merge window of "
                f"k_steps={self.merge.k_steps}; call optimizer.backward(loss) per micro-batch and step() instead"
            )
        if self.unscaled:
            raise RuntimeError(
                "step(closure) was called after the gradients were unscaled (by clip_grad_norm_ or unscale_); "
                "with a closure, clip inside it after optimizer.backward(loss), or call step() without one"
            )
        while True:
            with torch.enable_grad():
                loss = closure()
            self.watch.refuse_cleared()
            if not self.unscaled:  # else the closure unscaled itself (clip_grad_norm_ after its backward)
                if not self.watch.before_step(self.precision.loss_scale):
                    self.last_step_skipped = True
                    return loss
                self.unscale_and_check()
            ran_at = self.precision.loss_scale
            if not self.found_inf or retries == 0 or not self.precision.lower_scale_now():
                break
            retries -= 1
            self.retries += 1
            self.attribute_overflow(retrying=True, ran_at=ran_at)
            if self.compressor is not None:  # the closure's next backward starts from the kept state
                self.compressor.discard_attempt()
            self.unscaled = False
            self.watch.after_step()  # the retried closure must call optimizer.backward again
        self.finish()
        return loss

    def resolve_compressor(self, applied: bool) -> None:
        """Tell the compressor the agreed verdict: commit its tentative state, or drop it (the same on every rank)."""
        if self.compressor is not None:
            self.compressor.resolve(applied)

    def finish(self) -> bool:
        """Apply or skip on the agreed verdict, count, update the scale; True when applied."""
        found_inf = self.found_inf
        if self.replicas is not None:  # before the update: what this step's forward and backward ran with
            self.replicas.on_verdict(applied=not found_inf, step=self.step_number + 1)
        if found_inf:
            self.attribute_overflow(retrying=False)
        else:
            self.precision.take_user_grad_changes()
            self.precision.apply_update(self.inner_opt)
        self.resolve_compressor(applied=not found_inf)
        self.unscaled = False
        self.merge.reset()
        self.last_step_skipped = found_inf
        if found_inf:
            self.steps_skipped += 1
        else:
            self.steps_applied += 1
        self.precision.update(found_inf, self.grad_max)
        self.precision.end_step()
        self.watch.after_step()
        self.merge.publish()
        return not found_inf
