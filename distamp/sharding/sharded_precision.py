"""The precision plugin for ``strategy.sharding``: AMP off, O1 or O2, on this rank's slice.

It runs the same loop as the unsharded plugins of
:mod:`distamp.core.precision`, on the slice of the flat parameter space
this rank owns (:class:`~distamp.sharding.sharded_masters.ShardedMasters`):

* the gradient slice was summed there during backward by the
  reduce-scatter (DDP's comm hook in stage 1, distamp's reducer in stage 2),
  or, with no data-parallel model, is taken from the model's ``.grad``; it
  is FP32, or in O2 without gradient merge 16-bit, the reduced sum rounded
  once as unsharded O2 rounds it into ``.grad``
  (:mod:`distamp.sharding.slice_grads`);
* unscaling and the inf/NaN check run on the slice (one fused kernel; on a
  16-bit slice one FP32 chunk at a time, as unsharded O2 does,
  :mod:`distamp.core.chunked_update`); the verdict is all-reduced (MAX)
  before anyone decides, so a non-finite value that only another rank's
  slice holds still skips the step everywhere;
* the inner optimizer steps the slice (a 16-bit slice chunk by chunk); the
  slices are all-gathered into every rank's model;
* ``clip_grad_norm_`` sums the slices' norms into one global norm,
  identical on every rank.
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
    step_in_chunks,
    steps_in_chunks,
)
from distamp.core.grad_accumulator import Fp32GradAccumulator
from distamp.core.precision import FullPrecision, MixedPrecision
from distamp.distributed.flag_sync import all_reduce_max
from distamp.distributed.groups import group_rank, group_size
from distamp.scaling.loss_scaler import build_loss_scaler
from distamp.sharding.global_clip import global_clip
from distamp.sharding.param_gather import GATHER_BYTES
from distamp.sharding.reduce_scatter import reduce_bucket_bytes
from distamp.sharding.sharded_masters import ShardedMasters
from distamp.strategy import DistributedStrategy
from distamp.torch_compat import amp_foreach_non_finite_check_and_unscale_, tensor_version

__all__ = ["ShardedPrecision"]

logger = logging.getLogger("distamp")


def _gather_bytes(params: Sequence[nn.Parameter], strategy: DistributedStrategy, itemsize: int) -> int:
    """Bytes the all-gather receives at a time: two of the reduce-scatter's buckets, at least GATHER_BYTES."""
    fuse = max(1, int(strategy.fuse_grad_size_in_MB * 2**20))
    bucket = reduce_bucket_bytes(sum(p.numel() for p in params) * itemsize, strategy.fuse_grad_size_in_MB)
    return min(fuse, max(GATHER_BYTES, 2 * bucket))


