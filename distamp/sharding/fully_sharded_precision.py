"""The precision plugin for sharding stage 3: AMP off, O1 or O2 on FSDP2's DTensor shards.

Under stage 3 ``fleet.distributed_model`` applies torch's ``fully_shard``
(:mod:`distamp.sharding.fully_sharded`). Each parameter becomes a
``DTensor`` whose local shard is stored in FP32, and its gradient a DTensor
whose local shard FSDP2 has already reduce-scattered (summed in FP32). So:

* **Masters.** In O2 the FP32 sharded parameter *is* the master: FSDP2 casts
  it to the 16-bit ``param_dtype`` for each all-gather, so forward and
  backward run on 16-bit unsharded parameters, while the inner optimizer and
  all its state stay FP32 and updates too small for 16 bits accumulate in
  the shard. A separate 16-bit shard beside an FP32 master would add 2
  bytes per parameter and a copy per step for nothing the all-gather does
  not already give.
* **Check and verdict.** Unscaling and the inf/NaN check run on the local
  FP32 gradient shards with torch's fused kernel; the verdict is all-reduced
  (MAX) over the data-parallel group before anyone decides, so an inf that
  only another rank's shard holds skips the step on every rank, and every
  rank updates the loss scale identically.
* **Clipping** sums the shards' norms into one global norm, combined in rank
  order, so the clip factor is bitwise identical everywhere.
* **Gradients end with the step.** The inner optimizer steps a chunk at a
  time (its temporaries are a chunk's, not the largest parameter's), and
  each FP32 gradient shard is freed once its parameter has stepped; a
  skipped step frees them too. So after ``step()`` the parameters'
  ``.grad`` is ``None``, as DeepSpeed's engine zeroes the gradients after
  its step: a gradient is not kept past its use, through the next forward
  of a loop that calls ``zero_grad`` late. Read or change them between
  ``backward`` and ``step()``.

:class:`ShardedParameters` is the masters surface the meta-optimizer
expects (:class:`~distamp.core.master_weights.MasterWeightsSurface`): each
parameter is its own master; its :meth:`~ShardedParameters.replace` follows
the parameters when ``fully_shard`` swaps them for DTensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.core.chunked_update import (
    as_one_step,
    chunk_limit,
    step_and_free_in_chunks,
    step_makes_temporaries,
    steps_in_chunks,
)
from distamp.core.master_weights import check_saved_masters, clear_grads
from distamp.core.precision import FullPrecision, MixedPrecision
from distamp.core.shard_rows import local_rows
from distamp.scaling.loss_scaler import build_loss_scaler
from distamp.sharding.dtensor_state import (
    gather_full,
    local_inner,
    reshard_loaded,
    shard_like,
    stage3_ranges,
    wrap_loaded,
)
from distamp.sharding.global_clip import global_clip
from distamp.sharding.unit_trace import UnitTrace
from distamp.strategy import DistributedStrategy
from distamp.torch_compat import dtensor_local, foreach_mul_, foreach_norm

__all__ = ["FullyShardedPrecision", "ShardedParameters", "local_shard"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is its own shard)."""
    return dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


