"""The FP32 gradient of one rank's slice, and what the model's ``.grad`` shows of it.

Under sharding each rank needs the reduced gradient of its own slice only
(:mod:`distamp.sharding.sharded_masters`), in FP32 (the "main grad", as
Megatron-LM calls it). :class:`SliceGrads` is that flat FP32 buffer. It is
filled either from the model's ``.grad`` at step time (no data-parallel
model) or, during backward, by the reduce-scatter of stages 1 and 2, which
adds every micro-batch into it and sets :attr:`SliceGrads.reduced`. Stage 2
frees each ``.grad`` once it is in a bucket, so its reducer also records in
:attr:`SliceGrads.arrived` which parameters got a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from distamp.sharding.flat_layout import Piece
from distamp.torch_compat import foreach_copy_, foreach_zero_, tensor_version

__all__ = ["SliceGrads"]


class SliceGrads:
    """FP32 gradients of the pieces ``[lo, hi)`` of the flat space, with the pieces' ``.grad`` pointing into them.

    Example::

        grads = SliceGrads(model_params, pieces, masters, lo, hi)
        grads.collect()              # my slice of the (all-reduced) model gradients, in FP32
        inner_optimizer.step()       # masters[j].grad are views of grads.buffer
        grads.zero()

    Args:
        model_params: every parameter of the flat space, in order.
        pieces: this rank's pieces of them, in flat order.
        masters: the tensor the inner optimizer updates for each piece.
        lo: where this rank's slice starts in the flat space.
        hi: where it ends.
    """

    def __init__(self, model_params: Sequence[nn.Parameter], pieces: Sequence[Piece],
                 masters: Sequence[nn.Parameter], lo: int, hi: int) -> None:
        self.model_params = model_params
        self.pieces = pieces
        self.masters = masters
        self.lo = lo
        device = model_params[0].device if model_params else torch.device("cpu")
        self.buffer = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        self.reduced = False  # set by the reduce-scatter: the buffer already holds the reduced sum
        self.arrived: set[int] = set()
        """Indices of parameters whose gradient the stage-2 reducer summed here (their ``.grad`` is freed)."""
        self.deliveries = 0
        """Backward passes the stage-2 reducer summed here, ever: new gradients that no ``.grad`` shows."""

    def view(self, index: int) -> torch.Tensor:
        """The FP32 gradient of piece ``index``."""
        piece = self.pieces[index]
        start = piece.offset - self.lo
        return self.buffer[start : start + piece.length]

    def collect(self, extra: dict[int, torch.Tensor] | None = None) -> None:
        """Fill the buffer (unless :attr:`reduced`) and point each piece's ``.grad`` at it.

        Unless the reduce-scatter already summed the reduced gradients into
        it, the buffer is copied from the model's ``.grad``; ``extra``
        (``{id(param): FP32 tensor}``, e.g. a gradient-merge sum the
        communication did not take) is added. A piece whose parameter has no
        gradient (no ``.grad`` and not :attr:`arrived`) gets ``grad = None``,
        so the inner optimizer skips it.
        """
        dst, src = [], []
        for j, (piece, master) in enumerate(zip(self.pieces, self.masters, strict=True)):
            model_grad = self.model_params[piece.param].grad
            if model_grad is None and piece.param not in self.arrived:
                master.grad = None
                self.view(j).zero_()  # nothing stale for the check and the norm to find
                continue
            master.grad = self.view(j).view_as(master)
            if not self.reduced and model_grad is not None:
                dst.append(master.grad)
                src.append(model_grad.view(-1)[piece.start : piece.stop])
        if dst:
            foreach_copy_(dst, src)
        for piece, master in zip(self.pieces, self.masters, strict=True):
            more = extra.get(id(self.model_params[piece.param])) if extra else None
            if more is not None and master.grad is not None:
                master.grad.add_(more.view(-1)[piece.start : piece.stop])

    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]:
        """``(parameter index, FP32 gradient)`` of each piece that has one, after :meth:`collect`."""
        return [(piece.param, master.grad) for piece, master in zip(self.pieces, self.masters, strict=True)
                if master.grad is not None]

    def expose(self) -> list[tuple[torch.Tensor, int]]:
        """Write this slice of the (unscaled) gradients into the model's ``.grad``, zeros elsewhere.

        Returns each written ``.grad`` with its version counter, so changes the
        user makes can be found (see :meth:`take_changes`).
        """
        grads = [p.grad for p in self.model_params if p.grad is not None]
        if grads:
            foreach_zero_(grads)
        for piece, master in zip(self.pieces, self.masters, strict=True):
            model_grad = self.model_params[piece.param].grad
            if model_grad is not None and master.grad is not None:
                model_grad.view(-1)[piece.start : piece.stop].copy_(master.grad)
        return [(g, tensor_version(g)) for g in grads]

    def take_changes(self, changed: set[int]) -> None:
        """Copy back this slice of each model ``.grad`` whose ``id`` is in ``changed``."""
        for piece, master in zip(self.pieces, self.masters, strict=True):
            model_grad = self.model_params[piece.param].grad
            if model_grad is not None and master.grad is not None and id(model_grad) in changed:
                master.grad.copy_(model_grad.view(-1)[piece.start : piece.stop])

    def zero(self) -> None:
        """Clear the buffer (what the next backward sums into) and the pieces' ``.grad``."""
        self.buffer.zero_()
        self.reduced = False
        self.arrived.clear()
        for master in self.masters:
            master.grad = None
