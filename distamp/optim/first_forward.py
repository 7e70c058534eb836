"""Without ``fleet.distributed_model``: learn the model at its first forward.

``fleet.distributed_optimizer`` alone sees only parameters, not the modules
they belong to, so it cannot tell which ones are normalization layers that
O2 keeps in FP32, which submodules ``custom_black_varnames`` names, nor
name a parameter whose gradient overflowed. A :class:`FirstForwardFinder`
waits for the first forward of a module that owns every parameter of the
optimizer (the model), hands it to the optimizer
(:meth:`~distamp.optim.optimizer.AmpOptimizer.adopt_model`) with its
FP32-kept parameters and its ``custom_black_varnames`` modules switched to
FP32, and removes itself. It is a global forward pre-hook only until then:
one set comparison per module call, and nothing afterwards.

The first such module is the outermost: a model the user wrapped in
torch's own ``DistributedDataParallel`` is seen as the DDP module, whose
reducer all-reduces the gradients; the bare model called directly is not.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import BlackModulesHandle, keep_in_fp32
from distamp.amp.fp32_parameters import fp32_parameters
from distamp.strategy import DistributedStrategy


class _ModelAdopter(Protocol):
    """What the finder reads of a meta-optimizer (``AmpOptimizer`` satisfies it)."""

    amp_enabled: bool
    strategy: DistributedStrategy

    @property
    def master_weights(self) -> Any: ...

    @property
    def steps_applied(self) -> int: ...

    @property
    def steps_skipped(self) -> int: ...

    def adopt_model(self, model: nn.Module, keep_fp32: list[nn.Parameter], *, reduces_grads: bool,
                    black_modules: BlackModulesHandle | None = None,
                    torch_ddp: DistributedDataParallel | None = None) -> None: ...

__all__ = ["FirstForwardFinder"]

logger = logging.getLogger("distamp")


class FirstForwardFinder:
    """Hands a meta-optimizer its model at the model's first forward.

    Args:
        optimizer: the meta-optimizer (held weakly); its
            :meth:`~distamp.optim.optimizer.AmpOptimizer.adopt_model` is called.
    """

    def __init__(self, optimizer: _ModelAdopter) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._param_ids = {id(p) for p in optimizer.master_weights.model_params}
        self._handle = register_module_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            self.remove()
            return
        if optimizer.steps_applied + optimizer.steps_skipped:
            self.remove()
            if optimizer.master_weights.enabled:
                logger.warning(
                    "O2: no module owning all the optimizer's parameters ran a forward before the first step, "
                    "so normalization layers stay 16-bit; pass the model to fleet.distributed_model to keep "
                    "them FP32"
                )
            return
        if not self._param_ids <= {id(p) for p in module.parameters()}:
            return
        self.remove()
        torch_ddp = module if isinstance(module, DistributedDataParallel) else None
        model: nn.Module = torch_ddp.module if torch_ddp is not None else module
        if not optimizer.amp_enabled:
            optimizer.adopt_model(model, [], reduces_grads=torch_ddp is not None, torch_ddp=torch_ddp)
            return
        cfg = optimizer.strategy.amp_config
        keep = fp32_parameters(model, cfg.custom_black_varnames, keep_norm_fp32=cfg.keep_norm_fp32)
        black = keep_in_fp32(model, cfg.custom_black_varnames) if cfg.custom_black_varnames else None
        optimizer.adopt_model(model, keep, reduces_grads=torch_ddp is not None, black_modules=black,
                              torch_ddp=torch_ddp)

    def remove(self) -> None:
        """Stop watching forwards."""
        self._handle.remove()