class ShardedPrecision(MixedPrecision):
    """Sharded optimizer state (ZeRO stage 1 or 2) in any AMP mode.

    Args:
        params: the parameters the inner optimizer was built on.
        strategy: ``amp``, ``amp_configs``, ``sharding_configs`` and
            ``fuse_grad_size_in_MB`` (the all-gather's budget, at most that and
            at least :data:`~distamp.sharding.param_gather.GATHER_BYTES`).
        group: the data-parallel group (``None``: a one-process world).

    Notes:
        The inf/NaN verdict is always agreed over ``group``, whatever
        ``AmpOptimizer.sync_found_inf`` says: a rank that stepped alone would
        wait forever in the all-gather of the others.
    """

    master_weights: ShardedMasters

    def __init__(self, params: Sequence[nn.Parameter], strategy: DistributedStrategy,
                 group: dist.ProcessGroup | None) -> None:
        params = list(params)
        config = strategy.amp_config
        self.config = config
        self.group = group
        self.stage = strategy.sharding_config.stage
        self.overlap_param_gather = strategy.sharding_config.overlap_param_gather
        self.gather_hooked = False
        """Whether a model's forward finishes the gather (:mod:`distamp.sharding.param_gather_hooks`)."""
        pure = strategy.amp and config.use_pure_fp16
        self.mode = "O2" if pure else ("O1" if strategy.amp else "off")
        merging = strategy.gradient_merge and strategy.gradient_merge_config.k_steps > 1
        self.master_weights = ShardedMasters(
            params, config.torch_dtype if pure else None, group, group_rank(group), group_size(group),
            chunk_bytes=_gather_bytes(params, strategy, 2 if pure or strategy.amp else 4),
            # O2 without gradient merge: 16 bits, as unsharded O2's .grad; merge sums micro-batches in FP32.
            grad_dtype=config.torch_dtype if pure and not merging else torch.float32,
        )
        self.scaler = build_loss_scaler(config) if strategy.amp else None
        self.consecutive_stuck = 0
        self.grad_accumulator: Fp32GradAccumulator | None = None
        self._exposed: list[tuple[torch.Tensor, int]] | None = None
        self._inv_scale = 1.0
        self._kept: CheckedGrads | None = None  # the check's FP32 slice gradients, where one chunk held them

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 with AMP off)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in FP32 (``loss`` itself with AMP off)."""
        return loss if self.scaler is None else loss.float() * self.scaler.scale

    def after_backward(self, window_open: bool) -> None:
        """O2, inside a gradient-merge window, when the gradients were not reduce-scattered: sum them in FP32."""
        masters = self.master_weights
        if window_open and masters.low_dtype is not None and not masters.grads.reduced:
            if self.grad_accumulator is None:
                self.grad_accumulator = Fp32GradAccumulator(masters.model_params)
            self.grad_accumulator.add_and_zero()

    def unscale_and_check(self, group: dist.ProcessGroup | None) -> tuple[bool, float | None]:
        """Fill this rank's gradient slice, unscale and check it, agree on the verdict over every rank.

        An FP32 slice is unscaled in place; a 16-bit one is checked one FP32
        chunk at a time and left as it is (its chunks are unscaled again,
        with the same kernels, when the step is applied).

        Raises:
            TypeError: a gradient is sparse.
        """
        masters = self.master_weights
        if any(p.grad is not None and p.grad.is_sparse for p in masters.model_params):
            raise TypeError("sparse gradients are not supported by the AMP optimizer; use dense gradients")
        masters.pending = None  # no start-up broadcast happened (no data-parallel model): keep each rank's own
        if masters.adopt_model_writes():
            logger.info("O2: took parameters written into the model since the last step into this rank's FP32 masters")
        extra = None
        if self.grad_accumulator is not None:
            extra = self.grad_accumulator.take()
            self.grad_accumulator.reset()
        slice_grads = masters.grads
        slice_grads.collect(extra)
        if self.scaler is None:
            return False, None  # AMP off: applied as they are, as without sharding
        # Like GradScaler: the reciprocal in double, rounded once to float32 (in the kernels).
        self._inv_scale = 1.0 / self.scaler.scale
        device = slice_grads.device
        flags = torch.zeros(2, dtype=torch.float32, device=device)
        grads = slice_grads.fp32_buffer
        self._kept = None
        if grads is None:  # a 16-bit slice: FP32 one chunk at a time
            pairs = slice_grads.pairs()
            if pairs:
                found, grad_max, self._kept = check_in_chunks(pairs, None, self._inv_scale,
                                                              self.scaler.needs_grad_max, chunk_limit(pairs), keep=True)
                flags[0] = found[0]
                if grad_max is not None:
                    flags[1] = grad_max
        elif grads.numel():
            found = torch.zeros(1, dtype=torch.float32, device=device)
            factor = torch.full((1,), self._inv_scale, dtype=torch.float32, device=device)
            amp_foreach_non_finite_check_and_unscale_([grads], found, factor)
            flags[0] = found[0]
            if self.scaler.needs_grad_max:
                flags[1] = grads.abs().max()
        all_reduce_max(flags, self.group)
        found_inf, grad_max = flags.tolist()
        if found_inf > 0:
            self._kept = None
        return found_inf > 0, (grad_max if self.scaler.needs_grad_max else None)

    def expose_unscaled_grads(self) -> None:
        """Make the model's ``.grad`` hold this rank's slice of the unscaled gradients and zeros elsewhere.

        A 16-bit slice gets its whole unscaled FP32 copy first, which the
        step then applies (clipping changes it).
        """
        self._kept = None
        self.master_weights.grads.materialize(self._inv_scale)
        self._exposed = self.master_weights.grads.expose()

    def take_user_grad_changes(self) -> None:
        """Copy back this rank's slice of the model gradients changed since :meth:`expose_unscaled_grads`."""
        if self._exposed is None:
            return
        changed = {id(g) for g, version in self._exposed if tensor_version(g) != version}
        self._exposed = None
        if changed:
            self.master_weights.grads.take_changes(changed)

    @property
    def grads_are_slices(self) -> bool:
        """On several ranks the model's ``.grad`` holds this rank's slice only (stage 2: no ``.grad`` at all)."""
        return self.master_weights.world_size > 1

    def hook_param_gather(self, deferred: bool) -> bool:
        """With ``overlap_param_gather``: leave the gather after a step to the forward hooks while ``deferred``."""
        if not self.overlap_param_gather:
            return False
        self.gather_hooked = deferred
        return True

    def after_applied_step(self) -> None:
        """All-gather the updated slices into every rank's model (16-bit on the wire in O2).

        With ``sharding_configs["overlap_param_gather"]`` the gather is left
        running for the next forward of the ``fleet.distributed_model`` to
        finish, once that model has installed its hooks for this optimizer.
        """
        self.master_weights.refresh_model(overlap=self.overlap_param_gather and self.gather_hooked)

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the inner optimizer on this rank's slice, then all-gather (:meth:`after_applied_step`).

        A 16-bit slice without its whole FP32 copy is stepped one FP32 chunk
        at a time when the inner optimizer allows it, else on a whole FP32
        copy made for this step; the copy is freed after the step.
        """
        slice_grads = self.master_weights.grads
        kept, self._kept = self._kept, None
        if slice_grads.fp32_buffer is None:
            if steps_in_chunks(optimizer):
                pairs = slice_grads.pairs()

                def update() -> None:
                    if pairs:  # a rank whose slice holds nothing still runs the step's hooks
                        step_in_chunks(optimizer, pairs, None, self._inv_scale, chunk_limit(pairs), into_model=False,
                                       kept=kept)

                as_one_step(optimizer, update)
            else:
                kept = None  # freed before the whole FP32 copy is made
                slice_grads.materialize(self._inv_scale)
                optimizer.step()
        else:
            optimizer.step()
        kept = None
        slice_grads.drop_fp32()
        self.after_applied_step()

    def update(self, found_inf: bool, grad_max: float | None) -> None:
        """Update the loss scale as without sharding (nothing with AMP off)."""
        if self.scaler is not None:
            super().update(found_inf, grad_max)

    def clip_grad_norm_(self, grads: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip with one global norm: each rank's slice norm, gathered and combined in rank order.

        Every rank combines the same numbers in the same order, so the norm
        (and the clip factor) is bitwise identical everywhere.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is inf or NaN.
        """
        flat = self.master_weights.grads.fp32_buffer
        if flat is None:  # not reached through the meta-optimizer, which exposes (unscales) first
            raise RuntimeError("clip_grad_norm_ before expose_unscaled_grads: the 16-bit slice has no FP32 copy")
        norm_type = float(norm_type)
        local = torch.zeros(1, dtype=torch.float32, device=flat.device)
        if flat.numel():
            if math.isinf(norm_type):
                local[0] = flat.abs().max()
            else:
                local[0] = torch.linalg.vector_norm(flat, norm_type) ** norm_type
        total, coefficient = global_clip(local, max_norm, norm_type, self.group, error_if_nonfinite)
        flat.mul_(coefficient)
        return total

    def state_dict(self) -> dict:
        """Scaler state, this rank's FP32 slice (O2) and the layout it belongs to."""
        scaler = {"loss_scaler_type": "", "loss_scaler": {}} if self.scaler is None else super().state_dict()
        return {**scaler, "master_weights": self.master_weights.state_dict(), "sharding": self._layout()}

    def checkpoint_layout(self, param_groups: Sequence[dict]) -> tuple[list[list[int]], dict | None]:
        """``(groups, layout)`` of this rank's slice, as :meth:`state_dict` records it (see the base class)."""
        layout = self._layout()
        return layout["groups"], layout

    def _layout(self) -> dict:
        return {**self.master_weights.layout_state(), "stage": self.stage, "mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scaler after checking that ``state`` was saved by this rank of this layout.

        Raises:
            ValueError: ``state`` comes from another layout (world size,
                rank, parameters) or from an unsharded optimizer.
        """
        saved, own = state.get("sharding"), self.master_weights.layout_state()
        keys = ("world_size", "rank", "numels", "bounds")
        if not isinstance(saved, dict) or any(saved.get(k) != own[k] for k in keys):
            found = {k: saved.get(k) for k in ("world_size", "rank")} if isinstance(saved, dict) else "unsharded"
            raise ValueError(
                f"this state_dict was saved by an optimizer with another layout ({found}) than this one "
                f"(world_size {own['world_size']}, rank {own['rank']}); a sharded optimizer loads only its own "
                "slice. To resume at another world size or with other sharding, save and load with "
                "distamp.checkpoint.save_checkpoint / load_latest_checkpoint, which re-slice"
            )
        FullPrecision.load_state_dict(self, state)
