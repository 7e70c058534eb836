"""Data parallelism for AMP training on torch's DDP reducer.

:class:`DataParallel` is what ``fleet.distributed_model`` returns. It wraps
``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped
all-reduce) and adds what AMP needs around it: modules named in
``custom_black_varnames`` run in FP32, O2 parameters that stay FP32 get
their exact values back, FP32 masters are broadcast from rank 0, a comm hook
puts gradients on the wire in 16 bits, and only the last micro-batch of a
gradient-merge window communicates.

The model is prepared once, in :meth:`DataParallel.prepare`, at its first
forward: by then every optimizer built on it is attached, and parameter
dtypes are final, so DDP (whose buckets are per dtype) is built exactly once.

With ``strategy.sharding`` stage 2 the comm hook reduce-scatters instead of
all-reducing (:mod:`distamp.distributed.reduce_scatter`), and every
backward communicates, gradient merge's micro-batches included: each is
summed into the owners' FP32 gradient slices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import keep_in_fp32
from distamp.amp.fp32_parameters import fp32_parameters
from distamp.distributed.comm_hooks import CommStats, LowPrecisionAllReduce
from distamp.distributed.groups import group_size
from distamp.distributed.reduce_scatter import ShardedGradReduce
from distamp.optim.grad_accumulator import PendingFp32Grads
from distamp.optim.master_weights import fp32_model_state_dict
from distamp.strategy import DistributedStrategy

if TYPE_CHECKING:
    from distamp.optim.optimizer import AmpOptimizer

__all__ = ["DataParallel", "strategy_fp32_parameters"]

_SET_BY_DISTAMP = ("device_ids", "output_device", "gradient_as_bucket_view", "bucket_cap_mb")


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

    def __init__(self) -> None:
        self.ddp: DistributedDataParallel | None = None
        self.comm_hook: LowPrecisionAllReduce | ShardedGradReduce | None = None
        self.optimizers: list[AmpOptimizer] = []
        self.optimizer_sync: dict[int, bool] = {}
        self.sync_enabled = True
        self.prepared = False


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
        ddp_kwargs: further keyword arguments for DDP (e.g. ``static_graph``).
    """

    def __init__(
        self,
        module: nn.Module,
        strategy: DistributedStrategy,
        *,
        find_unused_parameters: bool | None = None,
        process_group: dist.ProcessGroup | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (DataParallel, DistributedDataParallel)):
            raise TypeError(f"model is already wrapped in {type(module).__name__}; pass the bare model")
        for name in _SET_BY_DISTAMP:
            if name in ddp_kwargs:
                raise ValueError(
                    f"{name}={ddp_kwargs[name]!r} is set by distamp (device from LOCAL_RANK, "
                    "bucket size from strategy.fuse_grad_size_in_MB); remove it"
                )
        self.module = module
        self.strategy = strategy
        self.find_unused_parameters = (
            strategy.find_unused_parameters if find_unused_parameters is None else find_unused_parameters
        )
        self._process_group = process_group
        self._ddp_kwargs = ddp_kwargs
        self._fp32_params = strategy_fp32_parameters(module, strategy)
        self._runtime = _Runtime()
        cfg = strategy.amp_config
        self._black_modules = (
            keep_in_fp32(module, cfg.custom_black_varnames) if strategy.amp and cfg.custom_black_varnames else None
        )

    # ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """True when the data-parallel group has more than one rank (DDP is used)."""
        return group_size(self._process_group) > 1

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The underlying DDP module (``None`` before the first forward and in a one-process run)."""
        return self._runtime.ddp

    @property
    def comm_stats(self) -> CommStats | None:
        """Calls and bytes of the gradient comm hook (``None`` without a hook: no DDP, or AMP off unsharded)."""
        hook = self._runtime.comm_hook
        return hook.stats if hook is not None else None

    @property
    def black_parameters(self) -> list[nn.Parameter]:
        """Parameters O2 keeps in FP32 (``custom_black_varnames`` modules and normalization layers)."""
        return list(self._fp32_params)

    def owns_any(self, params: list[nn.Parameter]) -> bool:
        """Whether any of ``params`` belongs to the wrapped module."""
        own = {id(p) for p in self.module.parameters()}
        return any(id(p) in own for p in params)

    def check_attachable(self, changes_dtypes: bool) -> None:
        """Raise before an optimizer that would change parameter dtypes is built too late.

        Raises:
            RuntimeError: the model was already prepared (its first forward
                ran, DDP is built on the parameters' dtypes) and the
                optimizer is O2.
        """
        if self._runtime.prepared and changes_dtypes and self.distributed:
            raise RuntimeError(
                "fleet.distributed_optimizer(...) with use_pure_fp16 was called after the model's first "
                "forward, when its data-parallel wrapper was already built on the parameters' dtypes. "
                "Build the optimizer before the first forward."
            )

    def attach_optimizer(self, optimizer: AmpOptimizer) -> None:
        """Tie ``optimizer`` to this model (``fleet`` calls it for either order of the two calls).

        Its FP32-kept parameters get their exact values back now; its masters
        are broadcast from rank 0 when the model is prepared.

        Raises:
            RuntimeError: see :meth:`check_attachable`.
        """
        runtime = self._runtime
        if optimizer in runtime.optimizers:
            return
        self.check_attachable(changes_dtypes=optimizer.master_weights.enabled)
        optimizer.adopt_model(self.module, self._fp32_params)
        runtime.optimizers.append(optimizer)
        optimizer.add_sync_listener(self)

    def set_grad_sync(self, optimizer: AmpOptimizer, flag: bool) -> None:
        """Called by an attached optimizer: whether its next backward closes a merge window."""
        self._runtime.optimizer_sync[id(optimizer)] = flag

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

    def prepare(self) -> None:
        """Make ranks identical and build DDP; runs once, at the first forward (collective)."""
        runtime = self._runtime
        if runtime.prepared:
            return
        runtime.prepared = True
        if not self.distributed:
            return
        reduce_scatter = self._check_sharding()
        # 1. Every rank takes rank 0's FP32 masters; the 16-bit parameters follow from them.
        for opt in runtime.optimizers:
            if opt.master_weights.enabled:
                opt.master_weights.broadcast(src=0, group=self._process_group)
        # 2. DDP on the final dtypes (its buckets are per dtype); it broadcasts the rest.
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        ddp = DistributedDataParallel(
            self.module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=self._process_group,
            find_unused_parameters=self.find_unused_parameters,
            bucket_cap_mb=self.strategy.fuse_grad_size_in_MB,
            gradient_as_bucket_view=True,
            **self._ddp_kwargs,
        )
        cfg = self.strategy.amp_config
        pending = PendingFp32Grads(runtime.optimizers)
        wire = cfg.comm_torch_dtype if self.strategy.amp else torch.float32
        if reduce_scatter:
            shards = [opt.master_weights for opt in runtime.optimizers]
            runtime.comm_hook = ShardedGradReduce(shards, wire, self._process_group, pending)
        elif self.strategy.amp:
            runtime.comm_hook = LowPrecisionAllReduce(
                cfg.comm_torch_dtype, cfg.gradient_predivide_factor, self._process_group, pending
            )
        if runtime.comm_hook is not None:
            runtime.comm_hook.register(ddp)
        runtime.ddp = ddp

    def _check_sharding(self) -> bool:
        """Whether gradients are reduce-scattered (sharding stage 2); raises before any collective on a mismatch.

        Raises:
            RuntimeError: the model's strategy and an attached optimizer's
                disagree on stage 2, or a parameter that gets a gradient
                belongs to no stage-2 optimizer (nobody would own its sum).
        """
        strategy = self.strategy
        model_stage = strategy.sharding_config.stage if strategy.sharding else 0
        for opt in self._runtime.optimizers:
            opt_stage = getattr(opt.precision, "stage", 0)
            if (opt_stage == 2) != (model_stage == 2):
                raise RuntimeError(
                    f"the optimizer's strategy has sharding stage {opt_stage or 'off'} but the model's "
                    f"(fleet.distributed_model) has stage {model_stage or 'off'}; stage 2 changes how the model "
                    "communicates gradients, so both must use it. Pass the same strategy to both calls"
                )
        if model_stage != 2:
            return False
        owned = {id(p) for opt in self._runtime.optimizers for p in opt.master_weights.model_params}
        missing = [name for name, p in self.module.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise RuntimeError(
                f"sharding stage 2 reduce-scatters each gradient to the optimizer slice that owns it, but "
                f"{missing[:5]} (of {len(missing)}) belong to no optimizer built with fleet.distributed_optimizer "
                "for this model. Give every trainable parameter to such an optimizer, or set "
                "requires_grad=False on the others"
            )
        return True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (through DDP when distributed)."""
        runtime = self._runtime
        if not runtime.prepared:
            self.prepare()
        ddp = runtime.ddp
        if ddp is None:
            return self.module(*args, **kwargs)
        # Stage 2 reduce-scatters every micro-batch: the owners sum them in FP32 slices.
        reduce_scatter = isinstance(runtime.comm_hook, ShardedGradReduce)
        ddp.require_backward_grad_sync = runtime.sync_enabled and (
            reduce_scatter or all(runtime.optimizer_sync.values())
        )
        ddp.training = self.training
        return ddp(*args, **kwargs)

    def fp32_state_dict(self) -> dict[str, Any]:
        """The wrapped model's ``state_dict()`` with every parameter in exact FP32 (from the masters).

        In O2 the model holds 16-bit weights; this is what to export for
        inference or fine-tuning in FP32. Keys are the module's own (no
        ``module.`` prefix).
        """
        return fp32_model_state_dict(self.module, [opt.master_weights for opt in self._runtime.optimizers])
