"""Stage 3's collectives for FSDP2: the gradient reduce-scatter and the parameter all-gather.

**Reduce-scatter: ``comm_dtype`` on the wire, the sum taken in FP32.**

FSDP2 reduce-scatters each unit's gradients in the policy's
``reduce_dtype``; with a 16-bit ``reduce_dtype`` the backend would also
*sum* in 16 bits. distamp sets ``reduce_dtype`` to the wire dtype
(``comm_dtype``, default ``dtype``), so FSDP's buffers are 16-bit, and
installs :class:`WireReduceScatter` as the collective
(``FSDPModule.set_custom_reduce_scatter``): one ``all_to_all_single``
sends each rank its chunk, and the received chunks are added in FP32, slice
by slice, in rank order, then rounded once to the output's dtype. FSDP then
widens that into the FP32 sharded gradient, where micro-batches accumulate
in FP32. (For FP16, FSDP still divides the gradients by about sqrt(world)
before this call and by the rest after it.) Stages 1 and 2 keep the FP32
sum itself; stage 3 rounds it once to 16 bits, which keeps FSDP's
reduce-scatter buffers at 16 bits (an FP32 ``reduce_dtype`` doubles them,
and they are the largest transient of backward).

**All-gather without a staging copy.** gloo's ``all_gather_into_tensor``
gathers into a temporary of the output's size and copies it out, so every
unit's all-gather briefly holds its unsharded parameters twice; with the
optimizer state sharded that copy is the largest transient of the forward.
:class:`InPlaceAllGather` broadcasts each rank's chunk straight into its
place in FSDP's output (one broadcast per rank, the same bytes as an
all-gather). NCCL gathers in place itself, so on CUDA FSDP's own collective
is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distamp.distributed.comm_hooks import CommStats
from distamp.torch_compat import FSDPAllGather, FSDPReduceScatter

__all__ = ["InPlaceAllGather", "WireReduceScatter"]


def _allocate(size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


class InPlaceAllGather(FSDPAllGather):
    """An all-gather for FSDP2 on gloo: each rank's chunk is broadcast into its slot of the output.

    Example::

        fsdp_module.set_custom_all_gather(InPlaceAllGather())
    """

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer from the device's allocator."""
        return _allocate(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        """Fill ``output_tensor`` with every rank's ``input_tensor``, in rank order; returns when done."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = output_tensor.view(world, -1)
        if input_tensor.data_ptr() != chunks[rank].data_ptr():  # FSDP's copy-in usually writes it there already
            chunks[rank].copy_(input_tensor)
        works = [dist.broadcast(chunks[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
                 for r in range(world)]
        for work in works:
            work.wait()
        return None  # FSDP treats None as a finished (synchronous) all-gather


class WireReduceScatter(FSDPReduceScatter):
    """A reduce-scatter for FSDP2 that sends its input's dtype and adds the received chunks in FP32.

    Example::

        comm = WireReduceScatter()
        fsdp_module.set_custom_reduce_scatter(comm)

    Attributes:
        stats: collectives launched and payload bytes this rank sent.
    """

    def __init__(self) -> None:
        self.stats = CommStats()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer from the device's allocator."""
        return _allocate(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        """Write into ``output_tensor`` the sum (or mean, for ``AVG``) of every rank's chunk of ``input_tensor``.

        Raises:
            ValueError: ``op`` is neither ``SUM`` nor ``AVG``.
        """
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"WireReduceScatter sums or averages; FSDP asked for {op!r}")
        world = dist.get_world_size(group)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        self.stats.calls += 1
        self.stats.bytes += input_tensor.numel() * input_tensor.element_size()
        chunks = received.view(world, -1)
        divisor = world if op == dist.ReduceOp.AVG else 1
        # Slices bound the FP32 temporaries; rank order: every rank adds the same numbers in the same order.
        for lo in range(0, output_tensor.numel(), _SLICE):
            hi = min(lo + _SLICE, output_tensor.numel())
            total = chunks[0, lo:hi].float()
            for chunk in chunks[1:]:
                total += chunk[lo:hi]
            if divisor != 1:
                total /= divisor
            output_tensor[lo:hi].copy_(total)
        return None


_SLICE = 1 << 16
"""Elements summed at once in FP32 (256 KiB of temporaries)."""
