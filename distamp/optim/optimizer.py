"""The AMP meta-optimizer: one training-step loop for AMP off, O1 and O2.

:class:`AmpOptimizer` wraps any ``torch.optim.Optimizer`` the way Paddle
Fleet's AMP meta-optimizer wraps an inner optimizer; it is what
``fleet.distributed_optimizer`` returns. What differs between the precision
modes lives in :mod:`distamp.core.precision`, gradient merge in
:mod:`distamp.optim.accumulation`, misuse detection in
:mod:`distamp.optim.grad_watch`, what is learnt from the model in
:mod:`distamp.optim.model_binding`, overflow attribution in
:mod:`distamp.scaling.overflow`, checkpoint state in :mod:`distamp.optim.state`,
unscaling and clipping on request in :mod:`distamp.optim.grad_clipping`, and
the read-only status API (loss scale, counters, ``stats()``) in
:mod:`distamp.optim.amp_status`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import BlackModulesHandle
from distamp.core.attached import GradCompressor
from distamp.core.master_weights import MasterWeights
from distamp.core.precision import FullPrecision
from distamp.distributed.ddp_errors import explain_ddp_errors
from distamp.distributed.groups import data_parallel_group, group_size
from distamp.distributed.timeouts import named_collective
from distamp.model_views import fp32_model_state_dict, unwrap_model
from distamp.optim.accumulation import GradientMerge
from distamp.optim.amp_status import AmpStatus
from distamp.optim.autocast_watch import AutocastWatch
from distamp.optim.delegating import DelegatingOptimizer
from distamp.optim.first_forward import FirstForwardFinder
from distamp.optim.grad_clipping import GradClipper
from distamp.optim.grad_watch import GradWatch
from distamp.optim.model_binding import ModelBinding
from distamp.optim.precision_choice import precision_for
from distamp.optim.replica_watch import ReplicaWatch
from distamp.optim.state import load_optimizer_state, optimizer_state
from distamp.optim.step_policy import StepPolicy
from distamp.sharding.dtensor_state import reshard_loaded
from distamp.strategy import DistributedStrategy
from distamp.user_warning import warn_user

__all__ = ["AmpOptimizer"]


class AmpOptimizer(AmpStatus, DelegatingOptimizer):
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
    model) or skips it, naming the parameters whose gradient overflowed;
    finally it updates the loss scale once.

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
        super().__init__(optimizer)
        strategy = strategy if strategy is not None else DistributedStrategy()
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}")
        self.strategy = strategy
        self.amp_enabled: bool = bool(strategy.amp)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.precision: FullPrecision = precision_for(strategy, params, data_parallel_group(process_group))
        self.take_over_inner()
        self.precision.master_weights.install(optimizer)  # masters (or this rank's slices) replace the params
        self.merge = GradientMerge.from_strategy(strategy)
        self.binding = ModelBinding(self.master_weights, strategy.amp_config, self.amp_enabled,
                                    lambda: self.policy.step_number + 1)
        # Sharded masters' FP32 gradient slice counts the backward passes no .grad shows (stage 2).
        slices: Any = getattr(self.master_weights, "grads", None)
        deliveries = (lambda: slices.deliveries) if hasattr(slices, "deliveries") else (lambda: 0)
        self._watch = GradWatch(self.master_weights.model_params, deliveries)
        self._warned_slices = False
        self.policy = StepPolicy(optimizer, self.precision, self.merge, self._watch, self.binding, process_group)
        self.clipper = GradClipper(self.precision, self.policy, self.merge)
        self.replicas = ReplicaWatch(strategy.check_replicas_every, self.precision, self.binding,
                                     lambda: self.policy.steps_applied, process_group)
        self.policy.replicas = self.replicas
        o1 = self.amp_enabled and not strategy.amp_config.use_pure_fp16
        self._autocast_watch = AutocastWatch(o1, strategy.amp_config.dtype)
        # Alone, the optimizer sees parameters, not modules: learn the model at its first forward.
        self._finder: FirstForwardFinder | None = FirstForwardFinder(self)
        # Compressor state loaded before fleet.distributed_model built the compressor (see bind_compressor).
        self._pending_compressor_state: dict | None = None

    def __repr__(self) -> str:
        mode = self.precision.mode
        if mode != "off":
            mode = f"{mode} {self.strategy.amp_config.dtype}"
        return f"AmpOptimizer(amp={mode}, inner={self.inner_opt!r})"

    def fp32_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """``model.state_dict()`` with each parameter as an exact FP32 copy of its master.

        In O2 the model holds 16-bit weights and the FP32 values live here;
        this is the model to export for FP32 inference or fine-tuning. A
        ``fleet.distributed_model`` wrapper is looked through (keys without
        ``module.``).
        """
        self.finish_param_gather()
        return fp32_model_state_dict(unwrap_model(model), [self.master_weights])

    def adopt_model(self, model: nn.Module, keep_fp32: list[nn.Parameter], *, reduces_grads: bool = True,
                    black_modules: BlackModulesHandle | None = None,
                    torch_ddp: DistributedDataParallel | None = None) -> None:
        """The model is known (``fleet.distributed_model``, or its first forward); see :class:`ModelBinding`.

        Args:
            model: the user's model.
            keep_fp32: its parameters that O2 keeps in FP32.
            reduces_grads: whether a data-parallel wrapper all-reduces its
                gradients (``fleet.distributed_model``, torch's DDP).
            black_modules: the ``custom_black_varnames`` modules switched to
                FP32 for this optimizer (kept as long as the optimizer lives).
            torch_ddp: torch's own DDP wrapper around ``model``, when that is
                what reduces the gradients.
        """
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        self.binding.adopt(model, keep_fp32, reduces_grads=reduces_grads, black_modules=black_modules,
                           torch_ddp=torch_ddp)
        self.replicas.watch_model(model)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward of ``loss * scale`` (divided by K inside a gradient-merge window).

        ``kwargs`` go to ``Tensor.backward``.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        self.finish_param_gather()
        if self.policy.unscaled:
            raise RuntimeError(
                "backward() called after the gradients were unscaled (by clip_grad_norm_ or "
                "unscale_) but before step(); call step() first"
            )
        self._autocast_watch.before_backward(loss)
        compressor = self.policy.compressor
        if compressor is not None and not self._watch.kept_since_backward():
            # Not accumulating onto what an earlier backward of this step communicated: PowerSGD must not
            # add that communication's residual to fresh gradients.
            compressor.gradients_replaced()
        self.merge.count_backward()
        if self.merge.loss_divisor != 1:
            loss = loss / self.merge.loss_divisor
        with (named_collective(f"the gradient all-reduce of step {self.policy.step_number + 1} (in backward)"),
              explain_ddp_errors()):
            self.precision.scale_loss(loss).backward(**kwargs)
        # Inside torch DDP's no_sync() the gradient stays in .grad: the next synced backward reduces .grad only.
        window_open = self.merge.is_accumulating and not self.binding.backward_stays_local()
        self.precision.after_backward(window_open=window_open)
        self._watch.after_backward(self.precision.loss_scale)
        self.binding.note_backward()
        self.merge.publish()

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
        again. Under sharding stages 1 and 2 on several ranks ``.grad`` holds
        this rank's slice only (stage 2: no ``.grad`` at all), which a torch
        clip would measure as the whole: this warns once, pointing at
        :meth:`clip_grad_norm_`.
        """
        self.finish_param_gather()
        self.clipper.unscale_()
        if self.precision.grads_are_slices and not self._warned_slices:
            self._warned_slices = True
            warn_user(
                "optimizer.unscale_() under sharding: the model's .grad holds only this rank's slice of the unscaled "
                "gradients (zeros elsewhere with stage 1, no .grad at all with stage 2), so "
                "torch.nn.utils.clip_grad_norm_(model.parameters()) would clip by a partial norm (stage 1) or "
                "nothing (stage 2). Clip with optimizer.clip_grad_norm_(max_norm): it combines every rank's "
                "slice into the global norm."
            )

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the unscaled gradients the inner optimizer applies to ``max_norm``; returns their total norm.

        Unscales once (the following ``step()`` does not unscale again). The
        norm is computed in FP32 on the (reduced, hence identical) gradients,
        so it is the same on every rank; when the step is going to be skipped
        (inf/NaN on any rank) nothing is clipped and the norm is ``inf``.
        """
        self.finish_param_gather()
        return self.clipper.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """True under AMP: torch's ``GradScaler.step`` then calls :meth:`step`, which refuses it, instead of unscaling.

        distamp scales the loss itself, so a ``GradScaler`` kept from a torch
        AMP loop is a mistake: :meth:`step` sees the ``grad_scale`` it sets
        and raises with the fix. Without this, in O2 ``GradScaler`` found no
        gradient on the FP32 masters and failed inside torch ("No inf checks
        were recorded for this optimizer"), and in O1 BF16 (scale 1) the step
        went on with its scaled gradients. With AMP off a ``GradScaler`` the
        loop drives itself unscales the model's gradients as for any optimizer.
        """
        return self.amp_enabled

    def _refuse_grad_scaler(self) -> None:
        if self.__dict__.pop("grad_scale", None) is None:
            return
        self.__dict__.pop("found_inf", None)
        raise RuntimeError(
            "optimizer.step() was called by a torch.amp.GradScaler (scaler.step(optimizer)), but with "
            "strategy.amp on distamp scales the loss itself. Drop the GradScaler: optimizer.backward(loss) replaces "
            "scaler.scale(loss).backward(), and optimizer.step() replaces scaler.step(optimizer) and "
            "scaler.update(); optimizer.unscale_() and optimizer.clip_grad_norm_(max_norm) replace "
            "scaler.unscale_(optimizer) before clipping."
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model and master gradients.

        Inside a gradient-merge window it does nothing, so the usual
        ``zero_grad(); forward; minimize(loss)`` loop keeps accumulating.
        """
        if not self.merge.is_accumulating:
            self.master_weights.zero_grads(set_to_none)
            self._watch.cleared()

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's name for :meth:`zero_grad` (``set_to_zero=False`` frees them)."""
        self.zero_grad(set_to_none=not set_to_zero)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply the update on every rank, or skip it on every rank.

        Returns True when the inner optimizer stepped, False when the step
        was skipped because a gradient was inf/NaN on some rank (or, with
        ``gradient_merge``, when the window is not complete yet, or when
        there was nothing new to apply).

        With a ``closure`` (which zeroes the gradients, runs the forward
        under ``fleet.auto_cast()``, calls ``optimizer.backward(loss)`` and
        returns the loss), it returns the closure's loss, as torch's
        optimizers do; ``step_was_skipped`` tells whether it was applied.
        The closure runs once per call (and once more per retry), with AMP
        on or off; optimizers that evaluate a closure several times per step
        (``torch.optim.LBFGS``) are not supported (refused when wrapped).
        With ``amp_configs["overflow_retries"] = N`` an overflowing step
        lowers the loss scale at once and calls the closure again, up to N
        times, on every rank together, so the batch is not dropped.

        Under sharding stage 3 a step that was applied or skipped frees the
        gradient shards (``.grad`` is ``None`` after it, as DeepSpeed's
        engine zeroes the gradients after its step).
        """
        self._refuse_grad_scaler()
        self.finish_param_gather()
        steps_before = self.policy.step_number
        if closure is not None:
            retries = self.strategy.amp_config.overflow_retries if self.amp_enabled else 0
            result = self.policy.step_with_closure(closure, retries)
        else:
            result = self.policy.step()
        if self.policy.step_number != steps_before:
            self._autocast_watch.after_step()
        return result

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (converted to FP32 masters in O2).

        Raises:
            ValueError: a parameter is in another param group already (as
                torch's optimizers refuse it).
            RuntimeError: O2 on several ranks after the data-parallel wrapper
                was built on the parameters' dtypes, for a parameter of the
                model that would be stored in 16 bits; on several ranks, a
                parameter that is not the data-parallel model's (nothing would
                reduce its gradient); or sharding stages 1 and 2 (the slices
                are cut when the optimizer is built).
        """
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._check_new_params(params)
        group["params"] = self.master_weights.add(params)
        self.inner_opt.add_param_group(group)
        self._watch.track(params)

    def _check_new_params(self, params: list[torch.Tensor]) -> None:
        """Refuse what :meth:`add_param_group` cannot add, before anything changes (see there)."""
        managed = {id(p): i for i, p in enumerate(self.master_weights.model_params)}
        again = [self.binding.name_of(p, managed[id(p)]) for p in params if id(p) in managed]
        if again:
            raise ValueError(
                f"some parameters appear in more than one parameter group: {again} are in this optimizer "
                "already. Give each parameter to one group only (torch's optimizers refuse it too)."
            )
        self.binding.check_owned(params, data_parallel_group(self.policy.process_group),
                                 start=len(self.master_weights.model_params))
        weights = self.master_weights
        if not (weights.enabled and isinstance(weights, MasterWeights) and self.binding.reduces_grads
                and group_size(data_parallel_group(self.policy.process_group)) > 1):
            return
        to_low = [self.binding.name_of(p, -1) for p in params
                  if p.dtype == torch.float32 and self.binding.owns(p) and not weights.keeps_fp32(p)]
        if to_low:
            raise RuntimeError(
                f"add_param_group() with use_pure_fp16 after the model's data-parallel wrapper was built: {to_low} "
                f"would be stored in {self.strategy.amp_config.dtype}, but the wrapper reduces their gradients in "
                "FP32 buckets it built on the parameters' dtypes. Give every param group to the inner optimizer's "
                "constructor (or add it) before fleet.distributed_model."
            )

    def state_dict(self) -> dict:
        """Inner state, FP32 masters, loss scaler and counters, as tensors and numbers.

        Loadable with ``torch.load(path, weights_only=True)``. Hooks from
        ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook``
        run around it, as around torch's ``Optimizer.state_dict``.
        """
        self.finish_param_gather()
        return self._with_state_dict_hooks(lambda: optimizer_state(self))

    def local_state_dict(self) -> dict:
        """:meth:`state_dict` as this rank holds it: at sharding stage 3, its own shards and their layout.

        Not collective at stage 3 (nothing is gathered, unlike
        :meth:`state_dict`); at the other stages the same as
        :meth:`state_dict`. :meth:`load_state_dict` takes it back on the same
        rank of the same world size; checkpoints re-slice it for any other.
        """
        self.finish_param_gather()
        return self._with_state_dict_hooks(lambda: optimizer_state(self, local=True))

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` (or, on its own rank, :meth:`local_state_dict`) saved; the model copies
        are refreshed too."""
        self.finish_param_gather()
        self._with_load_hooks(state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict) -> None:
        load_optimizer_state(self, state_dict)
        self.replicas.follow_step_count()

    def finish_param_gather(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Complete the all-gather of updated parameters that ``overlap_param_gather`` left running.

        For ``params`` only (the rounds up to the last one that writes them),
        or for every parameter (``None``). Collective: every rank makes the
        same calls. A no-op when nothing is running (unsharded, or without
        ``sharding_configs["overlap_param_gather"]``). ``step``, ``backward``,
        ``unscale_``, ``clip_grad_norm_``, ``state_dict``, ``load_state_dict``,
        ``fp32_state_dict`` and checkpoints call it first; the forward
        pre-hooks of ``fleet.distributed_model`` call it per module.
        """
        self.master_weights.finish_refresh(params)

    def grads_reseated(self) -> None:
        """The model's ``.grad`` tensors were replaced by equal ones (``fleet.distributed_model`` calls it).

        DDP rebuilds its buckets at the first forward after the first
        backward, and each ``.grad`` then views a new bucket; without this the
        check that ``step()`` has new gradients would take them for new ones.
        """
        self._watch.reseated()

    def grads_await_step(self) -> bool:
        """Whether the gradients of the last ``backward`` wait for ``step()`` with no backward of theirs to come.

        True after a backward until the next step, except inside a
        gradient-merge window, whose next micro-batch makes the model's
        ``.grad`` again (``fleet.distributed_model`` asks before freeing them).
        """
        return self._watch.backward_pending and not self.merge.is_accumulating

    def defer_param_gather(self, deferred: bool) -> bool:
        """Let ``step()`` leave its parameter all-gather running for forward hooks to finish (or stop it).

        Called by ``fleet.distributed_model`` when it installs (``True``) or
        removes (``False``) the forward hooks that finish the gather module by
        module. Returns whether this optimizer overlaps its gather at all
        (``sharding_configs["overlap_param_gather"]``); when it does not, this
        is a no-op. Stopping finishes whatever is still running.
        """
        if not self.precision.hook_param_gather(deferred):
            return False
        if not deferred:
            self.finish_param_gather()
        return True

    def bind_compressor(self, compressor: GradCompressor) -> None:
        """Report each step's agreed verdict to ``compressor`` (``fleet.distributed_model`` with ``strategy.powersgd``).

        The compressor reads the loss scale from here, keeps the state a
        step computed only when the step is applied, and gets any
        compressor state :meth:`load_state_dict` loaded before it was bound.

        Raises:
            RuntimeError: the compressor already has an optimizer.
        """
        compressor.bind(lambda: self.precision.loss_scale)
        self.policy.compressor = compressor
        if self._pending_compressor_state is not None:
            compressor.load_state_dict(self._pending_compressor_state)
            self._pending_compressor_state = None

    def adopt_sharded_parameters(self, new_of: dict[int, nn.Parameter]) -> None:
        """Follow ``fully_shard`` (sharding stage 3): ``new_of[id(old)]`` replaced parameter ``old``.

        ``fleet.distributed_model`` calls it when this optimizer was built
        before the model was sharded: the inner optimizer's param groups (and
        any state it already has: Adagrad's sums made at construction, a
        state loaded before sharding) move to the DTensor parameters, each
        whole state tensor cut into this rank's shard (no collective).

        Raises:
            RuntimeError: this optimizer is not a stage-3 one.
        """
        self.precision.follow_sharded_parameters(new_of)
        for group in self.inner_opt.param_groups:
            # In place: some optimizers keep a reference to the list.
            group["params"][:] = [new_of.get(id(p), p) for p in group["params"]]
        old_state = dict(self.inner_opt.state)
        if any(id(p) in new_of for p in old_state):
            self.inner_opt.state.clear()
            for p, s in old_state.items():
                self.inner_opt.state[new_of.get(id(p), p)] = s
            reshard_loaded(self.inner_opt)
        self._watch.params = [new_of.get(id(p), p) for p in self._watch.params]
        self._watch.after_step()

    def watch_local_grads(self, named_params: list[tuple[str, torch.Tensor]]) -> None:
        """``check_nan_inf`` under stage 3: check these (unsharded) parameters' local gradients too.

        FSDP2 computes each gradient on the unsharded parameter of the
        moment, not on the sharded one the model lists, so
        ``fleet.distributed_model`` passes those here after its first forward.
        """
        checker = self.binding.checker
        if checker is not None:
            checker.watch_grads(named_params)

    def add_sync_listener(self, listener: Any) -> None:
        """Keep ``listener.set_grad_sync(optimizer, flag)`` told whether the next backward communicates.

        A listener with ``backward_communicates()`` (the ``fleet.distributed_model`` wrappers) is asked
        after each backward, so that ``step()`` refuses gradients a ``no_sync()`` backward left unreduced.
        """
        self.merge.add_listener(listener, self)
        if hasattr(listener, "backward_communicates"):
            self.binding.watch_sync(listener)
