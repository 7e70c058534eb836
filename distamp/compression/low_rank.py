"""The matrix side of PowerSGD: which gradients to compress, orthogonalisation, the starting Q.

Kept apart from the comm hook (:mod:`distamp.compression.powersgd`) so the
numerics can be checked against a plain reference without a process group.
Everything here works in FP32, whatever the gradients' dtype.

What every rank must compute to the same bits (the orthogonalised P, the
product ``P Q^T`` written back as the mean gradient) is built here from
elementwise torch ops only, in an order fixed by the code: an elementwise
add, multiply, divide or square root is one IEEE rounding on every
instruction set, while torch's reductions and matrix products sum in an
order that depends on the CPU's vector width (``ATEN_CPU_CAPABILITY``),
on oneDNN's or MKL's choice of kernel, and on the GPU model.
"""

from __future__ import annotations

import math
import zlib

import torch

__all__ = ["effective_rank", "fixed_order_product", "is_power_of_two", "matrix_shape", "orthogonalize_", "start_q"]


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


def is_power_of_two(value: float) -> bool:
    """True for 2**k: dividing by it is multiplying by its reciprocal, bit for bit."""
    mantissa, _ = math.frexp(value)
    return value > 0 and mantissa == 0.5


def _sum_rows(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by pairwise halving (rows ``i`` and ``i + half``, an odd last row carried): a fixed order."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half : 2 * half]
        x = head if x.shape[0] % 2 == 0 else torch.cat([head, x[2 * half :]])
    return x[0]


def orthogonalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of an FP32 ``matrix`` in place; returns it. The same bits on every CPU and GPU.

    Column by column, as the CPU kernels do: ``v /= |v|``, then
    ``w -= (v . w) v`` for each later column ``w``. Norms and dot products
    are summed in FP64 (each product of two FP32 numbers is exact there) in
    a fixed pairwise order and rounded once to FP32; every other step is one
    FP32 elementwise op. No torch reduction or matrix product is used, so
    ranks on different instruction sets agree bit for bit (the kernels sum
    in row order instead, so the two may differ in the last bit).

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
        wide = col.double()
        norm = _sum_rows(wide * wide).sqrt().float()
        col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < cols:
            rest = matrix[:, i + 1 :]
            dots = _sum_rows(col.double() * rest.double()).float()
            rest.sub_(col * dots)
    return matrix


def fixed_order_product(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor | None = None,
                        work: torch.Tensor | None = None) -> torch.Tensor:
    """``P Q^T`` (FP32 ``rows x rank`` times ``rank x cols``) summed over the rank in order, from the first term.

    ``out = p[:, 0] qt[0]``, then ``out += p[:, k] qt[k]`` for each later
    ``k``: one FP32 multiply and one add per term, the order the CPU kernels'
    ``finish`` uses, so with the same factors both give the same bits on any
    host. ``work`` (``rows x cols``, FP32) holds each term; costs ``2 rank - 1``
    elementwise passes over the matrix.
    """
    rank = p.shape[1]
    out = torch.mul(p[:, :1], qt[:1], out=out) if out is not None else p[:, :1] * qt[:1]
    if rank > 1:
        term = work if work is not None else torch.empty_like(out)
        for k in range(1, rank):
            out.add_(torch.mul(p[:, k : k + 1], qt[k : k + 1], out=term))
    return out


def start_q(name: str, cols: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """A random orthonormal ``cols x rank`` FP32 Q, the same for the same arguments on one instruction set.

    Drawn from a private CPU generator seeded from ``seed`` and the
    parameter's name, so the global RNG streams (and hence a resumed run's
    data order and dropout) are untouched. torch's normal sampler is
    vectorised, so a rank on another instruction set may draw other bits:
    that changes only its own ``M Q`` before the all-reduce of P, never
    what the ranks agree on.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    q = torch.randn(cols, rank, generator=generator, dtype=torch.float32)
    return orthogonalize_(q).to(device)
