"""DDP communication hooks that put gradients on the wire in 16 bits.

torch ships ``fp16_compress_hook`` and ``bf16_compress_hook``, but the BF16
one refuses gloo, and neither lets the pre-division factor be chosen. The
hook here works on any backend that all-reduces the wire dtype (NCCL, and
gloo for float16, bfloat16 and float32) and counts what it sends, so tests
and benchmarks can check "one all-reduce per bucket" and "half the bytes of
FP32".
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distamp.distributed.grad_layout import as_indexed
from distamp.torch_compat import foreach_add_, foreach_copy_, foreach_div_

__all__ = ["CommStats", "LowPrecisionAllReduce", "PendingFp32Grads", "add_fp32_sums", "add_pending_fp32",
           "low_precision_allreduce_hook"]

Pending = Callable[[Sequence[torch.Tensor]], "list[torch.Tensor | None] | None"]


@dataclass
class CommStats:
    """What a hook has sent since it was created.

    Attributes:
        calls: number of bucket all-reduces launched.
        bytes: payload bytes this rank contributed to those all-reduces.
    """

    calls: int = 0
    bytes: int = 0


class LowPrecisionAllReduce:
    """State of a DDP comm hook that averages a gradient bucket with ``wire_dtype`` on the wire.

    The bucket is divided in place by ``predivide_factor`` (in its own
    dtype, so an FP32 gradient that only fits FP16 once divided survives),
    cast to ``wire_dtype`` (no copy when it already has that dtype, as in O2
    where parameters and hence buckets are 16-bit), all-reduced, divided by
    the rest of the world size, and written back into the bucket. With the
    default factor the 16-bit sum of ``world_size`` gradients cannot
    overflow unless their mean does.

    Example::

        hook = LowPrecisionAllReduce(torch.float16)
        hook.register(ddp_model)
        ...
        print(hook.stats.calls, hook.stats.bytes)

    Args:
        wire_dtype: dtype the gradients have while crossing the network.
        predivide_factor: divide by this before the all-reduce and by
            ``world_size / predivide_factor`` after; ``None`` divides by the
            whole world size before (safest against FP16 overflow).
        process_group: the data-parallel group; ``None`` means the world.
        pending: returns, for a bucket's parameters, FP32 sums to add to the
            bucket before the wire cast (gradient merge's earlier
            micro-batches in O2, see
            :class:`PendingFp32Grads`), or None.
    """

    def __init__(
        self,
        wire_dtype: torch.dtype,
        predivide_factor: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        pending: Pending | None = None,
    ) -> None:
        if wire_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"wire_dtype={wire_dtype!r} is not supported; use torch.float16, "
                "torch.bfloat16 or torch.float32"
            )
        self.wire_dtype = wire_dtype
        self.process_group = process_group
        world_size = dist.get_world_size(process_group)
        if predivide_factor is None:
            predivide_factor = float(world_size)
        if not 1.0 <= predivide_factor <= world_size:
            raise ValueError(
                f"gradient_predivide_factor={predivide_factor!r} must be between 1 and "
                f"the world size {world_size}"
            )
        self.predivide_factor = float(predivide_factor)
        self.postdivide_factor = world_size / self.predivide_factor
        self.pending = pending
        self.stats = CommStats()

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        """Install this hook on ``ddp`` (once, before its first backward)."""
        ddp.register_comm_hook(self, low_precision_allreduce_hook)


def low_precision_allreduce_hook(
    state: LowPrecisionAllReduce, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook body for :class:`LowPrecisionAllReduce` (``state`` is the instance)."""
    buffer = bucket.buffer()
    # Divide before casting: an FP32 (O1) gradient, or gradient merge's FP32
    # sum, in [65504, 65504 * world_size) is finite once divided but inf if
    # cast first. Dividing the bucket in place is fine: the result overwrites it.
    add_pending_fp32(buffer, bucket.parameters(), state.pending, state.predivide_factor)
    wire = buffer
    if wire.dtype != state.wire_dtype:
        wire = wire.to(state.wire_dtype)
    nbytes = wire.numel() * wire.element_size()
    state.stats.calls += 1
    state.stats.bytes += nbytes
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.postdivide_factor != 1.0:
            reduced.div_(state.postdivide_factor)
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return work.get_future().then(finish)


def add_pending_fp32(buffer: torch.Tensor, params: Sequence[torch.Tensor], pending: Pending | None,
                     divisor: float | None = None) -> None:
    """Add the FP32 sums ``pending`` has for the bucket's parameters into the bucket, rounding once.

    Gradient merge in O2: the earlier micro-batches' FP32 sum (the
    accumulator, consumed here) takes this micro-batch's gradient in FP32
    and the total is rounded into the 16-bit bucket once, instead of once
    per micro-batch; no buffer is allocated. With ``divisor`` the whole
    bucket is divided by it too, each pending total in FP32 before it is
    rounded (so one beyond the 16-bit range whose quotient fits stays finite).
    """
    extra = pending(params) if pending is not None else None
    if extra is None:
        if divisor is not None:
            buffer.div_(divisor)
        return
    grads, position = [], 0
    for p in params:
        grads.append(as_indexed(buffer[position : position + p.numel()].view(p.shape), p))
        position += p.numel()
    add_fp32_sums(grads, extra, divisor)


def add_fp32_sums(grads: Sequence[torch.Tensor], sums: Sequence[torch.Tensor | None],
                  divisor: float | None = None) -> None:
    """Round ``(sums[i] + grads[i]) / divisor``, computed in the FP32 ``sums[i]``, into ``grads[i]``.

    ``grads`` are indexed as their parameters (:func:`as_indexed`: the
    bucket holds a gradient in its parameter's memory order, the sum is in
    index order, so a ``channels_last`` one is added element by element as
    its parameter indexes it). A gradient without a sum (None) is only
    divided. The sums are consumed.
    """
    totals = [(g, s) for g, s in zip(grads, sums, strict=True) if s is not None]
    rest = [g for g, s in zip(grads, sums, strict=True) if s is None]
    if totals:
        targets, fp32 = [g for g, _ in totals], [s for _, s in totals]
        foreach_add_(fp32, targets)
        if divisor is not None:
            foreach_div_(fp32, divisor)
        foreach_copy_(targets, fp32)
    if divisor is not None and rest:
        foreach_div_(rest, divisor)


class PendingFp32Grads:
    """What a comm hook adds to a bucket before the wire cast: the attached optimizers' pending FP32 sums.

    Looked up at every bucket (accumulators appear lazily); costs one pass
    over the optimizers when none is pending.

    Args:
        optimizers: the live list of meta-optimizers attached to the model.
    """

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = optimizers

    def __call__(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """FP32 sums aligned with ``params`` (None where there is none), or None when nothing is pending."""
        pending = [acc for acc in (getattr(opt.precision, "grad_accumulator", None) for opt in self.optimizers)
                   if acc is not None and acc.pending]
        if not pending:
            return None
        out = []
        for p in params:
            view = None
            for acc in pending:
                view = acc.view_of(p)
                if view is not None:
                    break
            out.append(view)
        for acc in pending:
            acc.consumed = True
        return out
