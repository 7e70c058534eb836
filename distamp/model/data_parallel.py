"""Data parallelism for AMP training on torch's DDP reducer.

:class:`DataParallel` is what ``fleet.distributed_model`` returns. It wraps
``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped
all-reduce) and adds what AMP needs around it: modules named in
``custom_black_varnames`` run in FP32, O2 parameters that stay FP32 get
their exact values back, FP32 masters are broadcast from rank 0, a comm hook
puts gradients on the wire in 16 bits, and only the last micro-batch of a
gradient-merge window communicates.

The model is prepared once, in :meth:`DataParallel.prepare`
(:mod:`distamp.model.ddp_preparation`: the checks, the start-up
broadcast, DDP and its comm hook): when the first optimizer is attached
(whichever of ``fleet.distributed_optimizer`` and
``fleet.distributed_model`` comes second), or at the first forward if no
optimizer comes. By then parameter dtypes are final, so DDP (whose buckets
are per dtype) is built exactly once, and outside any ``torch.compile``d
region.

With ``strategy.sharding`` stage 1 the comm hook reduce-scatters instead of
all-reducing (:mod:`distamp.sharding.reduce_scatter`); stage 2 replaces
DDP by :class:`~distamp.sharding.slice_reducer.SliceReducer`, which
reduce-scatters the same way from small 16-bit buckets and frees each
``.grad`` as soon as it is in one. In both, every backward communicates,
gradient merge's micro-batches included: each is summed into the owners'
FP32 gradient slices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import BlackModulesHandle, keep_in_fp32
from distamp.amp.fp32_parameters import fp32_parameters
from distamp.compression.powersgd import PowerSGD, refuse_optimizers
from distamp.core.attached import AttachedOptimizer
from distamp.core.precision import o2_dtype_error_hint
from distamp.distributed.comm_hooks import CommStats, LowPrecisionAllReduce
from distamp.distributed.devices import check_device
from distamp.distributed.groups import group_size
from distamp.model.ddp_preparation import DDPPreparation, later_torch_reason, refuse_stage2_kwargs
from distamp.model_views import fp32_model_state_dict, unwrap_model, user_name
from distamp.sharding.buffer_broadcast import warn_of_deprecated_buffer_option
from distamp.sharding.param_gather_hooks import ForwardParamGather
from distamp.sharding.reduce_scatter import ShardedGradReduce
from distamp.sharding.slice_reducer import SliceReducer
from distamp.strategy import DistributedStrategy
from distamp.suggest import listed
from distamp.torch_compat import DDP_KEYWORDS, ddp_has_rebuilt_buckets, ddp_ignored_names

__all__ = ["DataParallel", "strategy_fp32_parameters"]

_DEVICE_SET = "distamp builds DDP on the device it trains on (fleet.device(): cuda:LOCAL_RANK with CUDA, else the CPU)"
_BUCKETS_SET = "the bucket size is strategy.fuse_grad_size_in_MB: set that instead"
_SET_BY_DISTAMP = {
    "device_ids": _DEVICE_SET,
    "output_device": _DEVICE_SET,
    "gradient_as_bucket_view": "distamp always builds DDP with gradient_as_bucket_view=True (each .grad is a view "
                               "of its bucket: no second copy of the gradients)",
    "bucket_cap_mb": _BUCKETS_SET,
    "bucket_cap_mb_list": _BUCKETS_SET,
}
"""DDP's keyword arguments distamp sets itself where it builds DDP (sharding off, stage 1), and what to do instead."""
_DDP_KWARGS = tuple(name for name in DDP_KEYWORDS
                    if name not in ("process_group", "find_unused_parameters", *_SET_BY_DISTAMP))
"""DDP's keyword arguments a user may pass through (the others distamp sets or takes itself)."""


