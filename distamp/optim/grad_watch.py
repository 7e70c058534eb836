"""Noticing gradients that changed behind the meta-optimizer's back.

Three habits from plain PyTorch silently break a scaled-loss loop:

* ``loss.backward()`` instead of ``optimizer.backward(loss)``: the loss was
  never scaled, yet ``step()`` divides by the scale, so every update is
  ~32768 times too small. :meth:`GradWatch.before_step` raises.
* ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.unscale_()``: it
  clips *scaled* gradients (norm ~1e4 or inf), so updates are clipped to
  nothing. :meth:`GradWatch.before_unscale` logs a warning once (a log line,
  not a Python warning: tests that put an inf into a gradient on purpose
  change it too).
* ``step()`` with nothing new since the last one: it would count (and, for
  some optimizers, apply again) a step. :meth:`GradWatch.before_step` warns
  once and the step is not taken.
* ``zero_grad()`` between ``optimizer.backward(loss)`` and ``step()``: the
  step would count as applied while applying nothing (or, at some stages,
  zeros with momentum and weight decay). :meth:`GradWatch.refuse_cleared`
  raises, as torch's ``GradScaler`` does ("No inf checks were recorded").

Gradients are compared by identity and version counter; a check is one
pass over the parameters. Identity is a stamp the snapshot writes into each
gradient's ``__dict__`` (a tensor made later, e.g. by a plain backward after
``zero_grad()``, has none), not a reference: a strong one would keep freed
gradients alive, and a weak one makes ``torch.utils.swap_tensors`` refuse
the gradient, which ``model.to(...)`` of an FSDP2 (sharding stage 3) model
swaps.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from torch import nn

from distamp.torch_compat import tensor_version
from distamp.user_warning import warn_user

__all__ = ["GradWatch"]

logger = logging.getLogger("distamp")

_Snapshot = tuple[int, int, list[int | None]]
"""``(deliveries, stamp, per parameter: its gradient's version, None without one)``."""

_STAMP = "_distamp_grad_watch"  # the gradient's attribute: {snapshot slot: the stamp it last wrote}
_stamps = itertools.count(1)  # one per snapshot, process-wide, so no two snapshots ever share one
_slots = itertools.count()


class GradWatch:
    """Snapshots of the model gradients at backward and at step.

    Args:
        params: the model parameters whose ``.grad`` the optimizer applies.
        deliveries: a count of backward passes whose gradients reached the
            optimizer without any ``.grad`` (sharding stage 2 frees them);
            a change counts as new gradients.
    """

    def __init__(self, params: Iterable[nn.Parameter], deliveries: Callable[[], int] = lambda: 0) -> None:
        self.params = list(params)
        self._deliveries = deliveries
        # Each kind of snapshot stamps the gradients in its own slot: the two are compared independently.
        self._backward_slot, self._step_slot = next(_slots), next(_slots)
        self._backward_since_step = False
        self._after_backward: _Snapshot | None = None
        self._scaled_backward = False
        self._cleared_after_backward = False
        self._after_step = self._snapshot(self._step_slot)
        self._warned: set[str] = set()

    def track(self, params: Iterable[nn.Parameter]) -> None:
        """Watch more parameters (``add_param_group``)."""
        self.params.extend(params)
        self._after_step = self._snapshot(self._step_slot)

    def _snapshot(self, slot: int) -> _Snapshot:
        stamp = next(_stamps)
        versions: list[int | None] = []
        for p in self.params:
            grad = p.grad
            if grad is None:
                versions.append(None)
                continue
            grad.__dict__.setdefault(_STAMP, {})[slot] = stamp
            versions.append(tensor_version(grad))
        return self._deliveries(), stamp, versions

    def _unchanged_since(self, snapshot: _Snapshot, slot: int) -> bool:
        # strict=False: track() (add_param_group) may append parameters after the snapshot was taken;
        # those have no earlier state to compare, so only the snapshotted prefix is checked.
        deliveries, stamp, versions = snapshot
        if deliveries != self._deliveries():
            return False
        for p, seen in zip(self.params, versions, strict=False):
            grad = p.grad
            if grad is None:
                if seen is not None:
                    return False
            elif seen is None or seen != tensor_version(grad) or grad.__dict__.get(_STAMP, {}).get(slot) != stamp:
                return False
        return True

    def _once(self, key: str) -> bool:
        first = key not in self._warned
        self._warned.add(key)
        return first

    def after_backward(self, loss_scale: float) -> None:
        """``optimizer.backward`` finished (gradients communicated)."""
        self._backward_since_step = True
        self._cleared_after_backward = False
        self._after_backward = self._snapshot(self._backward_slot)
        self._scaled_backward = loss_scale != 1.0

    def cleared(self) -> None:
        """``optimizer.zero_grad()`` cleared the gradients (outside a gradient-merge window)."""
        self._cleared_after_backward = self._backward_since_step

    def refuse_cleared(self) -> None:
        """Raise if the last backward's gradients were cleared before this step could apply them.

        Either ``optimizer.zero_grad()`` ran after it, or every gradient it
        left on the model is ``None`` now (``model.zero_grad()``). Checked
        before any collective of the step, so every rank that cleared
        raises alike.

        Raises:
            RuntimeError: the gradients of the last ``optimizer.backward`` were cleared.
        """
        if not self._backward_since_step:
            return
        if self._cleared_after_backward:
            how = "optimizer.zero_grad()"
        elif self._after_backward is not None and self._all_gone(self._after_backward):
            how = "a zero_grad() (model.zero_grad() or setting .grad to None)"
        else:
            return
        raise RuntimeError(
            f"optimizer.step() after {how}: the gradients of the last optimizer.backward(loss) were "
            "cleared before step() applied them, so this step would apply none of that backward yet count as a "
            "step (torch's GradScaler refuses this order too: \"No inf checks were recorded for this "
            "optimizer\"). Call optimizer.zero_grad() before optimizer.backward(loss) or after "
            "optimizer.step(), as in `optimizer.zero_grad(); optimizer.backward(loss); optimizer.step()`."
        )

    def _all_gone(self, snapshot: _Snapshot) -> bool:
        """Whether every gradient ``snapshot`` saw (at least one) is None now, with nothing delivered since."""
        deliveries, _, versions = snapshot
        if deliveries != self._deliveries():
            return False
        saw_one = False
        for p, seen in zip(self.params, versions, strict=False):  # strict=False: as in _unchanged_since
            if seen is not None:
                if p.grad is not None:
                    return False  # the usual case: stops at the first gradient
                saw_one = True
        return saw_one

    @property
    def backward_pending(self) -> bool:
        """Whether an ``optimizer.backward`` ran since the last step (its gradients wait for ``step()``)."""
        return self._backward_since_step

    def kept_since_backward(self) -> bool:
        """True when a backward ran since the last step and no gradient changed after it (accumulation goes on)."""
        return (self._backward_since_step and self._after_backward is not None
                and self._unchanged_since(self._after_backward, self._backward_slot))

    def before_unscale(self) -> None:
        """Warn once if scaled gradients were changed between backward and unscaling."""
        if (not self._scaled_backward or self._after_backward is None
                or self._unchanged_since(self._after_backward, self._backward_slot)):
            return
        if self._once("scaled"):
            logger.warning(
                "the gradients changed after optimizer.backward() while still multiplied by the loss scale. If "
                "that was gradient clipping (torch.nn.utils.clip_grad_norm_), it clipped scaled values: call "
                "optimizer.unscale_() before clipping, or use optimizer.clip_grad_norm_(max_norm)."
            )

    def before_step(self, loss_scale: float) -> bool:
        """Whether ``step()`` has something to apply; raises on an unscaled backward under scaling.

        Raises:
            RuntimeError: the gradients changed since the last step without
                ``optimizer.backward`` while the loss scale is not 1.
        """
        if self._backward_since_step:
            return True
        if self._unchanged_since(self._after_step, self._step_slot):
            if self._once("nothing"):
                warn_user(
                    "optimizer.step() found no new gradients since the last step, so it did nothing and "
                    "returned False (with a closure: returned the closure's loss, step_was_skipped True). "
                    "Call optimizer.backward(loss) (or optimizer.minimize(loss)) before each step(); a "
                    "closure must call optimizer.backward(loss) itself."
                )
            return False
        if loss_scale != 1.0:
            raise RuntimeError(
                f"optimizer.step() found gradients that did not come from optimizer.backward(loss): with the "
                f"loss scale at {loss_scale:g}, a plain loss.backward() leaves them unscaled and step() would "
                f"divide them by the scale (a torch.amp.GradScaler's scaler.scale(loss).backward() scales them by "
                f"its own scale, not distamp's). Replace loss.backward() with optimizer.backward(loss) (or call "
                f"optimizer.minimize(loss)); distamp scales the loss itself, so drop any GradScaler."
            )
        return True

    def reseated(self) -> None:
        """The ``.grad`` tensors were replaced by equal ones (in a forward, before any new backward).

        What was unchanged since the last step (or backward) still is, so the
        snapshot follows the new tensors. A gradient cleared to None stays
        None, so that change is still seen; one zeroed in place in the same
        window (between the job's first backward and its next forward) is not.
        """
        if not self._backward_since_step:
            self._after_step = self._snapshot(self._step_slot)
        elif self._after_backward is not None:
            present = [v is not None for v in self._after_backward[2]]
            if present == [p.grad is not None for p in self.params[: len(present)]]:
                self._after_backward = self._snapshot(self._backward_slot)

    def after_step(self) -> None:
        """A step was taken (or skipped for inf/NaN): start watching for the next backward."""
        self._backward_since_step = False
        self._cleared_after_backward = False
        self._after_backward = None
        self._scaled_backward = False
        self._after_step = self._snapshot(self._step_slot)
