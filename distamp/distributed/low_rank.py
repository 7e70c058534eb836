"""The matrix side of PowerSGD: which gradients to compress, orthogonalisation, the starting Q.

Kept apart from the comm hook (:mod:`distamp.distributed.powersgd`) so the
numerics can be checked against a plain reference without a process group.
Everything here works in FP32, whatever the gradients' dtype.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["effective_rank", "matrix_shape", "orthogonalize_", "start_q"]


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """``(first dim, product of the rest)`` for a tensor of >= 2 dims; None for scalars and vectors."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = 1
    for size in shape[1:]:
        cols *= int(size)
    return rows, cols


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """The rank actually used: a matrix has no more than ``min(rows, cols)`` independent directions."""
    return max(1, min(rows, cols, rank))


def orthogonalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of an FP32 ``matrix`` in place; returns it.

    A column that is (or becomes, once the earlier ones are projected out)
    exactly zero stays zero instead of turning into 0/0 = NaN: torch's
    ``powerSGD_hook`` divides by the norm with an epsilon of 0 by default, so
    a gradient with an all-zero column (an unused embedding row, a frozen
    input) makes NaN there. Dividing by 1 where the norm is 0 keeps every
    non-zero column exactly what plain Gram-Schmidt makes of it.
    Non-finite input stays non-finite (the step is then skipped).
    """
    if matrix.dtype != torch.float32:
        raise TypeError(f"orthogonalize_ works in float32; got a {matrix.dtype} matrix")
    cols = matrix.shape[1]
    for i in range(cols):
        col = matrix[:, i : i + 1]
        norm = torch.linalg.vector_norm(col)
        col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < cols:
            rest = matrix[:, i + 1 :]
            rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))
    return matrix


def start_q(name: str, cols: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """A random orthonormal ``cols x rank`` FP32 Q, the same on every rank for the same arguments.

    Drawn from a private CPU generator seeded from ``seed`` and the
    parameter's name, so the global RNG streams (and hence a resumed run's
    data order and dropout) are untouched.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    q = torch.randn(cols, rank, generator=generator, dtype=torch.float32)
    return orthogonalize_(q).to(device)
