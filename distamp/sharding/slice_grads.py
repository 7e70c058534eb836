"""The reduced gradient of one rank's slice, and what the model's ``.grad`` shows of it.

Under sharding each rank needs the reduced gradient of its own slice only
(:mod:`distamp.sharding.sharded_masters`). :class:`SliceGrads` is that flat
buffer, filled either from the model's ``.grad`` at step time (no
data-parallel model) or, during backward, by the reduce-scatter of stages 1
and 2, which sums the ranks' copies in FP32, adds the sum into it and sets
:attr:`SliceGrads.reduced`. Stage 2 frees each ``.grad`` once it is in a
bucket, so its reducer also records in :attr:`SliceGrads.arrived` which
parameters got a gradient.

Its dtype: FP32 (the "main grad", as Megatron-LM calls it) where gradients
are accumulated over micro-batches (gradient merge) and with O1 or AMP off;
the model's 16-bit dtype in O2 without gradient merge, where the unsharded
all-reduce also leaves the reduced sum rounded to 16 bits in ``.grad``. A
16-bit slice is unscaled, checked and applied one FP32 chunk at a time
(:mod:`distamp.core.chunked_update`), through one :class:`PieceGrad` per
piece; only ``unscale_()``, clipping and optimizers that cannot step on
slices make a whole FP32 copy (:meth:`SliceGrads.materialize`), for that
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from distamp.core.chunked_update import copy_and_unscale_, holds_rounding_of
from distamp.core.flat_layout import Piece
from distamp.torch_compat import foreach_copy_, foreach_zero_, tensor_version

__all__ = ["PieceGrad", "SliceGrads"]


class PieceGrad:
    """The 16-bit gradient of one piece of a 16-bit slice (a :class:`~distamp.core.chunked_update.GradSource`).

    ``grad`` is a 1-D view of the slice (or of the model's ``.grad`` when no
    reduce-scatter filled the slice), or ``None`` when the piece got no gradient.
    """

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class SliceGrads:
    """Gradients of the pieces ``[lo, hi)`` of the flat space; in FP32 the pieces' ``.grad`` point into them.

    Example::

        grads = SliceGrads(model_params, pieces, masters, lo, hi)
        grads.collect()              # my slice of the (all-reduced) model gradients, in FP32
        inner_optimizer.step()       # masters[j].grad are views of grads.buffer
        grads.zero()

    With a 16-bit ``dtype`` :meth:`collect` points :attr:`sources` at the
    slice instead and leaves the masters' ``.grad`` unset until
    :meth:`materialize` makes a whole FP32 copy.

    Args:
        model_params: every parameter of the flat space, in order.
        pieces: this rank's pieces of them, in flat order.
        masters: the tensor the inner optimizer updates for each piece.
        lo: where this rank's slice starts in the flat space.
        hi: where it ends.
        dtype: the slice's dtype (FP32, or the O2 model's 16-bit dtype).
    """

    def __init__(self, model_params: Sequence[nn.Parameter], pieces: Sequence[Piece],
                 masters: Sequence[nn.Parameter], lo: int, hi: int, dtype: torch.dtype = torch.float32) -> None:
        self.model_params = model_params
        self.pieces = pieces
        self.masters = masters
        self.lo = lo
        self.device = model_params[0].device if model_params else torch.device("cpu")
        """Where the slice lives (the parameters' device)."""
        self.dtype = dtype
        self.numel = hi - lo
        self.low = dtype != torch.float32
        """Whether the slice is 16-bit: the masters' FP32 gradients are made per chunk or by :meth:`materialize`."""
        # A 16-bit slice is made when a reduce-scatter first sums into it: with nothing to reduce (one rank, or
        # no data-parallel model) the model's .grad is read in place, and the slice would cost 2 bytes/param.
        self._buffer = None if self.low else torch.zeros(self.numel, dtype=dtype, device=self.device)
        self.sources = [PieceGrad() for _ in pieces]
        """Per piece, where its 16-bit gradient is after :meth:`collect` (16-bit slices only)."""
        self.fp32: torch.Tensor | None = None
        """A 16-bit slice's whole unscaled FP32 copy, made by :meth:`materialize` for one step."""
        self.reduced = False  # set by the reduce-scatter: the buffer already holds the reduced sum
        self.arrived: set[int] = set()
        """Indices of parameters whose gradient the stage-2 reducer summed here (their ``.grad`` is freed)."""
        self.deliveries = 0
        """Backward passes the stage-2 reducer summed here, ever: new gradients that no ``.grad`` shows."""

    @property
    def buffer(self) -> torch.Tensor:
        """The slice, ``numel`` elements of ``dtype`` (a 16-bit one is made when first asked for)."""
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self._buffer

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

        A 16-bit slice points :attr:`sources` at the slice instead, or, when
        nothing was reduced into it, at the model's ``.grad`` (no copy, no
        rounding); ``extra`` then makes the whole FP32 copy at once.
        """
        if self.low:
            self.drop_fp32()  # a copy left by a skipped step holds that step's gradients
            self._collect_sources()
            if extra:
                self.materialize(1.0)
                self._add(extra)
            return
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
        if extra:
            self._add(extra)

    def _add(self, extra: dict[int, torch.Tensor]) -> None:
        for piece, master in zip(self.pieces, self.masters, strict=True):
            more = extra.get(id(self.model_params[piece.param]))
            if more is not None and master.grad is not None:
                master.grad.add_(more.view(-1)[piece.start : piece.stop])

    def _collect_sources(self) -> None:
        for j, (piece, source) in enumerate(zip(self.pieces, self.sources, strict=True)):
            model_grad = self.model_params[piece.param].grad
            if model_grad is None and piece.param not in self.arrived:
                source.grad = None
                if self._buffer is not None:
                    self.view(j).zero_()
            elif self.reduced or model_grad is None:
                source.grad = self.view(j)
            else:
                source.grad = model_grad.view(-1)[piece.start : piece.stop]

    def pairs(self) -> list[tuple[PieceGrad, nn.Parameter]]:
        """``(16-bit gradient, master)`` of each piece that has a gradient, after :meth:`collect` (16-bit slices)."""
        return [(source, master) for source, master in zip(self.sources, self.masters, strict=True)
                if source.grad is not None]

    def materialize(self, inv_scale: float) -> None:
        """A 16-bit slice: make its whole FP32 gradient, unscaled by ``inv_scale``; the masters' ``.grad`` view it.

        Built with the kernels the chunks use (a copy to FP32, then the fused
        unscale), so it holds the same bits; freed by :meth:`drop_fp32` or
        :meth:`zero`. A no-op when it exists or the slice is FP32.
        """
        if not self.low or self.fp32 is not None:
            return
        self.fp32 = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        dst, src = [], []
        for piece, source, master in zip(self.pieces, self.sources, self.masters, strict=True):
            if source.grad is None:
                master.grad = None
                continue
            start = piece.offset - self.lo
            master.grad = self.fp32[start : start + piece.length].view_as(master)
            dst.append(master.grad)
            src.append(source.grad.view_as(master))
        if dst:
            found = torch.zeros(1, dtype=torch.float32, device=self.fp32.device)
            factor = torch.full((1,), inv_scale, dtype=torch.float32, device=self.fp32.device)
            copy_and_unscale_(dst, src, found, factor)

    @property
    def fp32_buffer(self) -> torch.Tensor | None:
        """The whole FP32 gradient slice the masters' ``.grad`` view: the buffer, or a 16-bit slice's :attr:`fp32`."""
        return self.fp32 if self.low else self.buffer

    def drop_fp32(self) -> None:
        """Free a 16-bit slice's whole FP32 copy (after the step it was made for)."""
        if self.low:
            self.fp32 = None
            for master in self.masters:
                master.grad = None

    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]:
        """``(parameter index, gradient)`` of each piece that has one, after :meth:`collect` (16-bit, scaled,
        for a 16-bit slice without its FP32 copy)."""
        if self.low and self.fp32 is None:
            return [(piece.param, source.grad) for piece, source in zip(self.pieces, self.sources, strict=True)
                    if source.grad is not None]
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
            if model_grad is None or master.grad is None or id(model_grad) not in changed:
                continue
            piece_grad = model_grad.view(-1)[piece.start : piece.stop]
            if not holds_rounding_of(piece_grad, master.grad):
                master.grad.copy_(piece_grad)

    def zero(self) -> None:
        """Clear the buffer (what the next backward sums into) and the pieces' ``.grad``."""
        if self._buffer is not None:
            self._buffer.zero_()
        self.reduced = False
        self.arrived.clear()
        self.fp32 = None
        for source in self.sources:
            source.grad = None
        for master in self.masters:
            master.grad = None
