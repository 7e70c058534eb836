"""Sharding stage 3: parameters sharded too, on torch's FSDP2 (``fully_shard``).

:class:`FullyShardedModel` is what ``fleet.distributed_model`` returns with
``strategy.sharding_configs = {"stage": 3}``. It does, in this order:

1. choose the units (:mod:`distamp.sharding.shard_units`), check that no
   two of them share a parameter and check the ``custom_black_varnames``
   patterns, before any collective, so bad
   configuration fails on every rank alike;
2. check that the ranks agree on the strategy and the model
   (:mod:`distamp.distributed.fingerprint`) and give every rank rank 0's
   parameters and buffers (``fully_shard`` shards what each rank has);
3. ``fully_shard`` the units, deepest first (a parent's call takes every
   parameter no child took, so children go first), then the root, with the
   policies of :mod:`distamp.sharding.fsdp_policy` and the reduce-scatter
   of :mod:`distamp.sharding.fsdp_comms` (16-bit wire, FP32 sum);
4. point the attached meta-optimizers at the DTensor parameters that
   replaced the ones they were built on, and have them check at each step
   that every rank ran the same units (:mod:`distamp.sharding.unit_trace`).

Every backward reduce-scatters (gradient merge's micro-batches included):
FSDP2 adds each micro-batch's reduced shard into the FP32 sharded gradient,
so nothing unsharded is kept between micro-batches. Loss scaling, the
agreed verdict, clipping and attribution run in the meta-optimizer on the
shards (:mod:`distamp.sharding.fully_sharded_precision`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from distamp.core.attached import FullyShardedOptimizer, ModelPrecision
from distamp.core.precision import o2_dtype_error_hint
from distamp.distributed.comm_hooks import CommStats
from distamp.distributed.devices import check_device
from distamp.distributed.fingerprint import check_ranks_agree
from distamp.distributed.groups import group_size
from distamp.distributed.timeouts import named_collective
from distamp.model_views import CONTIGUOUS_FIX, fp32_model_state_dict, non_contiguous, parameters_device, unwrap_model
from distamp.sharding.buffer_broadcast import BufferBroadcast, broadcast_from_rank0, buffer_sync
from distamp.sharding.fsdp_comms import InPlaceAllGather, WireReduceScatter
from distamp.sharding.fsdp_policy import unit_policies
from distamp.sharding.shard_units import choose_units, shared_parameters
from distamp.sharding.unit_trace import UnitTrace
from distamp.strategy import DistributedStrategy
from distamp.torch_compat import (
    fsdp_param_groups,
    fsdp_rederive_grad_dtypes,
    fsdp_unsharded_parameters,
    is_mixed_dtensor_error,
)

__all__ = ["FullyShardedModel"]

_Self = TypeVar("_Self", bound="FullyShardedModel")


class FullyShardedModel(nn.Module):
    """A model sharded with FSDP2 for AMP training (``fleet.distributed_model`` at sharding stage 3).

    Example::

        strategy.sharding = True
        strategy.sharding_configs = {"stage": 3}                 # units: the default (repeated blocks)
        optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters()), strategy)
        model = fleet.distributed_model(model)                   # either order of the two calls works
        with fleet.auto_cast():
            loss = F.cross_entropy(model(x), y)
        optimizer.minimize(loss)

    ``model.module`` is the user's model, now an FSDP2 module whose
    parameters are DTensors (each rank holds its FP32 shard). In a
    one-process world it is sharded over one rank, so the dtypes and the
    code path are those of a real job.

    Args:
        module: the model, already on its device.
        strategy: the strategy (``amp_configs`` for the policy,
            ``sharding_configs["units"]`` for the units).
        precision: the forward precision ``distamp.amp`` gives the model
            (which modules stay FP32 in O2, the FP32 forward of
            ``custom_black_varnames``): ``distamp.amp.ForwardPrecision``.
        process_group: the data-parallel group; ``None`` is the world.
        device: the device this process trains on (``fleet.device()``);
            every parameter and buffer must be there.
        broadcast_buffers: DDP's option of that name: rank 0's buffers are
            broadcast when the model is sharded and before each forward that
            follows a synced training forward (FSDP2 alone syncs none); False
            keeps each rank's own, at start-up too. ``None``: True.
        forward_sync_buffers: DDP's replacement of ``broadcast_buffers``
            (torch 2.13+): it rules the forward broadcast only, the one at
            start-up stays; given, ``broadcast_buffers`` is ignored, as DDP
            does (:func:`~distamp.sharding.buffer_broadcast.buffer_sync`).

    Raises:
        ValueError: a ``units`` or ``custom_black_varnames`` pattern matches
            no module, a tensor is on another device, a parameter is not
            contiguous, or ranks disagree.
    """

    def __init__(self, module: nn.Module, strategy: DistributedStrategy, precision: ModelPrecision, *,
                 process_group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 broadcast_buffers: bool | None = None, forward_sync_buffers: bool | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (FullyShardedModel, DistributedDataParallel, FSDPModule)):
            raise TypeError(f"model is already wrapped in {type(module).__name__}; pass the bare model")
        if not dist.is_initialized():
            raise RuntimeError("sharding stage 3 needs a process group: call fleet.init() first")
        device = check_device(module, torch.device(device)) if device is not None else parameters_device(module)
        units = choose_units(module, strategy.sharding_config.units)
        fp32_units = precision.fp32_modules(module)
        _check_nothing_shared(module, [*units, *fp32_units])
        _check_no_empty_trainable(module)
        _check_contiguous(module)
        self.module = module
        self.strategy = strategy
        self._black_modules = precision.keep_black_modules_in_fp32(module)
        self._unit_names = [name for name, _ in units]
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("sharding stage 3 needs a process group: call fleet.init() first")
        self._group_size = group_size(process_group)
        buffers = buffer_sync(broadcast_buffers, forward_sync_buffers)
        if self._group_size > 1:
            check_ranks_agree(strategy, module)
            with named_collective("the start-up broadcast of parameters from rank 0"):
                # DDP's broadcast_buffers=False leaves each rank its own buffers from the start too.
                states = [*module.parameters(), *(module.buffers() if buffers.at_build else ())]
                broadcast_from_rank0([t.detach() for t in states], group)
        before = list(module.named_parameters())
        self._reduce_scatter = WireReduceScatter()
        _shard(module, units, fp32_units, strategy, DeviceMesh.from_group(group, device.type), self._reduce_scatter)
        after = dict(module.named_parameters())
        module.register_load_state_dict_pre_hook(_shard_whole_tensors)
        sharded = {id(m) for m in module.modules() if isinstance(m, FSDPModule)}
        sharded_units = [(name, m) for name, m in unwrap_model(module).named_modules()
                         if m is not module and id(m) in sharded]
        self._unit_trace = UnitTrace(sharded_units)
        # Weak references: an id alone could be reused by a new tensor once the old parameter is freed.
        self._replaced = {id(old): (weakref.ref(old), after[name]) for name, old in before}
        self._optimizers: list[FullyShardedOptimizer] = []
        self._ran_forward = False
        # FSDP2's groups with no trainable parameter at its lazy init (the first forward); None before it.
        self._frozen_groups: list[tuple[Any, list[nn.Parameter]]] | None = None
        self._grad_sync = True
        self._forward_synced = True  # _grad_sync at the latest forward with gradients: its backward reduces
        # FSDP2 syncs no buffer: DDP's broadcast_buffers rule keeps BatchNorm statistics equal across ranks.
        self._buffer_broadcast = BufferBroadcast(module, group,
                                                 enabled=self._group_size > 1 and buffers.before_forward)

    # ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """True when the data-parallel group has more than one rank."""
        return self._group_size > 1

    @property
    def ddp(self) -> None:
        """Always ``None``: stage 3 uses FSDP2, not DDP."""
        return None

    @property
    def comm_stats(self) -> CommStats:
        """Reduce-scatters and wire bytes this rank sent for gradients."""
        return self._reduce_scatter.stats

    def _new_of(self, params: list[nn.Parameter]) -> dict[int, nn.Parameter]:
        """``{id(old): DTensor parameter}`` for each of ``params`` that ``fully_shard`` replaced."""
        found = {}
        for p in params:
            entry = self._replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                found[id(p)] = entry[1]
        return found

    def owns_any(self, params: list[nn.Parameter]) -> bool:
        """Whether any of ``params`` belongs to the model, sharded or as it was before sharding."""
        own = {id(p) for p in self.module.parameters()}
        return any(id(p) in own for p in params) or bool(self._new_of(params))

    def check_attachable(self, changes_dtypes: bool) -> None:
        """Raise for an optimizer that would convert the sharded parameters (a non-stage-3 O2 strategy).

        Raises:
            RuntimeError: ``changes_dtypes``.
        """
        if changes_dtypes:
            raise RuntimeError(_STRATEGY_MISMATCH)

    def attach_optimizer(self, optimizer: FullyShardedOptimizer) -> None:
        """Tie ``optimizer`` to this model: it follows the DTensor parameters and learns their names.

        Raises:
            RuntimeError: the optimizer's strategy is not sharding stage 3.
        """
        if optimizer in self._optimizers:
            return
        if optimizer.precision.stage != 3:
            raise RuntimeError(_STRATEGY_MISMATCH)
        new_of = self._new_of(optimizer.master_weights.model_params)
        if new_of:
            optimizer.adopt_sharded_parameters(new_of)
        optimizer.adopt_model(self.module, [])
        optimizer.add_sync_listener(self)
        optimizer.precision.check_unit_forwards(self._unit_trace)
        self._optimizers.append(optimizer)
        if self._ran_forward:
            optimizer.watch_local_grads(self._unsharded_parameters())

    def set_grad_sync(self, optimizer: Any, flag: bool) -> None:
        """Called by an attached optimizer; stage 3 reduce-scatters every micro-batch, so nothing changes."""

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute (nanoGPT and Accelerate set it for gradient accumulation): ``False`` skips the
        reduce-scatter of the following backward passes, which accumulate unsharded gradients locally; the
        next backward with it ``True`` reduces the sum (FSDP2's ``set_requires_gradient_sync``)."""
        return self._grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._grad_sync = bool(value)
        cast(FSDPModule, self.module).set_requires_gradient_sync(self._grad_sync)  # the root is an FSDPModule

    def backward_communicates(self) -> bool:
        """Whether the backward of the latest forward with gradients reduce-scatters them (False: inside
        :meth:`no_sync`, each rank keeps its own unsharded gradient); read after each ``optimizer.backward``."""
        return self._forward_synced

    def backward_bypassed(self) -> bool:
        """Always False: FSDP2 reduce-scatters every backward, also one of a forward through ``model.module``."""
        return False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate unsharded FP32 gradients locally: backward passes run inside skip the reduce-scatter."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the sharded module (FSDP2 all-gathers each unit before it runs).

        Raises:
            RuntimeError: the forward read a parameter outside its unit's
                forward, where it is a shard; the message names the units.
                In O2, torch's dtype error of a forward outside
                ``fleet.auto_cast()`` gets the fix added, as without sharding.
        """
        self._buffer_broadcast.before_forward()
        self._follow_unfrozen_units()
        if torch.is_grad_enabled():
            self._forward_synced = self._grad_sync
        try:
            output = self.module(*args, **kwargs)
        except RuntimeError as error:
            if not is_mixed_dtensor_error(error):
                hint = o2_dtype_error_hint(self.strategy, error)
                if hint is None:
                    raise
                raise RuntimeError(f"{error}\n{hint}") from error
            raise RuntimeError(_read_outside_unit(self._unit_names)) from error
        self._buffer_broadcast.after_forward(self.require_backward_grad_sync)
        if not self._ran_forward:
            # Every unit has been all-gathered once: its unsharded parameters exist (FSDP2 reuses them).
            self._ran_forward = True
            named = self._unsharded_parameters()
            for optimizer in self._optimizers:
                optimizer.watch_local_grads(named)
        return output

    def _follow_unfrozen_units(self) -> None:
        """Gradual unfreezing: a unit entirely frozen at the first forward gets its gradient dtypes once trainable.

        FSDP2 (before torch 2.15) fixes each unit's gradient dtypes at its lazy init, from the
        parameters trainable then; a unit with none would reduce its later
        gradients in the wrong dtype (O2: torch fails in backward; O1: an
        FP32 wire instead of ``comm_dtype``).
        """
        if self._frozen_groups is None:  # this forward runs FSDP2's lazy init
            self._frozen_groups = [(group, params) for group, params in fsdp_param_groups(self.module)
                                   if not any(p.requires_grad for p in params)]
            return
        if not any(p.requires_grad for _, params in self._frozen_groups for p in params):
            return
        still_frozen = []
        for group, params in self._frozen_groups:
            if any(p.requires_grad for p in params):
                fsdp_rederive_grad_dtypes(group)
            else:
                still_frozen.append((group, params))
        self._frozen_groups = still_frozen

    def _unsharded_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, unsharded parameter)`` of each parameter gathered so far: where autograd puts local gradients."""
        names = {id(p): name for name, p in unwrap_model(self.module).named_parameters()}
        return [(names[id(sharded)], unsharded) for sharded, unsharded in fsdp_unsharded_parameters(self.module)
                if id(sharded) in names]

    # -- moves yes, casts no ---------------------------------------------------
    # FSDP2 replaces each DTensor parameter by swapping in its converted copy; a dtype change of a sharded
    # parameter fails deep inside torch ("Couldn't swap ..."), so it is refused first, saying what works.

    def to(self: _Self, *args: Any, **kwargs: Any) -> _Self:
        """``nn.Module.to``: a move works; a dtype change raises ``RuntimeError`` (cast before sharding)."""
        self._refuse_cast(lambda t: t.to(*args, **kwargs), "model.to(...)")
        return super().to(*args, **kwargs)

    def type(self: _Self, dst_type: torch.dtype | str) -> _Self:
        """``nn.Module.type``: refused with ``RuntimeError`` unless it keeps the parameters' dtype."""
        self._refuse_cast(lambda t: t.type(dst_type), f"model.type({dst_type!r})")
        return super().type(dst_type)

    def half(self: _Self) -> _Self:
        """``nn.Module.half``: refused with ``RuntimeError`` (cast before ``fleet.distributed_model``)."""
        self._refuse_cast(lambda t: t.half(), "model.half()")
        return super().half()

    def bfloat16(self: _Self) -> _Self:
        """``nn.Module.bfloat16``: refused with ``RuntimeError`` (cast before ``fleet.distributed_model``)."""
        self._refuse_cast(lambda t: t.bfloat16(), "model.bfloat16()")
        return super().bfloat16()

    def float(self: _Self) -> _Self:
        """``nn.Module.float``: a no-op on the FP32 shards; refused with ``RuntimeError`` on any other dtype."""
        self._refuse_cast(lambda t: t.float(), "model.float()")
        return super().float()

    def double(self: _Self) -> _Self:
        """``nn.Module.double``: refused with ``RuntimeError`` (cast before ``fleet.distributed_model``)."""
        self._refuse_cast(lambda t: t.double(), "model.double()")
        return super().double()

    def _refuse_cast(self, convert: Callable[[torch.Tensor], torch.Tensor], call: str) -> None:
        """``RuntimeError`` when ``convert`` (a tensor conversion) would change a floating parameter's dtype."""
        for dtype, device in {(p.dtype, p.device) for p in self.module.parameters() if p.is_floating_point()}:
            to = convert(torch.empty(0, dtype=dtype, device=device)).dtype
            if to != dtype:
                raise RuntimeError(
                    f"{call} after fleet.distributed_model would cast the sharded {dtype} parameters to {to}, "
                    "and FSDP2 cannot cast sharded parameters (sharding stage 3). Cast the model before "
                    "fleet.distributed_model; for mixed precision keep the model FP32 and set "
                    "amp_configs['dtype'] (and 'use_pure_fp16') instead. Moves (model.to(device)) work"
                )

    def fp32_state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict()`` with every parameter as a full FP32 tensor (collective).

        Keys are the module's own (no ``module.`` prefix).
        """
        return fp32_model_state_dict(self.module, [opt.master_weights for opt in self._optimizers])


def _read_outside_unit(units: list[str]) -> str:
    shown = ", ".join(repr(u) for u in units[:8]) + (f", ... ({len(units)} in all)" if len(units) > 8 else "")
    return (
        "sharding stage 3: the forward used a parameter outside the forward of the unit that holds it, where "
        "it is still a shard (FSDP2 gathers a unit's parameters only while that unit runs): e.g. a tied weight "
        "read outside its embedding (x @ self.embed.weight.t()) or a module reading a child's weight. Put the "
        "reader and the owner in one unit: name the units in sharding_configs['units'] so that the owner is "
        f"not a unit apart (what no unit takes stays in the root). Units now: [{shown}]"
    )


_STRATEGY_MISMATCH = (
    "the model is sharded with sharding stage 3 (fleet.distributed_model), but the optimizer's strategy is not "
    "stage 3; pass the same strategy (strategy.sharding = True, sharding_configs={'stage': 3}) to "
    "fleet.distributed_optimizer and fleet.distributed_model"
)


def _shard_whole_tensors(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook of the sharded root: a whole tensor (an unsharded checkpoint's, or
    ``fp32_state_dict``'s) for a DTensor parameter becomes this rank's shard of it (no collective). Every name of
    a tied parameter (an embedding shared with the output head) is one the state dict holds."""
    for name, param in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh,
                                                          param.placements, src_data_rank=None)


