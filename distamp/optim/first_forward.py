"""Without ``fleet.distributed_model``: learn the model at its first forward.

``fleet.distributed_optimizer`` alone sees only parameters, not the modules
they belong to, so it cannot tell which ones are normalization layers that
O2 keeps in FP32, nor name a parameter whose gradient overflowed. A
:class:`FirstForwardFinder` waits for the first forward of a module that
owns every parameter of the optimizer (the model), hands it to the
optimizer (:meth:`~distamp.optim.optimizer.AmpOptimizer.adopt_model`), and
removes itself. It is a global forward pre-hook only until then: one set
comparison per module call, and nothing afterwards.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from distamp.amp.fp32_parameters import fp32_parameters

if TYPE_CHECKING:
    from distamp.optim.optimizer import AmpOptimizer

__all__ = ["FirstForwardFinder"]

logger = logging.getLogger("distamp")


class FirstForwardFinder:
    """Hands an O2 optimizer its model at the model's first forward.

    Args:
        optimizer: the O2 meta-optimizer (held weakly); its
            :meth:`~distamp.optim.optimizer.AmpOptimizer.adopt_model` is called.
    """

    def __init__(self, optimizer: AmpOptimizer) -> None:
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
        keep_norm = optimizer.strategy.amp_config.keep_norm_fp32
        optimizer.adopt_model(module, fp32_parameters(module, keep_norm_fp32=keep_norm))

    def remove(self) -> None:
        """Stop watching forwards."""
        self._handle.remove()
