"""Stage 3's collectives for FSDP2: the gradient reduce-scatter and the parameter all-gather.

**Reduce-scatter: ``comm_dtype`` on the wire, the sum taken in FP32.**

FSDP2 reduce-scatters each unit's gradients in the policy's
``reduce_dtype``; with a 16-bit ``reduce_dtype`` the backend would also
*sum* in 16 bits. distamp sets ``reduce_dtype`` to the wire dtype
(``comm_dtype``, default ``dtype``), so FSDP's buffers are 16-bit, and
installs :class:`WireReduceScatter` as the collective
(``FSDPModule.set_custom_reduce_scatter``): each rank gets its chunk from
every other, and the chunks are added in FP32 in rank order, then rounded
once to the output's dtype (two chunks in one ``torch.add``, more in FP32
slices). On gloo the chunks travel as pairwise messages of at most 2 MiB
received into two buffers of one message (``all_to_all_single`` would
receive a whole copy of the input, the largest transient of a unit's
reduce); elsewhere as one ``all_to_all_single``. FSDP then widens the sum
into the FP32 sharded gradient, where micro-batches accumulate in FP32.
(For FP16, FSDP still divides the gradients by about sqrt(world) before
this call and by the rest after it.) Stages 1 and 2 keep the FP32
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

**Buffers freed when done, on the calling thread (CPU).** FSDP holds some
buffers longer for CUDA streams: the output of a forward all-gather it was
told is synchronous until the next unit's copy-out, and every reduce-scatter
input until the next unit's reduce-scatter. On CPU each is one more unit's
worth of 16-bit bytes alive for nothing, so the all-gather returns a
finished ``Work`` (FSDP then frees its output after the copy-out) and the
reduce-scatter frees the input it handed FSDP once it is sent. gloo's Work
keeps the tensors it was given until gloo's own thread lets go of it, which
a loaded host can delay past the next unit's allocations (and whose free
then happens on that thread): the collectives detach those tensors from
their memory before returning.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distamp.distributed.comm_hooks import CommStats
from distamp.sharding.pairwise import drop_storage, on_gloo, peers, receive, send
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
        """Fill ``output_tensor`` with every rank's ``input_tensor``, in rank order; returns a finished Work."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        # Detached: a view would keep the whole output alive through its base while gloo holds it (see drop_storage).
        chunks = [chunk.detach() for chunk in output_tensor.view(world, -1).unbind()]
        if input_tensor.data_ptr() != chunks[rank].data_ptr():  # FSDP's copy-in usually writes it there already
            chunks[rank].copy_(input_tensor)
        works = [dist.broadcast(chunks[r], src=dist.get_global_rank(group, r), group=group, async_op=True)
                 for r in range(world)]
        for work in works:
            work.wait()
        drop_storage(chunks)
        return _FINISHED


class _Finished(dist.Work):
    """A collective that has already completed, returned to FSDP in place of ``None``.

    FSDP keeps the output of a forward all-gather it was told is synchronous
    (``None``) until the next unit's copy-out, to overlap CUDA streams; on CPU
    that only holds two units' buffers at once. For a Work it frees the
    output right after the copy-out.
    """

    def wait(self, timeout: object = None) -> bool:
        """Nothing to wait for."""
        return True

    def is_completed(self) -> bool:
        """Always True."""
        return True


