"""Data parallelism for AMP training on torch's DDP reducer.

:class:`DataParallel` is what ``fleet.distributed_model`` returns. It wraps
``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped
all-reduce) and adds what AMP needs around it: modules named in
``custom_black_varnames`` run in FP32, O2 parameters that stay FP32 get
their exact values back, FP32 masters are broadcast from rank 0, a comm hook
puts gradients on the wire in 16 bits, and only the last micro-batch of a
gradient-merge window communicates.

The model is prepared once, in :meth:`DataParallel.prepare`: when the
first optimizer is attached (whichever of ``fleet.distributed_optimizer`` and
``fleet.distributed_model`` comes second), or at the first forward if no
optimizer comes. By then parameter dtypes are final, so DDP (whose buckets
are per dtype) is built exactly once, and outside any ``torch.compile``d
region.

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
from distamp.distributed.fingerprint import check_ranks_agree
from distamp.distributed.groups import group_size
from distamp.distributed.reduce_scatter import ShardedGradReduce
from distamp.distributed.timeouts import named_collective
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
        self.merge_sync = True  # all(optimizer_sync): a plain bool for forward (torch.compile guards on it)
        self.reduce_scatter = False  # sharding stage 2: every micro-batch communicates
        self.sync_enabled = True
        self.prepared = False


def _check_device(module: nn.Module, device: torch.device) -> torch.device:
    """Raise ``ValueError`` naming the first parameter or buffer not on ``device``; return ``device``.

    DDP would otherwise fail later with an error that names neither the
    tensor nor the fix, or, with a model on another GPU, train there.
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = [("parameter", n, t) for n, t in module.named_parameters()]
    tensors += [("buffer", n, t) for n, t in module.named_buffers()]
    for kind, name, tensor in tensors:
        if tensor.device != device:
            raise ValueError(
                f"{kind} {name!r} is on {tensor.device}, but this process trains on {device} "
                "(fleet.device()); move the model there before wrapping it: model.to(fleet.device())"
            )
    return device


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
        self._device = None if device is None else _check_device(module, torch.device(device))
        self._ddp_kwargs = ddp_kwargs
        self._fp32_params = strategy_fp32_parameters(module, strategy)
        self._runtime = _Runtime()
        self._runtime.prepared = not self.distributed  # one process: nothing to agree on or build
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
        if self.distributed:
            # The second of the two fleet calls prepares (collective: every rank makes both calls).
            self.prepare()

    def set_grad_sync(self, optimizer: AmpOptimizer, flag: bool) -> None:
        """Called by an attached optimizer: whether its next backward closes a merge window."""
        runtime = self._runtime
        runtime.optimizer_sync[id(optimizer)] = flag
        runtime.merge_sync = all(runtime.optimizer_sync.values())

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
        forward; never traced by ``torch.compile``.
        """
        runtime = self._runtime
        if runtime.prepared:
            return
        runtime.prepared = True
        if not self.distributed:
            return
        reduce_scatter = self._check_sharding()
        # 0. Ranks that disagree on the strategy or the model fail here, naming the difference,
        #    instead of summing FP16 with BF16 bit patterns or hanging in mismatched collectives.
        check_ranks_agree(self.strategy, self.module)
        with named_collective("the start-up broadcast of parameters from rank 0"):
            # 1. Every rank takes rank 0's FP32 masters; the 16-bit parameters follow from them.
            for opt in runtime.optimizers:
                if opt.master_weights.enabled:
                    opt.master_weights.broadcast(src=0, group=self._process_group)
            # 2. DDP on the final dtypes (its buckets are per dtype); it broadcasts the rest.
            device = self._device or next((p.device for p in self.module.parameters()), torch.device("cpu"))
            ddp = DistributedDataParallel(
                self.module,
                # A single-device CUDA module: DDP moves inputs to device_ids[0]
                # and its reducer works on that device; CPU modules must pass None.
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
            runtime.reduce_scatter = True
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
        try:
            if ddp is None:
                return self.module(*args, **kwargs)
            # Stage 2 reduce-scatters every micro-batch: the owners sum them in FP32 slices.
            ddp.require_backward_grad_sync = runtime.sync_enabled and (runtime.reduce_scatter or runtime.merge_sync)
            ddp.training = self.training
            return ddp(*args, **kwargs)
        except RuntimeError as exc:
            hint = self._outside_auto_cast_hint(exc)
            if hint is None:
                raise
            raise RuntimeError(f"{exc}\n{hint}") from exc

    def _outside_auto_cast_hint(self, exc: RuntimeError) -> str | None:
        """The fix for torch's bare dtype error when an O2 model runs outside ``fleet.auto_cast()``."""
        cfg = self.strategy.amp_config
        if not (self.strategy.amp and cfg.use_pure_fp16) or "type" not in str(exc).lower():
            return None
        if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda") if t == "cpu" or torch.cuda.is_available()):
            return None
        return (
            f"distamp: with use_pure_fp16 the model's weights are {cfg.dtype} while its inputs are FP32; run the "
            "forward under `with fleet.auto_cast():`, which casts the inputs of matmuls and convolutions."
        )

    def fp32_state_dict(self) -> dict[str, Any]:
        """The wrapped model's ``state_dict()`` with every parameter in exact FP32 (from the masters).

        In O2 the model holds 16-bit weights; this is what to export for
        inference or fine-tuning in FP32. Keys are the module's own (no
        ``module.`` prefix).
        """
        return fp32_model_state_dict(self.module, [opt.master_weights for opt in self._runtime.optimizers])
