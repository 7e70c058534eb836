"""DDP's ``broadcast_buffers`` rule, for the sharded stages' own wrappers (stage 2's reducer, stage 3's FSDP2 model).

DDP broadcasts rank 0's buffers (BatchNorm's running statistics) before a
forward that follows a training forward whose backward syncs, and before the
first, so every rank normalizes with the same statistics and a checkpoint,
which keeps rank 0's, resumes every rank as it trained. Stage 2 replaces DDP
and FSDP2 syncs no buffer, so both keep the rule with :class:`BufferBroadcast`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distamp.distributed.timeouts import named_collective
from distamp.torch_compat import sync_params_and_buffers

__all__ = ["BROADCAST_BYTES", "BufferBroadcast", "broadcast_from_rank0"]

BROADCAST_BYTES = 1 << 20
"""Coalescing bound of the broadcasts from rank 0 (as DDP's): no model-size flat copy."""


def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` takes group rank 0's values of ``tensors``, in place (collective, coalesced)."""
    sync_params_and_buffers(group, tensors, BROADCAST_BYTES, 0)


class BufferBroadcast:
    """Broadcasts ``module``'s buffers from rank 0 when DDP would: before a forward that follows a synced
    training forward, and before the first.

    Args:
        module: the model whose buffers are kept equal.
        group: the data-parallel group.
        enabled: DDP's ``broadcast_buffers``.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, enabled: bool = True) -> None:
        self.module = module
        self.group = group
        self.enabled = enabled
        self._next = True

    @torch.compiler.disable
    def before_forward(self) -> None:
        """Broadcast the buffers if the last forward was a synced training forward (or there was none)."""
        if self._next and self.enabled:
            buffers = [b.detach() for b in self.module.buffers()]
            if buffers:
                with named_collective("the broadcast of buffers from rank 0 before the forward"):
                    broadcast_from_rank0(buffers, self.group)

    def after_forward(self, sync: bool) -> bool:
        """Record the forward just run; ``sync``: its backward reduces. Returns whether it was a synced training
        forward (the next forward then broadcasts)."""
        self._next = sync and torch.is_grad_enabled()
        return self._next
