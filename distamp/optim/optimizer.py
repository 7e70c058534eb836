"""The AMP meta-optimizer: one training-step loop for AMP off, O1 and O2.

:class:`AmpOptimizer` wraps any ``torch.optim.Optimizer`` the way Paddle
Fleet's AMP meta-optimizer wraps an inner optimizer; it is what
``fleet.distributed_optimizer`` returns. What differs between the precision
modes lives in :mod:`distamp.optim.precision`, gradient merge in
:mod:`distamp.optim.accumulation`, misuse detection in
:mod:`distamp.optim.grad_watch`.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.amp.fp32_parameters import NORM_LAYER_TYPES
from distamp.distributed.groups import data_parallel_group
from distamp.optim.accumulation import GradientMerge
from distamp.optim.first_forward import FirstForwardFinder
from distamp.optim.grad_watch import GradWatch
from distamp.optim.master_weights import MasterWeights, fp32_model_state_dict
from distamp.optim.precision import FullPrecision, precision_for
from distamp.strategy import DistributedStrategy
from distamp.wrappers import unwrap_model

__all__ = ["AmpOptimizer"]

logger = logging.getLogger("distamp")

_STATE_FORMAT = "distamp.AmpOptimizer/1"


class AmpOptimizer(torch.optim.Optimizer):
    """Mixed-precision meta-optimizer around an inner ``torch.optim.Optimizer``.

    Built by ``fleet.distributed_optimizer``; a training loop uses it like
    this::

        optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters()), strategy)
        model = fleet.distributed_model(model)
        for x, y in loader:
            with fleet.auto_cast():
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            optimizer.backward(loss)          # loss * scale, then backward
            optimizer.clip_grad_norm_(1.0)    # optional: on unscaled gradients
            if optimizer.step():              # False: skipped on every rank
                scheduler.step()

    What ``step()`` does, in order: (O2) copies the gradients into the FP32
    masters, unscales and checks them for inf/NaN in one fused kernel
    (``torch._amp_foreach_non_finite_check_and_unscale_``), all-reduces the
    verdict (MAX) over the data-parallel group, then on every rank either
    runs the inner step (and, in O2, copies the masters back into the
    model) or skips it; finally it updates the loss scale once.

    Args:
        optimizer: the inner optimizer, built on the model's parameters.
        strategy: ``amp``, ``amp_configs`` and ``gradient_merge`` settings.
        process_group: group over which the verdict is synchronised;
            ``None`` means the default group when torch.distributed is
            initialised.

    Notes:
        ``step()`` reads the verdict on the host (one device sync per step,
        as ``torch.amp.GradScaler`` does) so that it can return whether the
        update was applied.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: DistributedStrategy | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: the
        # param_groups, state and defaults are the inner optimizer's.
        if isinstance(optimizer, AmpOptimizer):
            raise TypeError("optimizer is already an AmpOptimizer; wrap the inner optimizer only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        strategy = strategy if strategy is not None else DistributedStrategy()
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}")
        self.inner_opt = optimizer
        self.strategy = strategy
        self.amp_enabled: bool = bool(strategy.amp)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.precision: FullPrecision = precision_for(strategy, params, data_parallel_group(process_group))
        self.precision.master_weights.install(optimizer)  # masters (or this rank's slices) replace the params
        self.merge = GradientMerge.from_strategy(strategy)
        self._watch = GradWatch(self.precision.master_weights.model_params)
        self._process_group = process_group
        self.sync_found_inf = True  # tests switch this off to show what the sync prevents
        self.steps_applied = 0
        self.steps_skipped = 0
        self._unscaled = False
        self._found_inf = False
        self._grad_max: float | None = None
        self._last_step_skipped = False
        self._sync_listeners: weakref.WeakSet = weakref.WeakSet()
        # O2 alone sees parameters, not modules: learn the model at its first forward.
        self._finder = FirstForwardFinder(self) if self.master_weights.enabled else None

    # ------------------------------------------------------------------
    # torch.optim.Optimizer surface, delegated to the inner optimizer
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (FP32 masters in O2)."""
        return self.inner_opt.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state (keyed by master)."""
        return self.inner_opt.state

    @property
    def defaults(self) -> dict:
        """The inner optimizer's defaults."""
        return self.inner_opt.defaults

    def register_step_pre_hook(self, hook: Callable) -> Any:
        """Register a hook that runs before the inner optimizer's step."""
        return self.inner_opt.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable) -> Any:
        """Register a hook that runs after the inner optimizer's step."""
        return self.inner_opt.register_step_post_hook(hook)

    def __getstate__(self) -> dict:
        raise TypeError("AmpOptimizer is not picklable; save optimizer.state_dict() instead")

    def __repr__(self) -> str:
        mode = self.precision.mode
        if mode != "off":
            mode = f"{mode} {self.strategy.amp_config.dtype}"
        return f"AmpOptimizer(amp={mode}, inner={self.inner_opt!r})"

    # ------------------------------------------------------------------
    # public AMP API
    @property
    def master_weights(self) -> MasterWeights:
        """The model-parameter / master pairing (masters are params in O1)."""
        return self.precision.master_weights

    @property
    def loss_scaler(self) -> Any:
        """The loss scaler (``None`` when AMP is off)."""
        return self.precision.scaler

    def get_loss_scaling(self) -> float:
        """The current loss scale (1.0 when AMP is off or with BF16)."""
        return self.precision.loss_scale

    @property
    def loss_scale(self) -> float:
        """Same as :meth:`get_loss_scaling`."""
        return self.get_loss_scaling()

    @property
    def step_was_skipped(self) -> bool:
        """True when the last completed ``step()`` found inf/NaN and skipped."""
        return self._last_step_skipped

    @property
    def is_accumulating(self) -> bool:
        """True inside a gradient-merge window, before its last micro-batch."""
        return self.merge.is_accumulating

    def will_sync_next_backward(self) -> bool:
        """Whether the next ``backward`` closes a gradient-merge window (and communicates)."""
        return self.merge.sync_next_backward

    def stats(self) -> dict[str, float | int]:
        """Counters a training loop can log: applied/skipped steps and the scale."""
        return {
            "steps_applied": self.steps_applied,
            "steps_skipped": self.steps_skipped,
            "loss_scale": self.get_loss_scaling(),
        }

    def fp32_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``model.state_dict()`` with each parameter as an exact FP32 copy of its master.

        In O2 the model holds 16-bit weights and the FP32 values live here;
        this is the model to export for FP32 inference or fine-tuning. A
        ``fleet.distributed_model`` wrapper is looked through (keys without
        ``module.``).
        """
        return fp32_model_state_dict(unwrap_model(model), [self.master_weights])

    def adopt_model(self, model: nn.Module, keep_fp32: list[nn.Parameter]) -> None:
        """O2: the model is known; store ``keep_fp32`` in FP32 (from their exact masters).

        Called by ``fleet.distributed_model`` with the normalization layers'
        and ``custom_black_varnames`` modules' parameters, or at the model's
        first forward when there is no data-parallel wrapper. With
        ``keep_norm_fp32=False`` the normalization layers' floating buffers
        (BatchNorm running statistics) go to 16 bits with their parameters,
        as ``model.half()`` would do. A no-op in O1 and with AMP off.
        """
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        if not self.master_weights.enabled:
            return
        self.master_weights.convert_model(keep_fp32=keep_fp32)
        if not self.strategy.amp_config.keep_norm_fp32:
            low, kept = self.strategy.amp_config.torch_dtype, {id(p) for p in keep_fp32}
            for module in model.modules():
                if isinstance(module, NORM_LAYER_TYPES) and not any(id(p) in kept for p in module.parameters()):
                    for name, buffer in module.named_buffers(recurse=False):
                        if buffer.is_floating_point():
                            setattr(module, name, buffer.to(low))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss * scale`` (divided by K inside a gradient-merge window).

        ``kwargs`` go to ``Tensor.backward``.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        if self._unscaled:
            raise RuntimeError(
                "backward() called after the gradients were unscaled (by clip_grad_norm_ or "
                "unscale_) but before step(); call step() first"
            )
        self.merge.count_backward()
        if self.merge.loss_divisor != 1:
            loss = loss / self.merge.loss_divisor
        self.precision.scale_loss(loss).backward(**kwargs)
        self.precision.after_backward(window_open=self.merge.is_accumulating)
        self._watch.after_backward(self.precision.loss_scale)
        self._publish_sync()

    def minimize(self, loss: torch.Tensor) -> bool:
        """``backward(loss)`` then ``step()``; returns what ``step()`` returns.

        With ``gradient_merge`` it only steps after the K-th call.
        """
        self.backward(loss)
        return self.step()

    def unscale_(self) -> None:
        """Unscale the gradients now and decide on the step (once per step).

        Afterwards the model's ``.grad`` hold the unscaled gradients (in O2
        rounded to 16 bits from the FP32 masters), so a loop can inspect or
        clip them with torch's own tools (``torch.nn.utils.clip_grad_norm_``);
        what it changes is applied. The following ``step()`` does not unscale
        again.
        """
        if self.merge.is_accumulating:
            raise RuntimeError(
                f"unscale_()/clip_grad_norm_() called in the middle of a gradient-merge window "
                f"(micro-batch {self.merge.micro_steps} of {self.merge.k_steps}); call it only "
                "before the step that completes the window"
            )
        if not self._unscaled:
            self._unscale_and_check()
            if not self._found_inf:
                self.precision.expose_unscaled_grads()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the unscaled gradients the inner optimizer applies to ``max_norm``; returns their total norm.

        Unscales once (the following ``step()`` does not unscale again). The
        norm is computed in FP32 on the (reduced, hence identical) gradients,
        so it is the same on every rank; when the step is going to be skipped
        (inf/NaN on any rank) nothing is clipped and the norm is ``inf``.
        """
        if not self._unscaled:
            self.unscale_()
        grads_owner = [m for m in self.master_weights.masters if m.grad is not None]
        if self._found_inf:
            device = grads_owner[0].device if grads_owner else torch.device("cpu")
            return torch.full((), math.inf, device=device)
        return self.precision.clip_grad_norm_(
            grads_owner, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model and master gradients.

        Inside a gradient-merge window it does nothing, so the usual
        ``zero_grad(); forward; minimize(loss)`` loop keeps accumulating.
        """
        if self.merge.is_accumulating:
            return
        grads = []
        for p in self.master_weights.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                grads.append(p.grad)
        if grads:
            torch._foreach_zero_(grads)
        self.master_weights.zero_master_grads()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's name for :meth:`zero_grad` (``set_to_zero=False`` frees them)."""
        self.zero_grad(set_to_none=not set_to_zero)

    def step(self, closure: Callable | None = None) -> bool:
        """Apply the update on every rank, or skip it on every rank.

        Returns True when the inner optimizer stepped, False when the step
        was skipped because a gradient was inf/NaN on some rank (or, with
        ``gradient_merge``, when the window is not complete yet, or when
        there was nothing new to apply).
        """
        if closure is not None and self.amp_enabled:
            raise RuntimeError(
                "step(closure) is not supported with AMP: the loss must be scaled before "
                "backward. Call optimizer.backward(loss) then optimizer.step()"
            )
        if self.merge.is_accumulating:
            return False
        if closure is None and not self._unscaled and not self._watch.before_step(self.precision.loss_scale):
            return False
        if not self._unscaled:
            self._unscale_and_check()
        found_inf, grad_max = self._found_inf, self._grad_max
        if not found_inf:
            self.precision.take_user_grad_changes()
            self.inner_opt.step(closure) if closure is not None else self.inner_opt.step()
            self.precision.after_applied_step()
        self._unscaled = False
        self.merge.reset()
        self._record(found_inf, grad_max)
        self._watch.after_step()
        self._publish_sync()
        return not found_inf

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (converted to FP32 masters in O2)."""
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self.master_weights.add(params)
        self.inner_opt.add_param_group(group)
        self._watch.track(params)

    # ------------------------------------------------------------------
    # checkpoints
    def state_dict(self) -> dict:
        """Inner state, FP32 masters, loss scaler and counters, as tensors and numbers.

        Loadable with ``torch.load(path, weights_only=True)``.
        """
        precision = self.precision.state_dict()
        sharding = {"sharding": precision["sharding"]} if "sharding" in precision else {}
        return {
            **sharding,
            "format": _STATE_FORMAT,
            "inner": self.inner_opt.state_dict(),
            "master_weights": precision.get("master_weights", []),
            "loss_scaler_type": precision["loss_scaler_type"],
            "loss_scaler": precision["loss_scaler"],
            "counters": {
                "steps_applied": self.steps_applied,
                "steps_skipped": self.steps_skipped,
                "consecutive_stuck": getattr(self.precision, "consecutive_stuck", 0),
                "micro_steps": self.merge.micro_steps,
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved; the model copies are refreshed too."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _STATE_FORMAT:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a distamp AmpOptimizer state_dict (keys: {keys}); to load a bare torch "
                "optimizer's state use optimizer.inner_opt.load_state_dict(...)"
            )
        masters = state_dict["master_weights"]
        if bool(masters) != self.master_weights.enabled:
            raise ValueError(
                "checkpoint and optimizer disagree on use_pure_fp16 (O2 master weights "
                f"{'present' if masters else 'absent'} in the checkpoint); build the optimizer "
                "with the strategy the checkpoint was saved with"
            )
        self.precision.load_state_dict(state_dict)
        self.inner_opt.load_state_dict(state_dict["inner"])
        if masters:
            self.master_weights.load_state_dict(masters)
        counters = state_dict["counters"]
        self.steps_applied = int(counters["steps_applied"])
        self.steps_skipped = int(counters["steps_skipped"])
        if hasattr(self.precision, "consecutive_stuck"):
            self.precision.consecutive_stuck = int(counters["consecutive_stuck"])
        self.merge.micro_steps = int(counters["micro_steps"])
        self._unscaled = False
        self._watch.after_step()
        self._publish_sync()

    # ------------------------------------------------------------------
    # data-parallel models following the merge window
    def add_sync_listener(self, listener: Any) -> None:
        """Tell ``listener.set_grad_sync(optimizer, flag)`` whether the next backward communicates.

        ``fleet.distributed_model`` registers its model, so DDP all-reduces
        only on the last micro-batch of a gradient-merge window.
        """
        self._sync_listeners.add(listener)
        listener.set_grad_sync(self, self.merge.sync_next_backward)

    def _publish_sync(self) -> None:
        flag = self.merge.sync_next_backward
        for listener in list(self._sync_listeners):
            listener.set_grad_sync(self, flag)

    # ------------------------------------------------------------------
    # internals
    def _unscale_and_check(self) -> None:
        self._watch.before_unscale()
        group = data_parallel_group(self._process_group) if self.sync_found_inf else None
        self._found_inf, self._grad_max = self.precision.unscale_and_check(group)
        self._unscaled = True

    def _record(self, found_inf: bool, grad_max: float | None) -> None:
        """Count the step, log a skip, update the scale (which may raise when it is stuck)."""
        self._last_step_skipped = found_inf
        if found_inf:
            self.steps_skipped += 1
            logger.info(
                "step %d skipped: inf/NaN in gradients (loss scale %g)",
                self.steps_applied + self.steps_skipped, self.precision.loss_scale,
            )
        else:
            self.steps_applied += 1
        self.precision.update(found_inf, grad_max)