def _check_nothing_shared(module: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """Refuse units that share a parameter (FSDP2 would, after the start-up broadcast), naming it and them.

    Raises:
        ValueError: naming the first shared parameter, its holders and the fix.
    """
    shared = shared_parameters(module, units)
    if shared:
        name, holders = shared[0]
        shown = [repr(h) if h else "the root" for h in holders]
        raise ValueError(
            f"sharding stage 3: parameter {name!r} is held by {' and '.join(shown)}, but FSDP2 shards a parameter "
            "in one unit only (tied weights, one Parameter set on two modules). Name units in "
            "sharding_configs['units'] that leave every module holding it in one unit, or in the root; units now: "
            f"{[n for n, _ in units]}."
        )


def _check_no_empty_trainable(module: nn.Module) -> None:
    """Refuse a trainable parameter without elements, which FSDP2's reduce-scatter fails on, naming it.

    torch's ``fully_shard`` accepts it and fails in the first backward
    ("_chunk_cat expects non-empty tensor"), after collectives ran.

    Raises:
        ValueError: naming the parameters and the fix.
    """
    empty = [name for name, p in module.named_parameters() if p.requires_grad and p.numel() == 0]
    if empty:
        raise ValueError(
            f"sharding stage 3: parameters {empty} have no elements; FSDP2's gradient reduce-scatter fails on "
            "them in the first backward (torch: '_chunk_cat expects non-empty tensor'). Remove them, register "
            "them as buffers, or set requires_grad=False on them before fleet.distributed_model (stages 1 and 2 "
            "train them)."
        )


def _check_contiguous(module: nn.Module) -> None:
    """Refuse parameters FSDP2 cannot shard (``channels_last``, a transposed view), naming them and the fix.

    torch's ``fully_shard`` raises ``NotImplementedError`` without the
    parameter's name, after the start-up collectives and with the units
    before it already sharded.

    Raises:
        ValueError: naming each such parameter with its shape and strides, and the fix.
    """
    strided = non_contiguous(module.named_parameters())
    if strided:
        raise ValueError(
            f"sharding stage 3: parameters {', '.join(strided)} are not contiguous (channels_last, or a transposed "
            "view); FSDP2 shards rows of contiguous parameters only (torch: 'FSDP does not support non-contiguous "
            f"parameters'). Make them contiguous before fleet.distributed_model: {CONTIGUOUS_FIX}"
        )


def _shard(module: nn.Module, units: list[tuple[str, nn.Module]], fp32_units: list[tuple[str, nn.Module]],
           strategy: DistributedStrategy, mesh: DeviceMesh, reduce_scatter: WireReduceScatter) -> None:
    """``fully_shard`` every unit (deepest first), then the root; install the wire reduce-scatter."""
    policies = unit_policies(strategy)
    fp32_ids = {id(m) for _, m in fp32_units}
    chosen = dict.fromkeys(id(m) for _, m in [*units, *fp32_units])
    by_id = {id(m): (name, m) for name, m in [*units, *fp32_units]}
    ordered = sorted((by_id[i] for i in chosen), key=lambda item: -item[0].count("."))
    for _, unit in ordered:
        fully_shard(unit, mesh=mesh, mp_policy=policies.fp32 if id(unit) in fp32_ids else policies.default)
    fully_shard(module, mesh=mesh, mp_policy=policies.default)
    all_gather = InPlaceAllGather() if mesh.device_type == "cpu" else None
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_reduce_scatter(reduce_scatter)
            if all_gather is not None:
                m.set_custom_all_gather(all_gather)