_FINISHED = _Finished()


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
        self._inputs: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer from the device's allocator (FSDP's input buffer: on CPU freed once sent)."""
        buffer = _allocate(size, dtype, device)
        self._inputs[id(buffer)] = buffer
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | dist.ReduceOp.RedOpType, async_op: bool = False) -> dist.Work | None:
        """Write into ``output_tensor`` the sum (or mean, for ``AVG``) of every rank's chunk of ``input_tensor``.

        Raises:
            ValueError: ``op`` is neither ``SUM`` nor ``AVG``.
        """
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"WireReduceScatter sums or averages; FSDP asked for {op!r}")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.stats.calls += 1
        self.stats.bytes += input_tensor.numel() * input_tensor.element_size()
        ours = input_tensor.device.type == "cpu" and self._inputs.get(id(input_tensor)) is input_tensor
        divisor = world if op == dist.ReduceOp.AVG else 1
        if on_gloo(group) and world > 1:
            _reduce_pairwise(output_tensor, input_tensor, group, world, rank, divisor)
            if ours:
                input_tensor.untyped_storage().resize_(0)  # as below, once the sum has read this rank's chunk
        else:
            received = torch.empty_like(input_tensor)
            dist.all_to_all_single(received, input_tensor, group=group)
            if ours:
                # FSDP's buffer from allocate(), sent: FSDP keeps it until the next unit's reduce-scatter, for CUDA
                # streams, and nothing reads it again. Freed before the sum, which needs ``received`` only.
                input_tensor.untyped_storage().resize_(0)
            _sum_into(output_tensor, list(received.view(world, -1).unbind()), divisor)
            if input_tensor.device.type == "cpu":
                # Here, not whenever gloo's thread drops its Work (see drop_storage).
                received.untyped_storage().resize_(0)
        return None


def _sum_into(output: torch.Tensor, chunks: Sequence[torch.Tensor], divisor: int) -> None:
    """``output = sum(chunks) / divisor``, added in FP32 (float64 for float64) in the order given, rounded once.

    Two chunks of ``output``'s dtype are one ``torch.add``: torch adds
    16-bit tensors in FP32 and rounds once (CPU and CUDA), which is the
    same sum, with no temporary. Otherwise :data:`_SLICE` elements at a
    time, which bounds the FP32 temporaries.
    """
    if len(chunks) == 2 and divisor == 1 and chunks[0].dtype == chunks[1].dtype == output.dtype:
        torch.add(chunks[0], chunks[1], out=output)
        return
    for lo in range(0, output.numel(), _SLICE):
        hi = min(lo + _SLICE, output.numel())
        total = chunks[0][lo:hi].to(torch.promote_types(output.dtype, torch.float32))
        for chunk in chunks[1:]:
            total += chunk[lo:hi]
        if divisor != 1:
            total /= divisor
        output[lo:hi].copy_(total)


def _reduce_pairwise(output: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, world: int,
                     rank: int, divisor: int) -> None:
    """The reduce-scatter as pairwise messages (gloo) of at most :data:`_MESSAGE` elements.

    Every message to every peer is posted at once, straight from
    ``input_tensor``; the peers' messages for this rank are received into
    two buffers of one message each (the next arrives while this one is
    summed) and added, in rank order, to this rank's own chunk read from
    ``input_tensor``. So nothing the size of the input is allocated, where
    ``all_to_all_single`` receives into a whole copy of it.
    """
    chunks = input_tensor.view(world, -1)
    others = peers(rank, world)
    bounds = [(lo, min(lo + _MESSAGE, output.numel())) for lo in range(0, output.numel(), _MESSAGE)]
    outgoing = [chunks[peer, lo:hi].detach() for lo, hi in bounds for peer in others]
    sends = [send(view, group, others[i % len(others)], TAG_REDUCE_SCATTER + i // len(others))
             for i, view in enumerate(outgoing)]
    buffers = [torch.empty((world - 1, min(_MESSAGE, output.numel())), dtype=input_tensor.dtype,
                           device=input_tensor.device) for _ in range(min(2, len(bounds)))]

    def post(k: int) -> tuple[list[torch.Tensor], list[dist.Work]]:
        lo, hi = bounds[k]
        slots = [row[: hi - lo].detach() for row in buffers[k % 2]]
        tag = TAG_REDUCE_SCATTER + k
        return slots, [receive(slot, group, peer, tag) for slot, peer in zip(slots, others, strict=True)]

    pending = {k: post(k) for k in range(len(buffers))}
    for k, (lo, hi) in enumerate(bounds):
        slots, works = pending.pop(k)
        for work in works:
            work.wait()
        by_rank = {peer: buffers[k % 2][i, : hi - lo] for i, peer in enumerate(others)}
        by_rank[rank] = chunks[rank, lo:hi]
        _sum_into(output[lo:hi], [by_rank[r] for r in range(world)], divisor)
        drop_storage(slots)
        if k + 2 < len(bounds):
            pending[k + 2] = post(k + 2)
    for work in sends:
        work.wait()
    drop_storage(outgoing)


TAG_REDUCE_SCATTER = 0x5A3 << 16
"""The first tag of the reduce-scatter's pairwise messages (slice ``k`` adds ``k``)."""

_SLICE = 1 << 15
"""Elements summed at once in FP32 (128 KiB temporaries)."""

_MESSAGE = 1 << 20
"""Elements per pairwise message on gloo (2 MiB of BF16): a unit's chunk up to that size is one message per
peer. Each message costs: reducing a 1M-element chunk on loopback (2 ranks) took 3.2-5.8 ms as one message,
6.5-7.2 ms as 256K-element messages and 5.3-6.8 ms with ``all_to_all_single``; on the 6.56M MLP 32K-element
messages made the step 1.32x torch's FSDP2."""
