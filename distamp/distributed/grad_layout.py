"""A DDP comm hook's gradient indexed as its parameter, whatever the parameter's memory format.

DDP's comm hook sees each gradient as ``bucket[offset : offset + n].view(shape)``,
a contiguous view of the bucket's memory, while the reducer writes the
gradient into that memory with the parameter's own strides (so that
``gradient_as_bucket_view`` gives ``.grad`` the parameter's layout). For a
``channels_last`` weight of shape ``(O, C, H, W)`` the hook's view at
``[o, c, h, w]`` then holds the gradient of another element; read as a
matrix its rows are ``grad[o]`` in ``(H, W, C)`` order, and for a
transposed weight not even rows of the parameter.
:func:`as_indexed` gives the view that indexes the gradient as the
parameter, so the compressed matrix is "first dim x the rest" in any
format. :func:`memory_order` and :func:`relayout` move state that was kept
in memory order (PowerSGD's error feedback and Q before that) to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_indexed", "memory_order", "relayout"]


def memory_order(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's dims from outermost to innermost in memory, as DDP's reducer lays out its gradient.

    ``(0, 2, 3, 1)`` for a ``channels_last`` 4-d weight; ``(0, ..., n-1)``
    for a contiguous one, and for one that is not dense and
    non-overlapping (the reducer gives those a contiguous gradient).
    """
    order = tuple(int(d) for d in param.dim_order())
    return order if param.permute(order).is_contiguous() else tuple(range(param.dim()))


def as_indexed(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The comm hook's ``grad`` of ``param`` as a view indexed like ``param`` (``grad`` itself when contiguous)."""
    if param.is_contiguous() or memory_order(param) == tuple(range(param.dim())):
        return grad
    return grad.as_strided(param.shape, param.stride(), grad.storage_offset())


def relayout(x: torch.Tensor, sizes: Sequence[int], saved: Sequence[int], current: Sequence[int]) -> torch.Tensor:
    """``x`` with its last axis moved from memory order ``saved`` to ``current`` of a tensor of ``sizes``.

    The last axis of ``x`` enumerates the elements of a tensor of ``sizes``
    laid out in ``saved`` order (outermost dim first); the result, a new
    tensor of ``x``'s shape, enumerates them in ``current`` order. Leading
    axes are kept (the rank axis of a transposed Q).
    """
    if sorted(saved) != list(range(len(sizes))) or sorted(current) != list(range(len(sizes))):
        raise ValueError(f"memory orders {tuple(saved)} and {tuple(current)} must each be a permutation of the "
                         f"{len(sizes)} dims of {tuple(sizes)}")
    lead = list(x.shape[:-1])
    k = len(lead)
    stored = x.reshape(lead + [int(sizes[d]) for d in saved])
    logical = stored.permute(list(range(k)) + [k + list(saved).index(d) for d in range(len(sizes))])
    return logical.permute(list(range(k)) + [k + d for d in current]).reshape(x.shape)
