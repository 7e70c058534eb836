"""Data parallelism for AMP training on torch's DDP reducer.

:class:`DataParallel` is what ``fleet.distributed_model`` returns. It wraps
``torch.nn.parallel.DistributedDataParallel`` (bucketed, overlapped
all-reduce) and adds what AMP needs around it: modules named in
``custom_black_varnames`` kept in FP32, FP32 master weights broadcast from
rank 0, a comm hook that puts gradients on the wire in 16 bits, and
communication only on the last micro-batch of a gradient-merge window.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import find_black_modules, keep_in_fp32
from distamp.distributed.comm_hooks import CommStats, LowPrecisionAllReduce
from distamp.optim.optimizer import AmpOptimizer
from distamp.strategy import DistributedStrategy

__all__ = ["DataParallel", "black_parameters"]

def black_parameters(module: nn.Module, strategy: DistributedStrategy) -> list[nn.Parameter]:
    """Parameters of the submodules matched by ``custom_black_varnames``.

    Raises ``ValueError`` naming a pattern that matches no submodule.
    """
    if not strategy.amp or not strategy.amp_config.custom_black_varnames:
        return []
    matched = find_black_modules(module, strategy.amp_config.custom_black_varnames)
    return [p for _, sub in matched for p in sub.parameters()]


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

    Parameters and buffers are broadcast from rank 0 when the wrapper is
    built, and the FP32 masters of attached optimizers too, so every rank
    starts identical. In a one-process world (no process group, or one of
    a single rank) the module is called directly and only the FP32 handling
    of black-listed modules applies.

    Args:
        module: the model, already on its device.
        strategy: the strategy whose ``amp_configs`` decide the wire dtype,
            the pre-division factor and the black-listed modules.
        find_unused_parameters: passed to DDP; ``None`` takes the
            strategy's ``find_unused_parameters``.
        process_group: the data-parallel group; ``None`` is the world.
        device: the device this process trains on (``fleet.device()``);
            every parameter and buffer must already be there, else a
            ``ValueError`` names the first one that is not. ``None`` skips
            the check and takes the parameters' device.
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
            raise TypeError(
                f"model is already wrapped in {type(module).__name__}; pass the bare model"
            )
        for name in ("device_ids", "output_device", "gradient_as_bucket_view", "bucket_cap_mb"):
            if name in ddp_kwargs:
                raise ValueError(
                    f"{name}={ddp_kwargs[name]!r} is set by distamp (device from LOCAL_RANK, "
                    "bucket size from strategy.fuse_grad_size_in_MB); remove it"
                )
        self._device = None if device is None else _check_device(module, torch.device(device))
        self.module = module
        self.strategy = strategy
        self.find_unused_parameters = (
            strategy.find_unused_parameters if find_unused_parameters is None else find_unused_parameters
        )
        self._process_group = process_group
        self._ddp_kwargs = ddp_kwargs
        self._sync_enabled = True
        # Kept out of _modules so state_dict keys stay "module.<name>", as with DDP.
        object.__setattr__(self, "_ddp", None)
        object.__setattr__(self, "_optimizers", [])
        object.__setattr__(self, "_fp32_hooks", None)
        object.__setattr__(self, "_ddp_signature", None)
        self._comm_hook: LowPrecisionAllReduce | None = None
        self._black_params = black_parameters(module, strategy)
        self._build(new_optimizers=[])

    # ------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        """True when the group has more than one rank, so DDP is in use.

        A one-rank group (``fleet.init()`` without a launcher) has nothing to
        communicate: the module is called directly, without DDP's overhead.
        """
        return (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self._process_group) > 1
        )

    @property
    def ddp(self) -> DistributedDataParallel | None:
        """The underlying DDP module (``None`` in a one-process world)."""
        return self._ddp

    @property
    def comm_stats(self) -> CommStats | None:
        """Calls and bytes of the 16-bit all-reduce hook (``None`` without AMP/DDP)."""
        return self._comm_hook.stats if self._comm_hook is not None else None

    @property
    def black_parameters(self) -> list[nn.Parameter]:
        """Parameters kept in FP32 because of ``custom_black_varnames``."""
        return list(self._black_params)

    def attach_optimizer(self, optimizer: AmpOptimizer) -> None:
        """Tie ``optimizer`` to this model (called by ``fleet.distributed_optimizer``).

        Black-listed parameters it converted go back to FP32 (from their
        exact masters), its masters are broadcast from rank 0, and DDP is
        rebuilt when parameter dtypes changed since it was built.
        """
        if optimizer in self._optimizers:
            return
        self._optimizers.append(optimizer)
        self._build(new_optimizers=[optimizer])

    def owns_any(self, params: list[nn.Parameter]) -> bool:
        """Whether any of ``params`` belongs to the wrapped module."""
        own = {id(p) for p in self.module.parameters()}
        return any(id(p) in own for p in params)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes run inside skip the all-reduce."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (through DDP when distributed)."""
        if self._ddp is None:
            return self.module(*args, **kwargs)
        sync = self._sync_enabled and all(opt.will_sync_next_backward() for opt in self._optimizers)
        self._ddp.require_backward_grad_sync = sync
        self._ddp.training = self.training
        return self._ddp(*args, **kwargs)

    # ------------------------------------------------------------------
    def _build(self, new_optimizers: list[AmpOptimizer]) -> None:
        """Bring ``new_optimizers`` in line and (re)build DDP; the order matters.

        Optimizers attached earlier were already restored and broadcast.
        """
        # 1. Black-listed modules back to FP32 before DDP groups buckets by dtype.
        for opt in new_optimizers:
            opt.master_weights.restore_fp32(self._black_params)
        if self._fp32_hooks is None and self.strategy.amp and self.strategy.amp_config.custom_black_varnames:
            object.__setattr__(
                self, "_fp32_hooks", keep_in_fp32(self.module, self.strategy.amp_config.custom_black_varnames)
            )
        if not self.distributed:
            return
        # 2. Every rank takes rank 0's FP32 masters (and hence its 16-bit params).
        for opt in new_optimizers:
            if opt.master_weights.enabled:
                opt.master_weights.broadcast(src=0, group=self._process_group)
        # 3. DDP on the final parameter dtypes (its buckets are per dtype).
        signature = tuple(p.dtype for p in self.module.parameters())
        if self._ddp is not None and self._ddp_signature == signature:
            return
        self._drop_ddp()
        device = self._device if self._device is not None else next(
            (p.device for p in self.module.parameters()), torch.device("cpu")
        )
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
        if self.strategy.amp:
            cfg = self.strategy.amp_config
            self._comm_hook = LowPrecisionAllReduce(
                cfg.comm_torch_dtype, cfg.gradient_predivide_factor, self._process_group
            )
            self._comm_hook.register(ddp)
        object.__setattr__(self, "_ddp", ddp)
        object.__setattr__(self, "_ddp_signature", signature)

    def _drop_ddp(self) -> None:
        if self._ddp is None:
            return
        object.__setattr__(self, "_ddp", None)
        # The old reducer removes its autograd hooks when it is destroyed;
        # collect now so it cannot also fire on the next backward.
        gc.collect()
