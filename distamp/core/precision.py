"""Precision plugins: what the meta-optimizer does with AMP off, in O1 and in O2.

:class:`~distamp.optim.optimizer.AmpOptimizer` runs the same loop in every
mode (scale the loss, backward, unscale and check, agree on the verdict,
step or skip, update the scale); a plugin supplies the parts that differ,
as Lightning's precision plugins do:

* :class:`FullPrecision` (``amp=False``): nothing is scaled, checked or
  skipped: a pass-through.
* :class:`MixedPrecision` (O1): FP32 parameters, a loss scaler, and the
  fused unscale + inf/NaN check on the parameters' gradients.
* :class:`PureLowPrecision` (O2): 16-bit model parameters with FP32 masters;
  gradients are copied into FP32 chunk by chunk for the same check and for
  the masters' update, and updated masters are copied back.

:func:`~distamp.optim.precision_choice.precision_for` picks one from a
strategy (with ``strategy.sharding``,
:class:`~distamp.sharding.sharded_precision.ShardedPrecision`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distamp.core.chunked_update import (
    CheckedGrads,
    as_one_step,
    check_in_chunks,
    chunk_limit,
    holds_rounding_of,
    step_in_chunks,
    step_only,
    steps_in_chunks,
)
from distamp.core.grad_accumulator import Fp32GradAccumulator
from distamp.core.master_weights import MasterWeights, MasterWeightsSurface
from distamp.core.reused_leaf_grads import accumulate_reused_leaf_grads_in_place
from distamp.distributed.flag_sync import all_reduce_max
from distamp.scaling.loss_scaler import LossScaler, build_loss_scaler
from distamp.strategy import AmpConfig, DistributedStrategy
from distamp.torch_compat import amp_foreach_non_finite_check_and_unscale_, foreach_copy_, foreach_norm, tensor_version
from distamp.user_warning import warn_user

__all__ = ["FullPrecision", "MixedPrecision", "PureLowPrecision", "o2_dtype_error_hint"]

logger = logging.getLogger("distamp")


def o2_dtype_error_hint(strategy: DistributedStrategy, exc: RuntimeError) -> str | None:
    """The fix for torch's bare dtype error in an O2 forward, or ``None`` when ``exc`` is not one.

    Either the forward ran outside ``fleet.auto_cast()``, or, inside it, an
    op met FP32 inputs with 16-bit weights: one that autocast does not cast
    for this device, or one in a region where the forward switched autocast
    off (which the error no longer shows: it was left on the way out).
    """
    cfg = strategy.amp_config
    message = str(exc).lower()
    if not (strategy.amp and cfg.use_pure_fp16) or "type" not in message:
        return None
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda") if t == "cpu" or torch.cuda.is_available()):
        # "same type as": embedding_bag's check of per_sample_weights against its weight.
        if not any(words in message for words in ("dtype", "scalar type", "same type as")):
            return None
        return (
            f"distamp: with use_pure_fp16 the model's weights are {cfg.dtype}, and autocast casts FP32 inputs "
            "only for the ops on torch's lists for this device, and only where it is on. Either an op outside "
            "those lists (on CPU e.g. F.bilinear) met FP32 inputs: add it to amp_configs['custom_white_list'] "
            f"(it then runs in {cfg.dtype}), or its module to amp_configs['custom_black_varnames'] (it then runs "
            "in FP32). Or the forward switched autocast off around a module with 16-bit weights "
            "(torch.autocast(..., enabled=False), fleet.auto_cast(enable=False), a "
            "torch.amp.custom_fwd(cast_inputs=torch.float32) function): to run that module in FP32, list it in "
            "amp_configs['custom_black_varnames'] (its weights then stay FP32), or cast its inputs to "
            f"{cfg.dtype}."
        )
    return (
        f"distamp: with use_pure_fp16 the model's weights are {cfg.dtype} while its inputs are FP32; run the "
        "forward under `with fleet.auto_cast():`, which casts the inputs of matmuls and convolutions."
    )


class FullPrecision:
    """AMP off: gradients are applied as they are, every step.

    Args:
        params: the parameters the inner optimizer was built on.
        config: the strategy's AMP settings (unused here).
    """

    mode = "off"
    stage = 0  # sharding stage: 0 none, 1-2 flat slices (sharding.ShardedPrecision), 3 DTensor shards (FSDP2)
    scaler: LossScaler | None = None

    def __init__(self, params: Sequence[nn.Parameter], config: AmpConfig) -> None:
        self.config = config
        self.master_weights: MasterWeightsSurface = MasterWeights(params, None)
        self.consecutive_stuck = 0

    @property
    def loss_scale(self) -> float:
        """The loss scale (1.0: nothing is scaled)."""
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on."""
        return loss

    def unscale_and_check(self, group: dist.ProcessGroup | None) -> tuple[bool, float | None]:
        """Unscale the gradients the inner optimizer sees; returns (found_inf on any rank, grad max).

        ``group`` is the group to agree over; ``None``: decide locally.
        """
        return False, None

    def after_backward(self, window_open: bool) -> None:
        """After each ``backward``; ``window_open``: a gradient-merge window continues after it."""

    def clip_grad_norm_(self, grads: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the unscaled ``grads`` the inner optimizer applies; returns their total norm."""
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def expose_unscaled_grads(self) -> None:
        """After ``unscale_()``: make the model's ``.grad`` hold what ``step()`` will apply."""

    def take_user_grad_changes(self) -> None:
        """Before the inner step: adopt changes the user made to the exposed gradients."""

    def after_applied_step(self) -> None:
        """After the inner optimizer stepped."""

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` on the unscaled gradients (the verdict was finite), then :meth:`after_applied_step`."""
        optimizer.step()
        self.after_applied_step()

    def end_step(self) -> None:
        """After a step was applied or skipped (the scale updated): the gradients stay until ``zero_grad``."""

    def merge_sums(self) -> dict[int, torch.Tensor] | None:
        """After :meth:`unscale_and_check`: ``{id(param): FP32 sum}`` of a gradient-merge window's earlier
        micro-batches that this step adds to the gradients and ``.grad`` does not hold (O2), else None."""
        return None

    @property
    def grads_are_slices(self) -> bool:
        """Whether the model's ``.grad`` holds only this rank's slice after unscaling (stages 1-2, several ranks)."""
        return False

    def follow_sharded_parameters(self, new_of: dict[int, nn.Parameter]) -> None:
        """Stage 3's ``fully_shard`` replaced each parameter ``old`` by ``new_of[id(old)]``: hold the new ones.

        Raises:
            RuntimeError: this plugin does not shard parameters (the
                optimizer's strategy is not stage 3).
        """
        raise RuntimeError(
            "fleet.distributed_model sharded the parameters (sharding stage 3), but this optimizer was built "
            "with another strategy; pass the same strategy (sharding_configs={'stage': 3}) to both calls"
        )

    def checkpoint_state(self, inner_opt: torch.optim.Optimizer, local: bool) -> tuple[dict, dict]:
        """``(this plugin's state, the inner optimizer's state)`` as an optimizer state dict holds them.

        ``local`` asks for this rank's own part where the plugin shards state
        (stage 3's ``local_state_dict``); unsharded plugins give the whole.
        """
        return self.state_dict(), inner_opt.state_dict()

    def checkpoint_layout(self, param_groups: Sequence[dict]) -> tuple[list[list[int]], dict | None]:
        """``(groups, sharding)``: where this rank's optimizer state lies, for checkpoints that re-slice it.

        ``groups``: each param group's parameters as indices into
        ``master_weights.model_params``; ``sharding``: None when this rank
        holds the whole state, else the layout of its part as plain numbers
        (world size, rank, parameter sizes and shapes, and the flat slice
        bounds or per-parameter ranges every rank holds), the one its
        ``state_dict`` records under ``"sharding"``.

        Args:
            param_groups: the inner optimizer's param groups.
        """
        return self.group_indices(param_groups), None

    def group_indices(self, param_groups: Sequence[dict]) -> list[list[int]]:
        """Each of ``param_groups``' parameters (masters) as its index into ``master_weights.masters``."""
        index = {id(m): i for i, m in enumerate(self.master_weights.masters)}
        return [[index[id(p)] for p in group["params"]] for group in param_groups]

    def load_checkpoint_state(self, inner_opt: torch.optim.Optimizer, state: dict) -> None:
        """Restore :meth:`checkpoint_state`'s output (an optimizer state dict): scaler, inner state, O2 masters."""
        self.load_state_dict(state)
        inner_opt.load_state_dict(state["inner"])
        if state["master_weights"]:
            self.master_weights.load_state_dict(state["master_weights"])

    def hook_param_gather(self, deferred: bool) -> bool:
        """Whether the all-gather after a step may be left to the model's forward hooks (now: ``deferred``).

        False unless the plugin overlaps its gather
        (``sharding_configs["overlap_param_gather"]``, stages 1-2).
        """
        return False

    def update(self, found_inf: bool, grad_max: float | None) -> None:
        """Advance the loss scale by one optimizer step."""

    def lower_scale_now(self) -> bool:
        """Lower the loss scale at once (an overflow retry); False when it cannot go lower."""
        return False

    def state_dict(self) -> dict:
        """Scaler type and state as plain numbers."""
        return {"loss_scaler_type": "", "loss_scaler": {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (checked against this plugin's scaler).

        A state saved with a scaler that holds nothing (BF16's fixed 1.0, or
        AMP off) loads into one that does, and the other way round: the
        dtype or ``amp`` changed, as the stuck-scale error advises, and this
        plugin's scaler keeps its configured start (with a warning).

        Raises:
            ValueError: both scalers hold state but of different kinds
                (backoff, log-normal, static).
        """
        if self._carries_scaler_state(state["loss_scaler_type"]) and self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])

    def _carries_scaler_state(self, saved: str) -> bool:
        """Whether a state saved with loss scaler ``saved`` restores this plugin's; False (with a warning) when
        the precision changed between a scaler with state and one without.

        Raises:
            ValueError: both hold state, of different kinds.
        """
        own = self.scaler_kind
        if saved == own:
            return True
        if saved not in _STATELESS_SCALERS and own not in _STATELESS_SCALERS:
            raise ValueError(
                f"checkpoint was saved with loss scaler {saved or 'none'!r} but this optimizer uses "
                f"{own or 'none'!r}; build it with the same amp_configs (use_dynamic_loss_scaling, "
                "loss_scaling_algorithm) to resume the scale"
            )
        start = f"starts at {self.scaler.scale:g} as configured" if self.scaler is not None else "is not used"
        warn_user(
            f"the loaded optimizer state was saved with loss scaler {saved or 'none (amp off)'!r} and this "
            f"optimizer uses {own or 'none (amp off)'!r} (amp or amp_configs['dtype'] changed): the weights and "
            f"the inner optimizer's state load as saved; the loss scale {start}."
        )
        return False

    @property
    def scaler_kind(self) -> str:
        """The ``loss_scaler_type`` this plugin's states record: the scaler's class name, "" with AMP off."""
        return type(self.scaler).__name__ if self.scaler is not None else ""


class MixedPrecision(FullPrecision):
    """O1: FP32 parameters, scaled loss, fused unscale and inf/NaN check.

    The check is torch's ``_amp_foreach_non_finite_check_and_unscale_``, one
    kernel per device and dtype, exactly as ``torch.amp.GradScaler.unscale_``
    runs it, so O1 is bitwise ``torch.autocast`` + ``GradScaler``. The
    verdict (and, for the log-normal scaler, the gradient maximum) is then
    all-reduced with MAX over the data-parallel group.
    """

    mode = "O1"

    def __init__(self, params: Sequence[nn.Parameter], config: AmpConfig) -> None:
        super().__init__(params, config)
        self.scaler = build_loss_scaler(config)

    @property
    def _amp_scaler(self) -> LossScaler:
        """The loss scaler, which O1 and O2 always have (ShardedPrecision with AMP off never gets here)."""
        scaler = self.scaler
        if scaler is None:
            raise RuntimeError("no loss scaler: AMP is off")
        return scaler

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._amp_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in FP32 (as ``GradScaler.scale``)."""
        return loss.float() * self._amp_scaler.scale

    def _grads_to_check(self) -> list[torch.Tensor]:
        return [p.grad for p in self.master_weights.masters if p.grad is not None]

    def unscale_and_check(self, group: dist.ProcessGroup | None) -> tuple[bool, float | None]:
        """Unscale in place, check for inf/NaN, all-reduce the verdict; one host sync.

        Raises:
            TypeError: a gradient is sparse.
        """
        grads = self._grads_to_check()
        if any(g.is_sparse for g in grads):
            raise TypeError("sparse gradients are not supported by the AMP optimizer; use dense gradients")
        device = grads[0].device if grads else self._any_device()
        flags = torch.zeros(2, dtype=torch.float32, device=device)
        # Like GradScaler: the reciprocal in double, rounded once to float32.
        inv_scale = 1.0 / self._amp_scaler.scale
        by_dtype = _by_device_and_dtype(grads)
        if any(dtype == torch.float16 for _, dtype in by_dtype):
            raise ValueError(
                "O1 got FP16 gradients: the model was converted to FP16 (model.half(), model.to(torch.float16)) "
                "after the optimizer was built, and O1 would update those weights in FP16 with no FP32 master "
                "(torch's GradScaler refuses FP16 gradients too). Keep the model in FP32 for O1, or build the "
                "optimizer with amp_configs['use_pure_fp16'] = True for FP16 weights with FP32 masters"
            )
        for (dev, _), group_grads in by_dtype.items():
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            factor = torch.full((1,), inv_scale, dtype=torch.float32, device=dev)
            amp_foreach_non_finite_check_and_unscale_(group_grads, found, factor)
            flags[0] += found.to(device)[0]
        if self._amp_scaler.needs_grad_max and grads:
            flags[1] = _max_abs(grads).to(device)
        all_reduce_max(flags, group)
        found_inf, grad_max = flags.tolist()
        return found_inf > 0, (grad_max if self._amp_scaler.needs_grad_max else None)

    def _any_device(self) -> torch.device:
        params = self.master_weights.model_params
        return params[0].device if params else torch.device("cpu")

    def update(self, found_inf: bool, grad_max: float | None) -> None:
        """Update the scale; raise when it is stuck at its minimum while steps keep overflowing.

        Raises:
            RuntimeError: ``stuck_scale_patience`` consecutive steps overflowed
                with the scale unable to go lower.
        """
        before, could_decrease = self._amp_scaler.scale, self._amp_scaler.can_decrease
        self._amp_scaler.update(found_inf, grad_max)
        if self._amp_scaler.scale != before:
            logger.info("loss scale %g -> %g", before, self._amp_scaler.scale)
        self.consecutive_stuck = self.consecutive_stuck + 1 if found_inf and not could_decrease else 0
        if self.consecutive_stuck >= self.config.stuck_scale_patience:
            raise RuntimeError(_stuck_message(self.config, self._amp_scaler.scale, self.consecutive_stuck))

    def lower_scale_now(self) -> bool:
        """Lower the loss scale at once (an overflow retry); False when it cannot go lower."""
        before = self._amp_scaler.scale
        if not self._amp_scaler.decrease_now():
            return False
        logger.info("loss scale %g -> %g (retrying the step)", before, self._amp_scaler.scale)
        return True

    def state_dict(self) -> dict:
        """Scaler type and state as plain numbers."""
        return {"loss_scaler_type": self.scaler_kind, "loss_scaler": self._amp_scaler.state_dict()}


class PureLowPrecision(MixedPrecision):
    """O2: the model is stored in 16 bits; the inner optimizer updates FP32 masters.

    The step never holds a whole-model FP32 gradient
    (:mod:`distamp.core.chunked_update`): the 16-bit gradients are copied
    (exactly, 16 to 32 bits) into one chunk-sized FP32 buffer at a time and
    unscaled and checked there with the same fused kernel as O1, so the
    check never needs a 16-bit kernel (torch has had none for BF16 on CUDA
    in several releases, pytorch issue 127176); once every rank agreed to
    apply, each chunk is rebuilt the same way (or, where one chunk held all
    of them, the check's is kept for the step), its masters are updated and
    rounded into the model. ``unscale_()`` and clipping, which show and
    change whole gradients, make whole FP32 master gradients for that step.

    The model parameters are converted to the low dtype right away; those
    that must stay FP32 (normalization layers, ``custom_black_varnames``)
    are given back their exact FP32 values once the model is known.

    Gradient merge sums the micro-batches in FP32
    (:mod:`distamp.core.grad_accumulator`), not in the 16-bit ``.grad``.
    """

    master_weights: MasterWeights  # whole FP32 masters (narrows the base's MasterWeightsSurface)

    mode = "O2"

    def __init__(self, params: Sequence[nn.Parameter], config: AmpConfig) -> None:
        FullPrecision.__init__(self, params, config)
        self.master_weights = MasterWeights(params, config.torch_dtype)
        self.master_weights.convert_model()
        self.scaler = build_loss_scaler(config)
        self._exposed_versions: list[tuple[torch.Tensor, int]] | None = None
        self.grad_accumulator: Fp32GradAccumulator | None = None
        self._merge_sum: dict[int, torch.Tensor] | None = None  # taken at the check, added again at the step
        self._inv_scale = 1.0
        self._kept: dict[torch.device, CheckedGrads] = {}  # the check's FP32 gradients, where one chunk held them

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in FP32; a tied parameter's gradients will be summed in place.

        O2's 16-bit head tied to the embedding would otherwise hold three
        copies of the embedding's gradient in backward
        (:mod:`distamp.core.reused_leaf_grads`); the bits are the same.
        """
        accumulate_reused_leaf_grads_in_place(loss)
        return super().scale_loss(loss)

    def after_backward(self, window_open: bool) -> None:
        """Inside a gradient-merge window: move the 16-bit gradients into the FP32 sum."""
        if window_open:
            if self.grad_accumulator is None:
                self.grad_accumulator = Fp32GradAccumulator(self.master_weights.model_params)
            self.grad_accumulator.add_and_zero()

    def merge_sums(self) -> dict[int, torch.Tensor] | None:
        """The FP32 sum of the window's earlier micro-batches this step adds (None when a comm hook added it)."""
        return self._merge_sum

    def unscale_and_check(self, group: dist.ProcessGroup | None) -> tuple[bool, float | None]:
        """Check the unscaled FP32 gradients chunk by chunk, all-reduce the verdict; one host sync.

        The model's 16-bit gradients are left as they are (parameters that
        are their own masters, float64 ones, are unscaled in place).

        Raises:
            TypeError: a gradient is sparse.
        """
        if self.master_weights.adopt_model_writes():
            logger.info("O2: took parameters written into the model since the last step into the FP32 masters")
        masters = self.master_weights
        masters.zero_master_grads()
        if any(p.grad is not None and p.grad.is_sparse for p in masters.model_params):
            raise TypeError("sparse gradients are not supported by the AMP optimizer; use dense gradients")
        self._merge_sum = None
        if self.grad_accumulator is not None:
            self._merge_sum = self.grad_accumulator.take()  # None when the comm hook already added it
            self.grad_accumulator.reset()
        # Like GradScaler: the reciprocal in double, rounded once to float32 (in the kernels).
        self._inv_scale = 1.0 / self._amp_scaler.scale
        needs_max = self._amp_scaler.needs_grad_max
        device = self._any_device()
        flags = torch.zeros(2, dtype=torch.float32, device=device)
        maxima = []
        self._kept = {}
        for pairs in _pairs_by_device(masters.pairs_with_grads()):
            found, grad_max, kept = check_in_chunks(pairs, self._merge_sum, self._inv_scale, needs_max,
                                                    chunk_limit(pairs), keep=True)
            flags[0] += found.to(device)[0]
            if grad_max is not None:
                maxima.append(grad_max.to(device))
            if kept is not None:
                self._kept[pairs[0][1].device] = kept
        own = masters.own_grads()
        for (dev, _), group_grads in _by_device_and_dtype(own).items():
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            factor = torch.full((1,), self._inv_scale, dtype=torch.float32, device=dev)
            amp_foreach_non_finite_check_and_unscale_(group_grads, found, factor)
            flags[0] += found.to(device)[0]
        if needs_max and own:
            maxima.append(_max_abs(own).to(device))
        if maxima:
            flags[1] = torch.stack(maxima).max()
        all_reduce_max(flags, group)
        found_inf, grad_max = flags.tolist()
        if found_inf > 0:
            self._kept = {}
        return found_inf > 0, (grad_max if needs_max else None)

    def _whole_master_grads(self) -> None:
        """Whole unscaled FP32 master gradients, built as the chunks build them (same kernels, same bits)."""
        masters = self.master_weights
        masters.copy_grads_to_masters()
        if self._merge_sum:
            masters.add_to_master_grads(self._merge_sum)
        grads = [master_grad for _, master_grad in masters.grad_pairs()]
        for (dev, _), group_grads in _by_device_and_dtype(grads).items():
            found = torch.zeros(1, dtype=torch.float32, device=dev)
            factor = torch.full((1,), self._inv_scale, dtype=torch.float32, device=dev)
            amp_foreach_non_finite_check_and_unscale_(group_grads, found, factor)

    def expose_unscaled_grads(self) -> None:
        """Round the unscaled master gradients into the model's 16-bit ``.grad``.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` after
        ``optimizer.unscale_()`` then sees true gradients; what it changes is
        taken back by :meth:`take_user_grad_changes`. The whole FP32 master
        gradients this needs live until the step is applied.
        """
        self._kept = {}
        self._whole_master_grads()
        pairs = self.master_weights.grad_pairs()
        if pairs:
            foreach_copy_([g for g, _ in pairs], [m for _, m in pairs])
        self._exposed_versions = [(g, tensor_version(g)) for g, _ in pairs]

    def take_user_grad_changes(self) -> None:
        """Copy model gradients changed since :meth:`expose_unscaled_grads` (e.g. clipped) into the masters."""
        if self._exposed_versions is None:
            return
        changed = {id(g) for g, version in self._exposed_versions if tensor_version(g) != version}
        self._exposed_versions = None
        if changed:
            pairs = [(g, m) for g, m in self.master_weights.grad_pairs()
                     if id(g) in changed and not holds_rounding_of(g, m)]
            if pairs:
                foreach_copy_([m for _, m in pairs], [g for g, _ in pairs])

    def after_applied_step(self) -> None:
        """Round the updated masters into the model."""
        self.master_weights.copy_masters_to_model()

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the inner optimizer on the unscaled gradients and round the masters into the model.

        Chunk by chunk when the inner optimizer allows it and no whole
        gradients were asked for; otherwise one step on whole FP32 master
        gradients, freed right after it.
        """
        masters = self.master_weights
        if not masters.has_master_grads and steps_in_chunks(optimizer):
            as_one_step(optimizer, lambda: self._step_in_chunks(optimizer))
        else:
            self._kept = {}  # freed before the whole gradients are made
            if not masters.has_master_grads:
                self._whole_master_grads()
            optimizer.step()
            self.after_applied_step()
        masters.zero_master_grads()
        self._merge_sum = None
        self._kept = {}

    def _step_in_chunks(self, optimizer: torch.optim.Optimizer) -> None:
        masters = self.master_weights
        for pairs in _pairs_by_device(masters.pairs_with_grads()):
            step_in_chunks(optimizer, pairs, self._merge_sum, self._inv_scale, chunk_limit(pairs),
                           kept=self._kept.pop(pairs[0][1].device, None))
        own = [p for p in masters.model_params if masters.master_for(p) is p and p.grad is not None]
        if own:
            step_only(optimizer, own)

    def state_dict(self) -> dict:
        """Scaler state plus the FP32 masters."""
        return {**super().state_dict(), "master_weights": self.master_weights.state_dict()}


def _pairs_by_device(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> list[list[tuple[nn.Parameter, nn.Parameter]]]:
    groups: dict[torch.device, list[tuple[nn.Parameter, nn.Parameter]]] = {}
    for pair in pairs:
        groups.setdefault(pair[1].device, []).append(pair)
    return list(groups.values())


_STATELESS_SCALERS = ("", "UnitLossScaler")
"""Saved ``loss_scaler_type`` values with no scaler state: AMP off, and BF16's fixed scale."""


def _stuck_message(config: AmpConfig, scale: float, count: int) -> str:
    if config.dtype != "float16":
        hint = "The model produces inf/NaN even in BF16: check the data, the learning rate and the loss"
    elif config.use_dynamic_loss_scaling:
        hint = ("Use strategy.amp_configs = {..., 'dtype': 'bfloat16'} (BF16 has FP32's range), or lower "
                "min_loss_scaling")
    else:
        hint = ("Use strategy.amp_configs = {..., 'dtype': 'bfloat16'} (BF16 has FP32's range), or a lower "
                "init_loss_scaling, or use_dynamic_loss_scaling=True")
    if config.dtype != "float16":
        why = "the scale is fixed at 1.0 in BF16"
    elif config.use_dynamic_loss_scaling and scale > float(torch.tensor(config.min_loss_scaling, dtype=torch.float32)):
        # Above its minimum, only backoff's decr_ratio can hold the scale: scale * decr_ratio rounds back to it.
        why = (f"decr_ratio={config.decr_ratio!r} is too close to 1 to lower it (the scale is kept in FP32, where "
               f"{scale:g} * decr_ratio rounds back to {scale:g})")
        hint = ("Use a decr_ratio further from 1 (the default is 0.5), or strategy.amp_configs = "
                "{..., 'dtype': 'bfloat16'}")
    elif config.use_dynamic_loss_scaling:
        why = f"the scale could not go lower (min_loss_scaling={config.min_loss_scaling:g})"
    else:
        why = "the scale is static (use_dynamic_loss_scaling=False)"
    return (
        f"the loss scale is stuck at {scale:g}: {count} consecutive steps overflowed while {why}, so training is "
        f"not making progress. {hint}"
    )


def _max_abs(grads: list[torch.Tensor]) -> torch.Tensor:
    """max |g| over all gradients: one fused norm kernel per device and dtype."""
    maxima = [
        torch.stack(foreach_norm(group, math.inf)).max().float()
        for group in _by_device_and_dtype(grads).values()
    ]
    return torch.stack([m.to(maxima[0].device) for m in maxima]).max()


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Group tensors for the foreach kernels, which need one device and dtype per call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups
