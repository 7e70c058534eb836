"""Which element of a parameter each entry of the matrix a DDP comm hook compresses is.

DDP's comm hook sees each gradient as ``bucket[offset : offset + n].view(shape)``,
a contiguous view of the bucket's memory, while the reducer writes the
gradient into that memory with the parameter's own strides (so that
``gradient_as_bucket_view`` gives ``.grad`` the parameter's layout). For a
``channels_last`` weight of shape ``(O, C, H, W)`` the hook's matrix row
``o`` then holds ``grad[o]`` in ``(H, W, C)`` order, not ``(C, H, W)``.

Compression works on any fixed reshaping, and within a run the hook writes
back through the same view, so training is unaffected. State kept per
matrix across runs (PowerSGD's error feedback and warm-start Q) is not: a
run resumed with another memory format must move each entry to where the
new layout puts its element. :func:`memory_order` names a layout,
:func:`relayout` moves a tensor between two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["memory_order", "relayout"]


def memory_order(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's dims from outermost to innermost in memory, as DDP's reducer lays out its gradient.

    ``(0, 2, 3, 1)`` for a ``channels_last`` 4-d weight; ``(0, ..., n-1)``
    for a contiguous one, and for one that is not dense and
    non-overlapping (the reducer gives those a contiguous gradient).
    """
    order = tuple(int(d) for d in param.dim_order())
    return order if param.permute(order).is_contiguous() else tuple(range(param.dim()))


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
