"""DDP's ``broadcast_buffers`` rule, for the sharded stages' own wrappers (stage 2's reducer, stage 3's FSDP2 model).

DDP broadcasts rank 0's buffers (BatchNorm's running statistics) before a
forward that follows a training forward whose backward syncs, and before the
first, so every rank normalizes with the same statistics and a checkpoint,
which keeps rank 0's, resumes every rank as it trained. Stage 2 replaces DDP
and FSDP2 syncs no buffer, so both keep the rule with :class:`BufferBroadcast`.

torch 2.13 deprecated ``broadcast_buffers`` for ``forward_sync_buffers``,
which rules the forward broadcast only: the buffers are still broadcast when
the model is built. :func:`buffer_sync` reads both as torch's DDP does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distamp.distributed.timeouts import named_collective
from distamp.sharding.pairwise import drop_storage
from distamp.torch_compat import DDP_KEYWORDS
from distamp.user_warning import warn_user

__all__ = ["BROADCAST_BYTES", "BufferBroadcast", "BufferSync", "broadcast_from_rank0", "buffer_sync",
           "warn_of_deprecated_buffer_option"]

BROADCAST_BYTES = 1 << 20
"""Coalescing bound of the broadcasts from rank 0: tensors this size or larger go in place, smaller ones in flat
copies of about this size (no model-size flat copy)."""


@dataclass(frozen=True)
class BufferSync:
    """When rank 0's buffers are broadcast, as DDP decides it from its keyword arguments."""

    at_build: bool
    """When the model is built (unless ``init_sync=False``, which broadcasts nothing then)."""
    before_forward: bool
    """Before a forward that follows a synced training forward, and before the first (:class:`BufferBroadcast`)."""


def buffer_sync(broadcast_buffers: bool | None = None, forward_sync_buffers: bool | None = None) -> BufferSync:
    """DDP's rule for its two buffer options (``None``: not given), with the warnings torch 2.13+ gives.

    ``forward_sync_buffers`` rules the forward broadcast and leaves the one at
    build on; given, it wins and ``broadcast_buffers`` is ignored. Alone,
    ``broadcast_buffers`` rules both; neither given: both on.
    """
    warn_of_deprecated_buffer_option(broadcast_buffers, forward_sync_buffers)
    if forward_sync_buffers is not None:
        return BufferSync(at_build=True, before_forward=forward_sync_buffers)
    enabled = True if broadcast_buffers is None else broadcast_buffers
    return BufferSync(at_build=enabled, before_forward=enabled)


def warn_of_deprecated_buffer_option(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> None:
    """The ``FutureWarning`` torch's DDP (2.13+) gives when built with ``broadcast_buffers`` (deprecated in 2.13),
    ignored or not, attributed to the user's line; nothing where the installed DDP has no ``forward_sync_buffers``."""
    if broadcast_buffers is None or "forward_sync_buffers" not in DDP_KEYWORDS:
        return
    if forward_sync_buffers is not None:
        message = ("fleet.distributed_model(..., broadcast_buffers=..., forward_sync_buffers=...): broadcast_buffers "
                   "is ignored, as torch's DDP ignores it when forward_sync_buffers is given; remove it")
    else:
        message = ("fleet.distributed_model(..., broadcast_buffers=...): torch deprecated DDP's broadcast_buffers for "
                   "forward_sync_buffers, which distamp's sharded stages honour too. Unlike broadcast_buffers=False, "
                   "forward_sync_buffers=False still broadcasts rank 0's buffers when the model is built; to keep "
                   "each rank's own from the start, keep broadcast_buffers=False")
    warn_user(message, FutureWarning)


def broadcast_from_rank0(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank of ``group`` takes group rank 0's values of ``tensors``, in place (collective).

    A contiguous tensor of :data:`BROADCAST_BYTES` or more is broadcast in
    place; smaller ones are coalesced, per dtype and device, into flat copies
    of about that size, one broadcast each (DDP's start-up broadcast
    coalesces everything, a large tensor included, into flat copies). On CPU
    every tensor handed to the backend is let go of before this returns
    (:func:`~distamp.sharding.pairwise.drop_storage`), so no flat copy is
    freed later on gloo's thread.
    """
    source = dist.get_global_rank(group, 0)
    receiving = dist.get_rank(group) != 0
    for bucket in _broadcast_buckets(tensors):
        in_place = len(bucket) == 1 and bucket[0].is_contiguous()
        # In place: an alias of its own, which drop_storage may empty.
        sent = bucket[0].detach() if in_place else torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(sent, src=source, group=group)
        if receiving and not in_place:
            for tensor, piece in zip(bucket, sent.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(piece.view_as(tensor))
        if sent.device.type == "cpu":
            drop_storage([sent])


def _broadcast_buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in the order given, each large contiguous one alone, the others in buckets of one dtype and
    device closed once they hold :data:`BROADCAST_BYTES`; empty tensors in none."""
    buckets: list[list[torch.Tensor]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        if nbytes >= BROADCAST_BYTES and tensor.is_contiguous():
            buckets.append([tensor])
            continue
        key = (tensor.dtype, tensor.device)
        bucket, size = open_buckets.get(key) or ([], 0)
        if not bucket:
            buckets.append(bucket)
        bucket.append(tensor)
        size += nbytes
        if size >= BROADCAST_BYTES:
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (bucket, size)
    return buckets


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
