"""Agreeing on the inf/NaN verdict before anyone decides.

Every rank checks its own gradients after communication; a non-finite value
can still appear on one rank only (a local overflow in the copy to FP32, a
gradient modified after the all-reduce, a faulty device). If each rank
decided alone, one would skip a step the others apply and the replicas
would drift apart for good. So the per-rank verdict is all-reduced with MAX
first, and every rank skips or applies the same step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_max"]


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Replace ``values`` in place by their elementwise maximum over ``group``.

    ``group=None`` means no synchronisation (a one-process world, or a test
    showing what the synchronisation prevents), not the default group:
    resolve it with :func:`~distamp.distributed.groups.data_parallel_group`.
    """
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
