"""Forward hooks that finish, module by module, the parameter all-gather ``overlap_param_gather`` leaves running.

With ``sharding_configs["overlap_param_gather"]`` a sharded optimizer's
``step()`` launches the all-gather of the updated slices and returns; the
rounds go over the wire while the next forward computes. Before a module
runs, its pre-hook finishes the rounds up to the last one that writes the
module's own parameters (``recurse=False``); after the whole model's
forward, and before ``state_dict()`` of the model (wrapped or not),
everything left is finished. This is Megatron-LM's
``overlap_param_gather`` on a flat slice layout: the rounds follow the
optimizer's parameter order, so a model whose parameters are listed in the
order its forward uses them overlaps the most.

The optimizer defers its gather only once these hooks are installed for it
(:meth:`ForwardParamGather.attach`), so an optimizer used without
``fleet.distributed_model`` finishes its gather inside ``step()`` as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from distamp.distributed.attached import AttachedOptimizer

__all__ = ["ForwardParamGather"]


class ForwardParamGather:
    """The pre-hooks of one model's modules and the optimizers whose gathers they finish.

    Args:
        module: the model ``fleet.distributed_model`` wraps.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.optimizers: list[AttachedOptimizer] = []
        self.handles: list[RemovableHandle] = []

    def attach(self, optimizer: AttachedOptimizer) -> None:
        """Finish ``optimizer``'s gathers in this model's forward, if it overlaps them; installs the hooks once."""
        if optimizer in self.optimizers or not optimizer.defer_param_gather(True):
            return
        self.optimizers.append(optimizer)
        if not self.handles:
            for sub in self.module.modules():
                own = list(sub.parameters(recurse=False))
                if own:
                    self.handles.append(sub.register_forward_pre_hook(_PreHook(self.optimizers, own)))
            self.handles.append(self.module.register_forward_hook(_PreHook(self.optimizers, None)))
            self.handles.append(self.module.register_state_dict_pre_hook(_PreHook(self.optimizers, None)))

    def remove(self) -> None:
        """Remove the hooks; the optimizers finish their gathers inside ``step()`` again."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for optimizer in self.optimizers:
            optimizer.defer_param_gather(False)
        self.optimizers.clear()


class _PreHook:
    """Finish every attached optimizer's gather for ``params`` (``None``: all of it)."""

    def __init__(self, optimizers: list[AttachedOptimizer], params: list[nn.Parameter] | None) -> None:
        self.optimizers, self.params = optimizers, params

    @torch.compiler.disable
    def __call__(self, *_: Any) -> None:
        for optimizer in self.optimizers:
            optimizer.finish_param_gather(self.params)