def _refuse_unknown_kwargs(ddp_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for names neither DDP nor ``fleet.distributed_model`` takes (a later torch's DDP
    argument named with the torch version that has it)."""
    unknown = sorted(set(ddp_kwargs) - set(_DDP_KWARGS) - set(_SET_BY_DISTAMP))
    if not unknown:
        return
    later = [f"{name}: {reason}" for name in unknown if (reason := later_torch_reason(name)) is not None]
    raise ValueError(
        f"{unknown} are not keyword arguments of fleet.distributed_model"
        + (f" ({'; '.join(later)})" if later else "")
        + f"; it takes process_group, find_unused_parameters and these of DDP's: {list(_DDP_KWARGS)}"
    )


def _check_ddp_kwargs(strategy: DistributedStrategy, ddp_kwargs: dict[str, Any]) -> None:
    """Refuse DDP keyword arguments that ``strategy``'s path would not use."""
    if strategy.sharding and strategy.sharding_config.stage == 2:
        refuse_stage2_kwargs(ddp_kwargs)
    _refuse_static_graph_with_merge(strategy, ddp_kwargs)
    _refuse_ddp_mixed_precision(strategy, ddp_kwargs)


def _refuse_ddp_mixed_precision(strategy: DistributedStrategy, ddp_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for DDP's own ``mixed_precision`` where distamp registers a comm hook on DDP.

    DDP's ``mixed_precision`` registers its comm hook when DDP is built,
    so distamp's (AMP's wire cast, stage 1's reduce-scatter, PowerSGD) could
    not be registered: torch raised "register_comm_hook ... can only be
    called once" at the first forward, after the start-up collectives.
    """
    if ddp_kwargs.get("mixed_precision") is None:
        return
    users = [name for name, on in (("strategy.amp", strategy.amp), ("strategy.powersgd", strategy.powersgd),
                                   ("sharding stage 1", strategy.sharding)) if on]
    if users:
        raise ValueError(
            "fleet.distributed_model(..., mixed_precision=...): DDP's own mixed precision registers its comm hook "
            f"in place of the one distamp registers for {' and '.join(users)}; set the precision with "
            "strategy.amp = True and amp_configs (dtype, use_pure_fp16, comm_dtype) and remove mixed_precision"
        )


def strategy_fp32_parameters(module: nn.Module, strategy: DistributedStrategy) -> list[nn.Parameter]:
    """Parameters of ``module`` that O2 keeps in FP32 under ``strategy``.

    Raises ``ValueError`` naming a ``custom_black_varnames`` pattern that
    matches no submodule.
    """
    if not strategy.amp:
        return []
    cfg = strategy.amp_config
    return fp32_parameters(module, cfg.custom_black_varnames, cfg.keep_norm_fp32)


class _Runtime:
    """DataParallel's plain (non-Module) state, so DDP is not registered as a submodule."""

    def __init__(self, module: nn.Module) -> None:
        self.ddp: DistributedDataParallel | None = None
        self.comm_hook: LowPrecisionAllReduce | ShardedGradReduce | PowerSGD | None = None
        self.reducer: SliceReducer | None = None  # sharding stage 2, instead of DDP
        self.optimizers: list[AttachedOptimizer] = []
        self.optimizer_sync: dict[int, bool] = {}
        self.merge_sync = True  # all(optimizer_sync): a plain bool for forward (torch.compile guards on it)
        self.reduce_scatter = False  # sharding stage 1 or 2: every micro-batch communicates
        self.sync_enabled = True
        self.forward_synced = True  # sync_enabled at the latest forward with gradients: its backward reduces
        self.forward_pending = False  # a forward with gradients ran since the latest optimizer.backward
        self.prepared = False
        self.param_gather = ForwardParamGather(module)  # overlap_param_gather: finished in forward
        # Parameters frozen when DDP (or stage 2's reducer) was built, which therefore never reduces them.
        self.frozen_at_build: dict[str, nn.Parameter] = {}
        # Each parameter's dtype, device and strides when the reducer was built (see _refuse_converted).
        self.layout_at_build: list[tuple[str, nn.Parameter, torch.dtype, torch.device, tuple[int, ...]]] = []


class DataParallel(nn.Module):
    """Data-parallel wrapper for AMP training (``fleet.distributed_model``).

    Example::

        fleet.init()
        optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        model = fleet.distributed_model(model)   # either order of the two calls works
        with fleet.auto_cast():
            loss = F.cross_entropy(model(x), y)

    At the first forward, every rank takes rank 0's parameters, buffers and
    FP32 masters, so every rank starts identical. In a one-process world the
    module is called directly (no DDP) and only the FP32 handling applies.
    ``model.module`` is the original model; ``state_dict()`` keys are
    ``module.<name>``, as with DDP.

    Args:
        module: the model, already on its device.
        strategy: the strategy whose ``amp_configs`` decide the wire dtype,
            the pre-division factor and the FP32 modules.
        find_unused_parameters: passed to DDP; ``None`` takes the
            strategy's ``find_unused_parameters``.
        process_group: the data-parallel group; ``None`` is the world.
        device: the device this process trains on (``fleet.device()``); every
            parameter and buffer must be there (``ValueError`` naming the first
            that is not). ``None``: not checked, DDP uses the parameters' device.
        ddp_kwargs: further keyword arguments for DDP (e.g. ``static_graph``).
            Sharding stage 2 uses no DDP and takes only ``broadcast_buffers``,
            ``forward_sync_buffers`` (torch 2.13+), ``init_sync`` and
            ``static_graph`` (which it needs no hint for).

    Raises:
        ValueError: a keyword argument DDP does not take, a DDP argument distamp sets
            itself, or one stage 2 cannot honour.
    """

    def __init__(
        self,
        module: nn.Module,
        strategy: DistributedStrategy,
        *,
        find_unused_parameters: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (DataParallel, DistributedDataParallel)):
            raise TypeError(f"model is already wrapped in {type(module).__name__}; pass the bare model")
        _refuse_unknown_kwargs(ddp_kwargs)
        _check_ddp_kwargs(strategy, ddp_kwargs)  # stage 2 first: it builds no DDP, so its reasons differ
        for name, reason in _SET_BY_DISTAMP.items():
            if name in ddp_kwargs:
                raise ValueError(f"{name}={ddp_kwargs[name]!r} is set by distamp: {reason}; remove it")
        self.module = module
        self._find_unused_arg = find_unused_parameters
        self._process_group = process_group
        self._device = None if device is None else check_device(module, torch.device(device))
        self._ddp_kwargs = ddp_kwargs
        self._runtime = _Runtime(module)
        self._runtime.prepared = not self.distributed  # one process: nothing to agree on or build
        if not self.distributed:  # DDP, built in a one-process world too, would warn (as stage 3 does)
            warn_of_deprecated_buffer_option(ddp_kwargs.get("broadcast_buffers"),
                                             ddp_kwargs.get("forward_sync_buffers"))
        self._black_modules: BlackModulesHandle | None = None
        self.strategy_is_default = False
        self._configure(strategy)

    def _configure(self, strategy: DistributedStrategy) -> None:
        self.strategy = strategy
        self.find_unused_parameters = (
            strategy.find_unused_parameters if self._find_unused_arg is None else self._find_unused_arg
        )
        self._fp32_params = strategy_fp32_parameters(self.module, strategy)
        cfg = strategy.amp_config
        self._black_modules = (
            keep_in_fp32(self.module, cfg.custom_black_varnames)
            if strategy.amp and cfg.custom_black_varnames else None
        )

    def follow_strategy(self, strategy: DistributedStrategy) -> None:
        """Build on ``strategy`` instead of the default one this wrapper was made with.

        ``fleet.distributed_model`` called before any strategy was known (none
        given to it or to ``fleet.init``) wraps the model on a default
        strategy; the first ``fleet.distributed_optimizer`` of its parameters
        then brings the job's strategy, which the wrapper takes before the
        optimizer is attached (either order of the two calls works).

        Raises:
            RuntimeError: the wrapper was already prepared (it ran a forward),
                or ``strategy`` shards at stage 3, which needs the model
                sharded by ``fleet.distributed_model`` itself.
            ValueError: the wrapper's DDP keyword arguments do not fit ``strategy``.
        """
        if (self._runtime.prepared and self.distributed) or self._runtime.optimizers:
            raise RuntimeError(
                "fleet.distributed_model(model) was called before any strategy was known and the model has "
                "already run a forward or been given an optimizer on that default strategy; pass the strategy "
                "to fleet.distributed_model (or to fleet.init) before the first forward"
            )
        if strategy.sharding and strategy.sharding_config.stage == 3:
            raise RuntimeError(
                "fleet.distributed_model(model) was called before any strategy was known, so it wrapped the "
                "model for data parallelism; sharding stage 3 shards the model in fleet.distributed_model: "
                "call it after fleet.distributed_optimizer, or pass it the strategy"
            )
        _check_ddp_kwargs(strategy, self._ddp_kwargs)
        if self._black_modules is not None:
            self._black_modules.remove()
        self._configure(strategy)
        self.strategy_is_default = False

    # ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """True when the data-parallel group has more than one rank (DDP is used)."""
        return group_size(self._process_group) > 1

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The underlying DDP module (``None`` before it is built, in a one-process run and under sharding stage 2)."""
        return self._runtime.ddp

    @property
    def reducer(self) -> SliceReducer | None:
        """Sharding stage 2's gradient reducer, which replaces DDP (``None`` otherwise and before it is built)."""
        return self._runtime.reducer

    @property
    def comm_stats(self) -> CommStats | None:
        """Calls and bytes of the gradient comm hook or stage 2's reducer (``None``: no DDP, or AMP off unsharded)."""
        runtime = self._runtime
        if runtime.reducer is not None:
            return runtime.reducer.stats
        return runtime.comm_hook.stats if runtime.comm_hook is not None else None

    def owns_any(self, params: list[nn.Parameter]) -> bool:
        """Whether any of ``params`` belongs to the wrapped module."""
        own = {id(p) for p in self.module.parameters()}
        return any(id(p) in own for p in params)

    def check_attachable(self, changes_dtypes: bool) -> None:
        """Raise before an optimizer that would change parameter dtypes is built too late.

        Raises:
            RuntimeError: the model was already prepared (an optimizer was
                attached or it ran a forward: DDP is built on the parameters'
                dtypes) and the optimizer is O2.
        """
        if self._runtime.prepared and changes_dtypes and self.distributed:
            raise RuntimeError(
                "fleet.distributed_optimizer(...) with use_pure_fp16 was called after the model's data-parallel "
                "wrapper was built on the parameters' dtypes (when its first optimizer was attached, or at its "
                "first forward). Build every optimizer of the model before its first forward, and, with several "
                "optimizers on one model, before fleet.distributed_model."
            )

    def attach_optimizer(self, optimizer: AttachedOptimizer) -> None:
        """Tie ``optimizer`` to this model (``fleet`` calls it for either order of the two calls).

        Its FP32-kept parameters get their exact values back now; its masters
        are broadcast from rank 0 when the model is prepared.

        Raises:
            RuntimeError: see :meth:`check_attachable`.
        """
        self.attach_optimizers([optimizer])

    def attach_optimizers(self, optimizers: Sequence[AttachedOptimizer]) -> None:
        """Tie each of ``optimizers`` to this model, then prepare it once (collective).

        ``fleet.distributed_model`` hands over every optimizer built on the
        model's parameters before it, in the order they were built (the same
        on every rank): all are attached before DDP is built on the
        parameters' dtypes and their masters are broadcast.

        Raises:
            RuntimeError: see :meth:`check_attachable`; or ``strategy.powersgd``
                and a second optimizer (before any collective).
        """
        runtime = self._runtime
        new = [opt for opt in dict.fromkeys(optimizers) if opt not in runtime.optimizers]
        for optimizer in new:
            self.check_attachable(changes_dtypes=optimizer.master_weights.enabled)
        if new and self.distributed and self.strategy.powersgd:
            # Before the start-up collectives (or, once prepared, before the optimizer is half attached).
            refuse_optimizers(len(runtime.optimizers) + len(new))
        for optimizer in new:
            optimizer.adopt_model(self.module, self._fp32_params)
            runtime.optimizers.append(optimizer)
            optimizer.add_sync_listener(self)
            if self.distributed:
                runtime.param_gather.attach(optimizer)
                if runtime.prepared:
                    self._bind_compressor(optimizer)
        if new and self.distributed:
            # The second of the two fleet calls prepares (collective: every rank makes both calls).
            self.prepare()

    def set_grad_sync(self, optimizer: AttachedOptimizer, flag: bool) -> None:
        """Called by an attached optimizer: whether its next backward closes a merge window."""
        runtime = self._runtime
        runtime.optimizer_sync[id(optimizer)] = flag
        runtime.merge_sync = all(runtime.optimizer_sync.values())

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: whether the backward of the next forward communicates (default True).

        Set it to ``False`` for the micro-batches of a gradient-accumulation
        window and back to ``True`` before the last one's forward, as nanoGPT
        and Accelerate do with torch's DDP: the backward of a forward run with
        it ``False`` skips the all-reduce and ``.grad`` accumulates locally;
        the next backward with it ``True`` reduces the accumulated sum. As
        with DDP it is read at each forward, and :meth:`no_sync` is the same
        switch (it sets ``False`` and restores the previous value).
        """
        return self._runtime.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._runtime.sync_enabled = bool(value)

    def backward_communicates(self) -> bool:
        """Whether the backward of the latest forward with gradients reduces them over the ranks.

        False when that forward ran inside :meth:`no_sync` (or with
        ``require_backward_grad_sync = False``): its backward leaves each
        rank's own gradient, for a later synced backward to reduce. Read by
        the attached optimizers after each ``optimizer.backward``.
        """
        return self._runtime.forward_synced or not self.distributed

    def backward_bypassed(self) -> bool:
        """Whether the latest backward had no forward of this wrapper before it, so DDP reduced nothing.

        DDP reduces the backward of a forward it ran, once: a backward of a
        forward through ``model.module`` (or a second backward of one forward)
        leaves each rank's own gradient, and each rank (at sharding stage 1,
        each slice's owner) would apply its own. Stage 2's reducer (hooks on
        the parameters) reduces every backward, so this is False there and
        without DDP. Read by the attached optimizer after each
        ``optimizer.backward``; the read uses up the forward.
        """
        runtime = self._runtime
        pending, runtime.forward_pending = runtime.forward_pending, False
        return runtime.ddp is not None and not pending

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes run inside skip the all-reduce."""
        runtime = self._runtime
        previous = runtime.sync_enabled
        runtime.sync_enabled = False
        try:
            yield
        finally:
            runtime.sync_enabled = previous

    @torch.compiler.disable
    def prepare(self) -> None:
        """Check the ranks agree, make them identical and build DDP; runs once (collective).

        Called when the first optimizer is attached, else at the first
        forward; never traced by ``torch.compile``. The work is
        :class:`~distamp.model.ddp_preparation.DDPPreparation`'s.
        """
        runtime = self._runtime
        if runtime.prepared:
            return
        runtime.prepared = True
        if not self.distributed:
            return
        preparation = DDPPreparation(self.module, self.strategy, self._process_group, self._device,
                                     self.find_unused_parameters, self._ddp_kwargs)
        prepared = preparation.run(runtime.optimizers)
        ignored = ddp_ignored_names(self.module)  # DDP's names: those of self.module, wrappers included
        runtime.frozen_at_build = {user_name(self.module, name): p for name, p in self.module.named_parameters()
                                   if not p.requires_grad and name not in ignored}
        runtime.layout_at_build = [(name, p, p.dtype, p.device, p.stride())
                                   for name, p in unwrap_model(self.module).named_parameters()]
        runtime.ddp, runtime.comm_hook, runtime.reduce_scatter, runtime.reducer = (
            prepared.ddp, prepared.comm_hook, prepared.reduce_scatter, prepared.reducer
        )
        for optimizer in runtime.optimizers:
            self._bind_compressor(optimizer)

    def _bind_compressor(self, optimizer: AttachedOptimizer) -> None:
        """PowerSGD: the optimizer reports each step's agreed verdict to the hook (keep or drop its state)."""
        hook = self._runtime.comm_hook
        if isinstance(hook, PowerSGD):
            optimizer.bind_compressor(hook)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (through DDP when distributed)."""
        runtime = self._runtime
        if not runtime.prepared:
            self.prepare()
        if any(p.requires_grad for p in runtime.frozen_at_build.values()):
            self._refuse_unfrozen()
        if torch.is_grad_enabled() and any(p.dtype != dtype or p.device != device or p.stride() != strides
                                           for _, p, dtype, device, strides in runtime.layout_at_build):
            self._refuse_converted()  # a forward without gradients reduces nothing: converting for evaluation is fine
        if torch.is_grad_enabled():
            runtime.forward_synced = runtime.sync_enabled
            runtime.forward_pending = True  # a constant: torch.compile guards on no counter
        ddp = runtime.ddp
        try:
            if runtime.reducer is not None:
                runtime.reducer.before_forward(runtime.sync_enabled)
                args, kwargs = runtime.reducer.inputs_to_device(args, kwargs)
                return runtime.reducer.watch(self.module(*args, **kwargs))
            if ddp is None:
                return self.module(*args, **kwargs)
            # Stage 1 reduce-scatters every micro-batch: the owners sum them in FP32 slices.
            ddp.require_backward_grad_sync = runtime.sync_enabled and (runtime.reduce_scatter or runtime.merge_sync)
            ddp.training = self.training
            rebuilt = ddp_has_rebuilt_buckets(ddp)
            if (not rebuilt and runtime.reduce_scatter and not ddp.find_unused_parameters
                    and not any(opt.grads_await_step() for opt in runtime.optimizers)):
                _free_zero_grads(ddp)
            output = ddp(*args, **kwargs)
        except RuntimeError as exc:
            hint = o2_dtype_error_hint(self.strategy, exc)
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n{hint}") from exc
        if not rebuilt and ddp_has_rebuilt_buckets(ddp):
            # The first forward after the first backward rebuilds DDP's buckets; with
            # gradient_as_bucket_view each .grad becomes a view of a new bucket: same values, new tensor.
            for optimizer in runtime.optimizers:
                optimizer.grads_reseated()
        return output

    def _refuse_unfrozen(self) -> None:
        """Raise: a parameter frozen when the reducer was built is trainable now, and nothing would reduce it."""
        names = [name for name, p in self._runtime.frozen_at_build.items() if p.requires_grad]
        raise RuntimeError(
            f"{names} had requires_grad=False when fleet.distributed_model built its gradient reducer (when the "
            "first optimizer was attached, or at the first forward), so their gradients would not be averaged "
            "over the ranks: each rank (with sharding stages 1 and 2, each slice's owner) would apply its own. "
            "To unfreeze parameters during training, make them trainable before that, set "
            "strategy.find_unused_parameters = True and freeze them after fleet.distributed_model until their "
            "time."
        )

    def _refuse_converted(self) -> None:
        """Raise: a parameter changed dtype or device since the reducer was built, which no longer sees its gradient.

        Assigning data of another dtype or device to a parameter (what
        ``model.half()``, ``model.to(dtype)`` or ``model.to(device)`` do)
        gives it a new gradient accumulator, so DDP's hooks (and stage 2's)
        never fire for it: each rank would apply its own gradient.
        """
        changed = [f"{name} ({dtype} on {device} -> {p.dtype} on {p.device})"
                   for name, p, dtype, device, _ in self._runtime.layout_at_build
                   if p.dtype != dtype or p.device != device]
        if not changed:
            self._refuse_relaid()
            return
        shown = listed(changed, 3)
        raise RuntimeError(
            f"parameters {shown} changed dtype or device after fleet.distributed_model built its gradient "
            "reducer (when the first optimizer was attached, or at the first forward), so their gradients would "
            "no longer be averaged over the ranks: each rank would apply its own. Move and convert the model "
            "before fleet.distributed_model and fleet.distributed_optimizer (model.to(fleet.device())), and for "
            "16-bit weights set amp_configs['use_pure_fp16'] = True instead of calling model.half() or "
            "model.to(dtype)"
        )

    def _refuse_relaid(self) -> None:
        """Raise: a parameter changed memory format since the reducer was built (a layout of the same order passes).

        DDP lays out each gradient in its bucket with the strides its
        parameter had when the buckets were built; a parameter made
        ``channels_last`` after that gets its reduced gradient on other
        elements (torch's DDP only warns "Grad strides do not match bucket
        view strides"), and distamp's comm hooks, which index the bucket as
        the parameter, add the gradient-merge sum and compress onto others.
        Strides that differ only in dims of size 1 describe the same layout.
        """
        changed = [f"{name} (strides {strides} -> {p.stride()})"
                   for name, p, _, _, strides in self._runtime.layout_at_build
                   if len(strides) != p.dim()
                   or _unit_dims_dropped(p.shape, p.stride()) != _unit_dims_dropped(p.shape, strides)]
        if not changed:
            # Only size-1 dims' strides moved: the same memory order. Take the new strides, check again next time.
            self._runtime.layout_at_build = [(name, p, dtype, device, p.stride())
                                             for name, p, dtype, device, _ in self._runtime.layout_at_build]
            return
        raise RuntimeError(
            f"parameters {listed(changed, 3)} changed memory format after fleet.distributed_model built its "
            "gradient reducer (when the first optimizer was attached, or at the first forward): DDP keeps each "
            "gradient in its bucket in the layout its parameter had then, so the reduced gradient would land on "
            "other elements (torch's DDP warns 'Grad strides do not match bucket view strides'). Change the memory "
            "format before fleet.distributed_model (model.to(memory_format=torch.channels_last) right after "
            "building the model)"
        )

    def fp32_state_dict(self) -> dict[str, Any]:
        """The wrapped model's ``state_dict()`` with every parameter in exact FP32 (from the masters).

        In O2 the model holds 16-bit weights; this is what to export for
        inference or fine-tuning in FP32. Keys are the module's own (no
        ``module.`` prefix).
        """
        return fp32_model_state_dict(self.module, [opt.master_weights for opt in self._runtime.optimizers])


def _unit_dims_dropped(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, ...]:
    """``strides`` without those of dims of size 1, which address no second element: equal ones, equal layouts."""
    return tuple(stride for size, stride in zip(shape, strides, strict=True) if size != 1)


def _refuse_static_graph_with_merge(strategy: DistributedStrategy, ddp_kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` for DDP's ``static_graph`` with gradient merge where merged micro-batches stay local.

    DDP records its static graph on the first backward, which must
    communicate; without sharding (PowerSGD included) a merge window's first
    K-1 micro-batches do not, and torch's reducer fails with an internal
    assert at the first backward. Sharding stage 1 communicates every
    micro-batch and stage 2 has no DDP.
    """
    if not (ddp_kwargs.get("static_graph") and strategy.gradient_merge) or strategy.sharding:
        return
    k_steps = strategy.gradient_merge_config.k_steps
    if k_steps == 1:
        return
    raise ValueError(
        f"fleet.distributed_model(..., static_graph=True) with strategy.gradient_merge (k_steps={k_steps}): DDP "
        "records its static graph on the first backward, which must communicate, but the first micro-batches of a "
        "gradient-merge window do not (torch's reducer fails with an internal assert at the first backward). "
        "Remove static_graph=True (gradient merge needs no hint; for reentrant activation checkpointing, checkpoint "
        "with use_reentrant=False instead), or use sharding stage 1 or 2, which communicate every micro-batch"
    )


def _free_zero_grads(ddp: DistributedDataParallel) -> None:
    """Stage 1, before DDP may rebuild its buckets: free each ``.grad`` that holds only zeros.

    DDP rebuilds its buckets at the first forward after the first backward
    and allocates the new ones while every ``.grad`` still views an old one
    (``gradient_as_bucket_view``): a whole 16-bit gradient more, at once. The
    reduce-scatter handed every bucket back zeroed, so those ``.grad`` hold
    nothing; freed, the old buckets go before the new ones come, and the next
    backward makes each ``.grad`` again (a view of a new bucket). Without
    ``find_unused_parameters`` every parameter gets a gradient in every
    reduced backward, so no step sees ``None`` where it would have seen zeros.
    Not called while a backward's gradients wait for ``step()``: after a
    forward between backward and step (an evaluation) ``step()`` would find
    no ``.grad``, take the slice's reduced gradients for none and refuse the
    step; DDP then rebuilds beside the old buckets, once.
    """
    for p in ddp.module.parameters():
        if p.grad is not None and not bool(p.grad.any()):
            p.grad = None