class ShardedParameters:
    """The parameters as their own FP32 masters (stage 3): no copies, nothing converted.

    Args:
        params: the parameters the inner optimizer was built on (plain until
            ``fleet.distributed_model`` shards them, DTensors after).
        pure: O2: the parameters are the FP32 masters of a 16-bit model
            (``state_dict`` gathers them whole, as an unsharded O2 optimizer
            saves its masters; ``local_state_dict`` keeps this rank's shards).
    """

    low_dtype: torch.dtype | None = None

    def __init__(self, params: Iterable[nn.Parameter], pure: bool = False) -> None:
        self.model_params: list[nn.Parameter] = list(dict.fromkeys(params))
        self.pure = pure

    @property
    def enabled(self) -> bool:
        """True in O2: the FP32 sharded parameters are the masters of the 16-bit model FSDP2 gathers."""
        return self.pure

    @property
    def masters(self) -> list[nn.Parameter]:
        """The tensors the inner optimizer updates: the parameters themselves."""
        return list(self.model_params)

    @property
    def sharded(self) -> bool:
        """True once every parameter is a DTensor (``fully_shard`` was applied)."""
        return all(isinstance(p, DTensor) for p in self.model_params)

    def replace(self, new_of: dict[int, nn.Parameter]) -> None:
        """Follow ``fully_shard``: ``new_of[id(old)]`` is the DTensor parameter that replaced ``old``."""
        self.model_params = [new_of.get(id(p), p) for p in self.model_params]

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """The inner optimizer keeps the parameters; whole state tensors it loads become this rank's shards.

        ``optimizer.inner_opt.load_state_dict`` of a bare torch optimizer's
        state (saved before distamp was adopted) puts whole tensors beside the
        DTensor parameters, which the next step would refuse; a load
        post-hook cuts them (no collective).
        """
        optimizer.register_load_state_dict_post_hook(reshard_loaded)

    def master_for(self, param: torch.Tensor) -> nn.Parameter:
        """``param`` itself (it is its own master)."""
        if not any(param is p for p in self.model_params):
            raise ValueError(f"parameter of shape {tuple(param.shape)} is not managed by this optimizer")
        return param  # type: ignore[return-value]

    def add(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Manage more parameters (``add_param_group``); returns them."""
        new = [p for p in params if not any(p is q for q in self.model_params)]
        self.model_params.extend(new)
        return new

    def convert_model(self, keep_fp32: Iterable[nn.Parameter] = ()) -> int:
        """Nothing to convert: FSDP2 casts each all-gather to ``param_dtype``; returns 0."""
        return 0

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        """``{id(param): full value}``, gathered from the shards (collective: every rank calls it).

        FP32; a float64 parameter (AMP off, O1) stays float64, as unsharded.
        """
        return {id(p): _full(p) if p.dtype == torch.float64 else _full(p).float() for p in self.model_params}

    def zero_master_grads(self) -> None:
        """Nothing to drop: the gradients are the parameters' own."""

    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's shards of the reduced gradients, by parameter index."""
        return [(i, local_shard(p.grad)) for i, p in enumerate(self.model_params) if p.grad is not None]

    def zero_grads(self, set_to_none: bool = True) -> None:
        """Clear the sharded gradients (freed, or zeroed in place)."""
        clear_grads(self.model_params, set_to_none)

    def finish_refresh(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Nothing to finish: FSDP2 all-gathers each unit before it runs."""

    def broadcast(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Nothing to broadcast: ``fleet.distributed_model`` gave every rank rank 0's values before sharding."""

    def state_dict(self) -> list[torch.Tensor]:
        """O2: the whole FP32 masters, one per parameter, as an unsharded O2 optimizer saves them (collective).

        Empty in O1 and with AMP off, as unsharded.
        """
        return [_full(p).float() for p in self.model_params] if self.pure else []

    def local_state_dict(self) -> list[torch.Tensor]:
        """O2: this rank's local FP32 shard of each parameter (no collective); empty in O1 and with AMP off."""
        return [local_shard(p).detach() for p in self.model_params] if self.pure else []

    def load_state_dict(self, tensors: Sequence[torch.Tensor], local: bool = False) -> None:
        """Load FP32 masters: whole (:meth:`state_dict`'s, or an unsharded optimizer's; each rank keeps its shard),
        or with ``local`` this rank's shards (:meth:`local_state_dict`'s).

        Raises:
            ValueError: the count or a shape differs from this optimizer's parameters (or their local shards).
        """
        check_saved_masters(tensors, [local_shard(p) for p in self.model_params] if local else self.model_params)
        with torch.no_grad():
            for p, t in zip(self.model_params, tensors, strict=True):
                local_shard(p).copy_(t.float() if local else local_shard(shard_like(t.float(), p)))

    def layout_state(self, groups: Sequence[Sequence[int]], mode: str) -> dict:
        """The stage-3 layout of this rank's state, as plain numbers (see :mod:`distamp.sharding.dtensor_state`).

        ``world_size``, ``rank``, parameter ``numels`` and ``shapes``, param
        ``groups`` (parameter indices), ``mode`` and ``ranges``: per rank,
        the flat ranges it holds. Checks that this rank's shards are the rows
        the ranges say.

        Raises:
            ValueError: a parameter is not sharded as FSDP2's ``Shard(0)``.
        """
        meshes = [p.device_mesh for p in self.model_params if isinstance(p, DTensor)]
        world, rank = (meshes[0].size(), meshes[0].get_local_rank()) if meshes else (1, 0)
        for p in self.model_params:
            local_rows(p)  # type: ignore[arg-type]  # sharded: every parameter is a DTensor
        shapes = [list(p.shape) for p in self.model_params]
        return {
            "stage": 3,
            "mode": mode,
            "world_size": world,
            "rank": rank,
            "numels": [p.numel() for p in self.model_params],
            "shapes": shapes,
            "groups": [list(g) for g in groups],
            "ranges": stage3_ranges(shapes, world),
        }


def _full(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


def _refuse_non_fp32(params: Sequence[nn.Parameter]) -> None:
    """O2 at stage 3 keeps each parameter's FP32 shard as its master: refuse another floating dtype.

    Raises:
        TypeError: naming the first such parameter and the fix.
    """
    for i, p in enumerate(params):
        if p.is_floating_point() and p.dtype != torch.float32:
            raise TypeError(
                f"sharding stage 3 with use_pure_fp16 keeps each parameter's FP32 shard as its master and gathers "
                f"it in amp_configs['dtype'], but parameter {i} (shape {tuple(p.shape)}) is {p.dtype}: its shard "
                "would be the master (no FP32 copy for a 16-bit one; a float64 one gathered in 16 bits for float64 "
                "inputs). Build the model in FP32 (model.float()) and let amp_configs['dtype'] choose the compute "
                "dtype"
            )


class FullyShardedPrecision(MixedPrecision):
    """Sharding stage 3 (FSDP2) in any AMP mode: scale, check and clip on the DTensor shards.

    Args:
        params: the parameters the inner optimizer was built on.
        strategy: ``amp`` and ``amp_configs`` (the mode and the loss scaler).
        group: the data-parallel group (``None``: a one-process world).

    Notes:
        The verdict is always agreed over ``group``: every rank must skip or
        apply the same step, or the shards of one parameter would come from
        different steps.
    """

    master_weights: ShardedParameters  # narrows the base's MasterWeightsSurface
    stage = 3

    def __init__(self, params: Sequence[nn.Parameter], strategy: DistributedStrategy,
                 group: dist.ProcessGroup | None) -> None:
        config = strategy.amp_config
        self.config = config
        self.group = group
        pure = strategy.amp and config.use_pure_fp16
        self.mode = "O2" if pure else ("O1" if strategy.amp else "off")
        if pure:
            _refuse_non_fp32(params)
        self.master_weights = ShardedParameters(params, pure)
        self.scaler = build_loss_scaler(config) if strategy.amp else None
        self.consecutive_stuck = 0
        self._unit_trace: UnitTrace | None = None

    def check_unit_forwards(self, trace: UnitTrace) -> None:
        """Agree at each step, before the verdict, that every rank ran the units ``trace`` saw and that FSDP2
        finished their backward."""
        self._unit_trace = trace

    def follow_sharded_parameters(self, new_of: dict[int, nn.Parameter]) -> None:
        """``fully_shard`` replaced each parameter ``old`` by the DTensor ``new_of[id(old)]``: hold those."""
        self.master_weights.replace(new_of)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 with AMP off)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` in FP32 (``loss`` itself with AMP off)."""
        return loss if self.scaler is None else loss.float() * self.scaler.scale

    def _local_grads(self) -> list[torch.Tensor]:
        return [g for _, g in self.master_weights.reduced_grads()]

    def unscale_and_check(self, group: dist.ProcessGroup | None) -> tuple[bool, float | None]:
        """Unscale the local gradient shards, check them, agree on the verdict over every rank.

        Raises:
            RuntimeError: the parameters were never sharded (no
                ``fleet.distributed_model`` for this optimizer's model), the
                ranks ran different units since the last step, or FSDP2 did
                not finish a unit's backward (see :class:`UnitTrace`).
        """
        self.require_sharded("a step", "run the forward through the model it returns")
        if self._unit_trace is not None:
            self._unit_trace.agree(self.group, self._any_device())
        if self.scaler is None:
            return False, None  # AMP off: applied as they are
        return MixedPrecision.unscale_and_check(self, self.group)

    def _grads_to_check(self) -> list[torch.Tensor]:
        return self._local_grads()

    def update(self, found_inf: bool, grad_max: float | None) -> None:
        """Update the loss scale (nothing with AMP off)."""
        if self.scaler is not None:
            super().update(found_inf, grad_max)

    def apply_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Step the inner optimizer on the gradient shards and free them.

        An elementwise optimizer (:func:`~distamp.core.chunked_update.steps_in_chunks`)
        whose step makes temporaries the size of what it updates (Adam, AdamW,
        SGD with weight decay; :func:`~distamp.core.chunked_update.step_makes_temporaries`)
        steps a chunk at a time, smallest parameters first, a larger one in
        slices of its local shard, each gradient freed once its parameter has
        stepped (bitwise one ``step()``; a chunk is 1/16 of this rank's
        shards, or on CUDA as much as fits below the allocator's peak); any
        other optimizer steps once (plain SGD allocates nothing: chunks would
        only cost a ``step()`` call each).
        """
        params = [p for p in self.master_weights.model_params if p.grad is not None]
        if params and steps_in_chunks(optimizer) and step_makes_temporaries(optimizer):
            # Each parameter is its own master and gradient source.
            limit = chunk_limit([(p, p) for p in params])
            as_one_step(optimizer, lambda: step_and_free_in_chunks(optimizer, params, limit))
        else:
            optimizer.step()
        self.after_applied_step()

    def end_step(self) -> None:
        """Free the gradient shards, applied or skipped: nothing reads them after the step."""
        self.master_weights.zero_grads(set_to_none=True)

    def lower_scale_now(self) -> bool:
        """Lower the loss scale at once (an overflow retry); False with AMP off or at the minimum."""
        return self.scaler is not None and super().lower_scale_now()

    def clip_grad_norm_(self, grads: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip with one global norm: each rank's shard norm, gathered and combined in rank order.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is inf or NaN.
        """
        shards = self._local_grads()
        norm_type = float(norm_type)
        device = shards[0].device if shards else self._any_device()
        local = torch.zeros(1, dtype=torch.float32, device=device)
        if shards:
            norms = torch.stack(foreach_norm(shards, norm_type)).float()
            local[0] = norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()
        total, coefficient = global_clip(local, max_norm, norm_type, self.group, error_if_nonfinite)
        if shards:
            foreach_mul_(shards, coefficient)
        return total

    def state_dict(self) -> dict:
        """Scaler type and state, and in O2 the whole FP32 masters (gathered from the shards: collective)."""
        scaler = {"loss_scaler_type": "", "loss_scaler": {}} if self.scaler is None else super().state_dict()
        return {**scaler, "master_weights": self.master_weights.state_dict()}

    def checkpoint_state(self, inner_opt: torch.optim.Optimizer, local: bool) -> tuple[dict, dict]:
        """``local`` (and sharded): this rank's shards and their layout, no collective; else whole tensors,
        gathered from the shards (collective)."""
        if local and self.master_weights.sharded:
            groups = self.group_indices(inner_opt.param_groups)
            return self.local_state_dict(groups), local_inner(inner_opt.state_dict())
        return self.state_dict(), gather_full(inner_opt.state_dict())

    def load_checkpoint_state(self, inner_opt: torch.optim.Optimizer, state: dict) -> None:
        """Restore a state of whole tensors (resharded here) or of this rank's shards (``"sharding"`` in it)."""
        self.load_state_dict(state)
        inner_opt.load_state_dict(state["inner"])
        local = state.get("sharding") is not None
        (wrap_loaded if local else reshard_loaded)(inner_opt)
        if state["master_weights"]:
            self.master_weights.load_state_dict(state["master_weights"], local=local)

    def require_sharded(self, what: str, then: str) -> None:
        """Raise unless ``fleet.distributed_model`` has sharded the parameters (``what`` needs the shards).

        Raises:
            RuntimeError: naming ``what`` and the fix (``then``: what to do after sharding).
        """
        if not self.master_weights.sharded:
            raise RuntimeError(
                f"sharding stage 3 shards the parameters in fleet.distributed_model(model), and {what} needs "
                f"the shards, but this optimizer's parameters are not sharded yet: call "
                f"model = fleet.distributed_model(model) first (on every rank), {then}"
            )

    def checkpoint_layout(self, param_groups: Sequence[dict]) -> tuple[list[list[int]], dict | None]:
        """``(groups, layout)`` of this rank's shards (see the base class).

        Raises:
            RuntimeError: the parameters are not sharded yet (no ``fleet.distributed_model``).
        """
        self.require_sharded("loading a checkpoint", "then load it")
        groups = self.group_indices(param_groups)
        return groups, self.layout_state(groups)

    def layout_state(self, groups: Sequence[Sequence[int]]) -> dict:
        """The stage-3 layout this rank's local state belongs to (:meth:`ShardedParameters.layout_state`)."""
        return self.master_weights.layout_state(groups, self.mode)

    def local_state_dict(self, groups: Sequence[Sequence[int]]) -> dict:
        """Scaler type and state, in O2 this rank's FP32 shards, and their layout (no collective).

        Raises:
            RuntimeError: the parameters are not sharded yet (no ``fleet.distributed_model``).
        """
        self.require_sharded("saving its state", "then save")
        scaler = {"loss_scaler_type": "", "loss_scaler": {}} if self.scaler is None else super().state_dict()
        return {**scaler, "master_weights": self.master_weights.local_state_dict(),
                "sharding": self.layout_state(groups)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scaler (checked against this plugin's); a local state must be of this rank's layout.

        Raises:
            RuntimeError: the parameters are not sharded yet (no ``fleet.distributed_model``):
                state loaded now would not fit the shards FSDP2 makes.
            ValueError: ``state`` holds another rank's, world size's or stage's shards.
        """
        self.require_sharded("loading its state", "then load the checkpoint or state")
        saved = state.get("sharding")
        if saved is not None:
            own = self.layout_state(saved.get("groups", []))
            keys = ("stage", "world_size", "rank", "numels", "shapes")
            if any(saved.get(k) != own.get(k) for k in keys):
                found = {k: saved.get(k) for k in ("stage", "world_size", "rank")}
                raise ValueError(
                    f"this optimizer state holds the shards of {found}, not this rank's stage-3 shards "
                    f"({ {k: own.get(k) for k in ('stage', 'world_size', 'rank')} }). To resume at another world "
                    "size or stage, save and load with distamp.checkpoint.save_checkpoint / load_latest_checkpoint, "
                    "which re-slice"
                )
        FullPrecision.load_state_dict(self, state)
