"""The AMP meta-optimizer: loss scaling, FP32 masters and lockstep skipping.

:class:`AmpOptimizer` wraps any ``torch.optim.Optimizer`` the way Paddle
Fleet's AMP meta-optimizer wraps an inner optimizer. It is what
``fleet.distributed_optimizer`` returns.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from distamp.optim.loss_scaler import LossScaler, build_loss_scaler
from distamp.optim.master_weights import MasterWeights
from distamp.strategy import DistributedStrategy, GradientMergeConfig

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

    What ``step()`` does, in order: moves gradients to the FP32 masters (O2),
    unscales them and checks them for inf/NaN in one fused kernel
    (``torch._amp_foreach_non_finite_check_and_unscale_``), all-reduces the
    found-inf flag (MAX) over the data-parallel group, then on every rank
    either runs the inner step and copies the masters back into the model,
    or skips it; finally it updates the loss scale once.

    Args:
        optimizer: the inner optimizer, built on the model's parameters.
        strategy: ``amp``, ``amp_configs`` and ``gradient_merge`` settings.
        keep_fp32: parameters that must stay FP32 in O2 (parameters of
            modules matched by ``custom_black_varnames``).
        process_group: group over which the found-inf flag is synchronised;
            ``None`` means the default group when torch.distributed is
            initialised.

    Notes:
        ``step()`` reads the found-inf flag on the host (one device sync per
        step, as ``torch.amp.GradScaler`` does) so that it can return
        whether the update was applied.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: DistributedStrategy | None = None,
        *,
        keep_fp32: Iterable[nn.Parameter] = (),
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is deliberately not called: the
        # param_groups, state and defaults are the inner optimizer's.
        if isinstance(optimizer, AmpOptimizer):
            raise TypeError("optimizer is already an AmpOptimizer; wrap the inner optimizer only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        strategy = strategy if strategy is not None else DistributedStrategy()
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(
                f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}"
            )
        self.inner_opt = optimizer
        self.strategy = strategy
        self.amp_enabled: bool = bool(strategy.amp)
        self._amp_config = strategy.amp_config
        self._merge: GradientMergeConfig = (
            strategy.gradient_merge_config if strategy.gradient_merge else GradientMergeConfig()
        )
        self._process_group = process_group
        self.sync_found_inf = True  # tests switch this off to show what the sync prevents

        pure = self.amp_enabled and self._amp_config.use_pure_fp16
        keep_ids = {id(p) for p in keep_fp32}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._master = MasterWeights(
            params, self._amp_config.torch_dtype if pure else None, lambda p: id(p) in keep_ids
        )
        if self._master.enabled:
            self._swap_params_for_masters()

        self.loss_scaler: LossScaler | None = (
            build_loss_scaler(self._amp_config) if self.amp_enabled else None
        )
        self.steps_applied = 0
        self.steps_skipped = 0
        self._consecutive_stuck = 0
        self._micro_steps = 0
        self._unscaled = False
        self._found_inf = False
        self._grad_max: float | None = None
        self._last_step_skipped = False

    # ------------------------------------------------------------------
    # torch.optim.Optimizer surface, delegated to the inner optimizer
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param groups (FP32 masters in O2)."""
        return self.inner_opt.param_groups

    @property
    def state(self):
        """The inner optimizer's per-parameter state (keyed by master)."""
        return self.inner_opt.state

    @property
    def defaults(self) -> dict:
        """The inner optimizer's defaults."""
        return self.inner_opt.defaults

    def register_step_pre_hook(self, hook: Callable):
        """Register a hook that runs before the inner optimizer's step."""
        return self.inner_opt.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable):
        """Register a hook that runs after the inner optimizer's step."""
        return self.inner_opt.register_step_post_hook(hook)

    def __getstate__(self) -> dict:
        raise TypeError(
            "AmpOptimizer is not picklable; save optimizer.state_dict() instead"
        )

    def __repr__(self) -> str:
        mode = "off"
        if self.amp_enabled:
            level = "O2" if self._amp_config.use_pure_fp16 else "O1"
            mode = f"{level} {self._amp_config.dtype}"
        return f"AmpOptimizer(amp={mode}, inner={self.inner_opt!r})"

    # ------------------------------------------------------------------
    # public AMP API
    @property
    def master_weights(self) -> MasterWeights:
        """The model-parameter / master pairing (masters are params in O1)."""
        return self._master

    def get_loss_scaling(self) -> float:
        """The current loss scale (1.0 when AMP is off or with BF16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

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
        return self._merge.k_steps > 1 and 0 < self._micro_steps < self._merge.k_steps

    def will_sync_next_backward(self) -> bool:
        """Whether the next ``backward`` closes a gradient-merge window.

        The data-parallel model asks this in ``forward`` so DDP communicates
        only on the last micro-batch of each window.
        """
        return self._micro_steps + 1 >= self._merge.k_steps

    def stats(self) -> dict[str, float | int]:
        """Counters a training loop can log: applied/skipped steps and the scale."""
        return {
            "steps_applied": self.steps_applied,
            "steps_skipped": self.steps_skipped,
            "loss_scale": self.get_loss_scaling(),
        }

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Backward of ``loss * scale`` (in FP32). ``kwargs`` go to ``Tensor.backward``."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        if self._unscaled:
            raise RuntimeError(
                "backward() called after the gradients were unscaled (by clip_grad_norm_ or "
                "unscale_) but before step(); call step() first"
            )
        if self._micro_steps >= self._merge.k_steps:
            # A window is full but step() was not called: keep counting windows.
            self._micro_steps = 0
        self._micro_steps += 1
        if self.amp_enabled:
            (loss.float() * self.loss_scaler.scale).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def minimize(self, loss: torch.Tensor) -> bool:
        """``backward(loss)`` then ``step()``; returns what ``step()`` returns.

        With ``gradient_merge`` it only steps after the K-th call.
        """
        self.backward(loss)
        return self.step()

    def unscale_(self) -> None:
        """Unscale the gradients now and decide on the step (once per step).

        Lets a loop inspect or clip true gradients before ``step()``; the
        following ``step()`` does not unscale again.
        """
        if self.is_accumulating:
            raise RuntimeError(
                f"unscale_()/clip_grad_norm_() called in the middle of a gradient-merge window "
                f"(micro-batch {self._micro_steps} of {self._merge.k_steps}); call it only "
                "before the step that completes the window"
            )
        if not self._unscaled:
            self._unscale_and_check()

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the unscaled master gradients to ``max_norm``; returns their total norm.

        Unscales once (the following ``step()`` does not unscale again).
        Gradients are identical on every rank after the all-reduce, so the
        norm is too; when the step is going to be skipped (inf/NaN found on
        any rank) nothing is clipped and the norm returned is ``inf`` on
        every rank.
        """
        self.unscale_()
        grads_owner = [m for m in self._master.masters if m.grad is not None]
        if self._found_inf:
            device = grads_owner[0].device if grads_owner else torch.device("cpu")
            return torch.full((), math.inf, device=device)
        return torch.nn.utils.clip_grad_norm_(
            grads_owner, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model and master gradients.

        Inside a gradient-merge window it does nothing, so the usual
        ``zero_grad(); forward; minimize(loss)`` loop keeps accumulating.
        """
        if self.is_accumulating:
            return
        grads = []
        for p in self._master.model_params:
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
        self._master.zero_master_grads()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's name for :meth:`zero_grad` (``set_to_zero=False`` frees them)."""
        self.zero_grad(set_to_none=not set_to_zero)

    def step(self, closure: Callable | None = None) -> bool:
        """Apply the update on every rank, or skip it on every rank.

        Returns True when the inner optimizer stepped, False when the step
        was skipped because a gradient was inf/NaN on some rank (or, with
        ``gradient_merge``, when the window is not complete yet).
        """
        if closure is not None and self.amp_enabled:
            raise RuntimeError(
                "step(closure) is not supported with AMP: the loss must be scaled before "
                "backward. Call optimizer.backward(loss) then optimizer.step()"
            )
        if self.is_accumulating:
            return False
        if not self.amp_enabled:
            if self._merge.k_steps > 1 and self._merge.avg:
                self._scale_grads(1.0 / self._merge.k_steps)
            self.inner_opt.step(closure)
            self._micro_steps = 0
            self.steps_applied += 1
            self._last_step_skipped = False
            return True

        if not self._unscaled:
            self._unscale_and_check()
        found_inf, grad_max = self._found_inf, self._grad_max
        if not found_inf:
            self.inner_opt.step()
            self._master.copy_masters_to_model()
        self._unscaled = False
        self._micro_steps = 0
        self._record(found_inf, grad_max)
        return not found_inf

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (converted to FP32 masters in O2)."""
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._master.add(params) if self._master.enabled else params
        self.inner_opt.add_param_group(group)

    # ------------------------------------------------------------------
    # checkpoints
    def state_dict(self) -> dict:
        """Inner state, FP32 masters, loss scaler and counters, as tensors and numbers.

        Loadable with ``torch.load(path, weights_only=True)``.
        """
        return {
            "format": _STATE_FORMAT,
            "inner": self.inner_opt.state_dict(),
            "master_weights": self._master.state_dict() if self._master.enabled else [],
            "loss_scaler_type": self._scaler_type,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else {},
            "counters": {
                "steps_applied": self.steps_applied,
                "steps_skipped": self.steps_skipped,
                "consecutive_stuck": self._consecutive_stuck,
                "micro_steps": self._micro_steps,
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
        saved_type = state_dict["loss_scaler_type"]
        own_type = self._scaler_type
        if saved_type != own_type:
            raise ValueError(
                f"checkpoint was saved with loss scaler {saved_type or 'none'!r} but this "
                f"optimizer uses {own_type or 'none'!r}; build it with the same amp_configs"
            )
        masters = state_dict["master_weights"]
        if bool(masters) != self._master.enabled:
            raise ValueError(
                "checkpoint and optimizer disagree on use_pure_fp16 (O2 master weights "
                f"{'present' if masters else 'absent'} in the checkpoint); build the optimizer "
                "with the strategy the checkpoint was saved with"
            )
        self.inner_opt.load_state_dict(state_dict["inner"])
        if masters:
            self._master.load_state_dict(masters)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        counters = state_dict["counters"]
        self.steps_applied = int(counters["steps_applied"])
        self.steps_skipped = int(counters["steps_skipped"])
        self._consecutive_stuck = int(counters["consecutive_stuck"])
        self._micro_steps = int(counters["micro_steps"])
        self._unscaled = False

    # ------------------------------------------------------------------
    # internals
    @property
    def _scaler_type(self) -> str:
        """The loss scaler's class name as saved in checkpoints ("" without AMP)."""
        return type(self.loss_scaler).__name__ if self.loss_scaler else ""

    def _swap_params_for_masters(self) -> None:
        """Put the masters in the inner optimizer where the model params were."""
        old_state = dict(self.inner_opt.state)
        for group in self.inner_opt.param_groups:
            # Mutate in place: some optimizers keep a reference to the list.
            group["params"][:] = [self._master.master_for(p) for p in group["params"]]
        if old_state:
            self.inner_opt.state.clear()
            for p, s in old_state.items():
                self.inner_opt.state[self._master.master_for(p)] = {
                    k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                    for k, v in s.items()
                }

    def _data_parallel_group(self) -> dist.ProcessGroup | None:
        if self._process_group is not None:
            return self._process_group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def _scale_grads(self, factor: float) -> None:
        grads = [m.grad for m in self._master.masters if m.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def _unscale_and_check(self) -> None:
        """Unscale into the masters, check for inf/NaN and agree on the flag.

        O1: one fused kernel (``torch._amp_foreach_non_finite_check_and_unscale_``)
        unscales and checks the FP32 gradients in place. O2: the same kernel
        checks the model's 16-bit gradients where they are (multiplying them by
        exactly 1), the flag's all-reduce starts, and the copy into the FP32
        masters and their unscaling run while it is in flight. Either way every
        rank waits for the all-reduced (MAX) flag before deciding.
        """
        model_grads = [p.grad for p in self._master.model_params if p.grad is not None]
        if any(g.is_sparse for g in model_grads):
            raise TypeError("sparse gradients are not supported by the AMP optimizer")
        divisor = self._merge.k_steps if (self._merge.k_steps > 1 and self._merge.avg) else 1
        # Like GradScaler: the reciprocal in double, rounded once to float32.
        inv_scale = 1.0 / (self.loss_scaler.scale * divisor)
        separate_masters = self._master.enabled
        device = model_grads[0].device if model_grads else self._any_device()
        flag = torch.zeros(2, dtype=torch.float32, device=device)
        for (dev, _), grads in _by_device_and_dtype(model_grads).items():
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            factor = torch.full((1,), 1.0 if separate_masters else inv_scale, dtype=torch.float32, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, factor)
            flag[0] += found.to(device)[0]
        if self.loss_scaler.needs_grad_max and model_grads:
            largest = torch.stack([torch.stack(torch.aminmax(g)).abs().max().float().to(device) for g in model_grads])
            flag[1] = largest.max() * (inv_scale if separate_masters else 1.0)

        group = self._data_parallel_group()
        work = None
        if self.sync_found_inf and group is not None and dist.get_world_size(group) > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if separate_masters:
            self._master.copy_grads_to_masters()
            if inv_scale != 1.0:
                master_grads = [m.grad for m in self._master.masters if m.grad is not None]
                for (dev, _), grads in _by_device_and_dtype(master_grads).items():
                    torch._foreach_mul_(grads, torch.full((), inv_scale, dtype=torch.float32, device=dev))
        if work is not None:
            work.wait()
        found_inf, grad_max = flag.tolist()
        self._found_inf = found_inf > 0 or math.isnan(found_inf)
        self._grad_max = grad_max if self.loss_scaler.needs_grad_max else None
        self._unscaled = True

    def _any_device(self) -> torch.device:
        params = self._master.model_params
        return params[0].device if params else torch.device("cpu")

    def _record(self, found_inf: bool, grad_max: float | None) -> None:
        """Update the scale, counters and log; raise when the scale is stuck."""
        scaler = self.loss_scaler
        before = scaler.scale
        could_decrease = scaler.can_decrease
        scaler.update(found_inf, grad_max)
        after = scaler.scale
        self._last_step_skipped = found_inf
        if found_inf:
            self.steps_skipped += 1
        else:
            self.steps_applied += 1
        step = self.steps_applied + self.steps_skipped
        if found_inf:
            logger.info("step %d skipped: inf/NaN in gradients (loss scale %g)", step, before)
        if after != before:
            logger.info("step %d: loss scale %g -> %g", step, before, after)
        if found_inf and not could_decrease:
            self._consecutive_stuck += 1
        else:
            self._consecutive_stuck = 0
        patience = self._amp_config.stuck_scale_patience
        if self._consecutive_stuck >= patience:
            hint = (
                "Use strategy.amp_configs = {..., 'dtype': 'bfloat16'} (BF16 has FP32's range), "
                "or lower min_loss_scaling"
                if self._amp_config.dtype == "float16"
                else "The model produces inf/NaN even in BF16: check the data, the learning "
                "rate and the loss"
            )
            raise RuntimeError(
                f"the loss scale is stuck at {after:g}: {self._consecutive_stuck} consecutive steps "
                f"overflowed while the scale could not go lower (min_loss_scaling="
                f"{self._amp_config.min_loss_scaling:g}), so training is not making progress. "
                + hint
            )


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Group tensors for the foreach kernels, which need one device and dtype per call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
