"""Gradient merge in O2 sums the micro-batches' 16-bit gradients in FP32.

Autograd accumulates into ``.grad`` in the parameter's dtype, so K micro-
batches of an O2 model were summed in 16 bits: every addition rounds to 8
(BF16) or 11 (FP16) significant bits and the merged gradient loses about
log2(K) bits. Megatron-LM keeps a FP32 ``main_grad`` for the same reason.
Here, after each micro-batch but the last of a window, the 16-bit gradients
are added into a FP32 buffer and zeroed; the last micro-batch's gradient is
added to that buffer in FP32 once, either by the data-parallel comm hook
just before the cast to the wire dtype, or (without one) when the step
copies the gradients into the FP32 masters.

The buffer covers the 16-bit parameters (FP32 ones already accumulate in
FP32): 4 bytes per parameter, allocated at the first merged micro-batch and
kept. Under sharding (stages 1 and 2) it is never needed: every micro-batch
is reduce-scattered and summed into the rank's FP32 gradient slice.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from distamp.torch_compat import foreach_add_, foreach_copy_, foreach_zero_

__all__ = ["Fp32GradAccumulator"]


class Fp32GradAccumulator:
    """FP32 sum of the 16-bit gradients of a gradient-merge window's earlier micro-batches.

    Example::

        acc = Fp32GradAccumulator(model.parameters())
        for micro_batch in window[:-1]:
            loss(micro_batch).backward()
            acc.add_and_zero()            # .grad back to zero, sum kept in FP32
        loss(window[-1]).backward()
        extra = acc.take()                # {id(param): FP32 sum} to add to the last gradient
        acc.reset()

    Args:
        params: the model parameters whose 16-bit gradients are accumulated.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)
        self._views: dict[int, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []
        self.pending = False  # holds micro-batches not yet added to a gradient
        self.consumed = False  # a comm hook already added it to the communicated gradient

    @property
    def nbytes(self) -> int:
        """Bytes held by the FP32 buffers (0 until the first merged micro-batch)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _allocate(self) -> None:
        low = [p for p in self.params if p.dtype in (torch.float16, torch.bfloat16)]
        by_device: dict[torch.device, list[nn.Parameter]] = {}
        for p in low:
            by_device.setdefault(p.device, []).append(p)
        for device, group in by_device.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=torch.float32, device=device)
            self._buffers.append(flat)
            offset = 0
            for p in group:
                self._views[id(p)] = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    def add_and_zero(self) -> None:
        """Add the current 16-bit gradients into the FP32 sum and zero them (a micro-batch that does not sync)."""
        if not self._views:
            self._allocate()
        dst, src = [], []
        for p in self.params:
            view = self._views.get(id(p))
            if view is not None and p.grad is not None:
                dst.append(view)
                src.append(p.grad)
        if not dst:
            return
        if self.pending:
            foreach_add_(dst, src)
        else:
            foreach_copy_(dst, src)  # the window's first micro-batch: no memset needed
            for p in self.params:  # parameters without a gradient in it start from zero
                view = self._views.get(id(p))
                if view is not None and p.grad is None:
                    view.zero_()
        foreach_zero_(src)
        self.pending = True

    def view_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """The FP32 sum for ``param`` (``None`` for FP32 parameters or before any micro-batch)."""
        return self._views.get(id(param)) if self.pending else None

    def take(self) -> dict[int, torch.Tensor] | None:
        """``{id(param): FP32 sum}`` still to be added to the gradients, or None (nothing, or a hook added it)."""
        if not self.pending or self.consumed:
            return None
        return dict(self._views)

    def reset(self) -> None:
        """The window was stepped: the next merged micro-batch starts a new sum."""
        self.pending = False
        self.consumed = False
