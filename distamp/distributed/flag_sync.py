"""Agreeing on the inf/NaN verdict before anyone decides.

Every rank checks its own gradients after communication; a non-finite value
can still appear on one rank only (a local overflow in the copy to FP32, a
gradient modified after the all-reduce, a faulty device). If each rank
decided alone, one would skip a step the others apply and the replicas
would drift apart for good. So the per-rank verdict is all-reduced with MAX
first, and every rank skips or applies the same step.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from distamp.torch_compat import group_timeout

__all__ = ["all_reduce_max", "host_wait_timeout"]

_MAX_MARGIN = timedelta(minutes=1)


def host_wait_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta:
    """How long the host waits for a collective on ``device`` before raising: the group's timeout less a margin.

    NCCL collectives return at once and run on their own stream; a rank
    that never arrives is noticed by the watchdog at the group's timeout,
    which (torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING``) tears the
    process down with a message that names neither the operation nor the
    missing rank. Waiting on the host with a shorter timeout raises first,
    in Python, where :func:`~distamp.distributed.timeouts.named_collective`
    names both (its roll call through the store takes at most 15 s of the
    margin: a minute, or half of a shorter timeout).
    """
    timeout = group_timeout(group, device)
    return timeout - min(_MAX_MARGIN, timeout / 2)


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Replace ``values`` in place by their elementwise maximum over ``group``.

    ``group=None`` means no synchronisation (a one-process world, or a test
    showing what the synchronisation prevents), not the default group:
    resolve it with :func:`~distamp.distributed.groups.data_parallel_group`.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    if values.device.type == "cpu":
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)  # gloo: returns when done, or times out
        return
    # NCCL: block the host until the all-reduce is done, with a timeout that runs out before the watchdog's.
    work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
    work.wait(host_wait_timeout(group, values.device))
