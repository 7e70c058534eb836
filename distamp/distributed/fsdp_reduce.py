"""Stage 3's gradient reduce-scatter: 16-bit on the wire, summed in FP32 (as stages 1 and 2).

FSDP2 reduce-scatters each unit's gradients in its ``reduce_dtype``; with a
16-bit ``reduce_dtype`` the backend sums in 16 bits (and FSDP pre-divides
FP16 by about sqrt(world) to keep the sum in range). distamp's policy sets
``reduce_dtype=float32``, so FSDP's reduce-scatter buffers and the sharded
gradients it accumulates are FP32, and installs :class:`WireReduceScatter`
(``FSDPModule.set_custom_reduce_scatter``) as the collective: it casts the
FP32 input to the wire dtype, sends each rank its chunk with one
``all_to_all_single``, and adds the received chunks in FP32. So the wire
carries 16 bits, as an all-reduce of the 16-bit gradients would, and no
16-bit sum can overflow or lose the small addends. In O2 the input holds
16-bit gradients widened to FP32, so the cast to the wire is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from distamp.distributed.comm_hooks import CommStats

__all__ = ["WireReduceScatter"]


class WireReduceScatter(ReduceScatter):
    """A reduce-scatter for FSDP2 that sends ``wire_dtype`` and sums in the output's dtype (FP32).

    Example::

        comm = WireReduceScatter(torch.bfloat16)
        fsdp_module.set_custom_reduce_scatter(comm)

    Args:
        wire_dtype: the dtype gradients have on the wire.

    Attributes:
        stats: collectives launched and payload bytes this rank sent.
    """

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self.wire_dtype = wire_dtype
        self.stats = CommStats()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer from the device's allocator."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        """Write into ``output_tensor`` the sum (or mean, for ``AVG``) of every rank's chunk of ``input_tensor``.

        Raises:
            ValueError: ``op`` is neither ``SUM`` nor ``AVG``.
        """
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"WireReduceScatter sums or averages; FSDP asked for {op!r}")
        world = dist.get_world_size(group)
        send = input_tensor.to(self.wire_dtype)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        del send
        self.stats.calls += 1
        self.stats.bytes += received.numel() * received.element_size()
        chunks = received.view(world, -1)
        # Rank order: every rank adds the same numbers in the same order.
        output_tensor.copy_(chunks[0])
        for chunk in chunks[1:]:
            output_tensor.add_(chunk)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        return None
