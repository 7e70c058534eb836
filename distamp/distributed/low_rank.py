"""The matrix side of PowerSGD: which gradients to compress, orthogonalisation, the starting Q.

Kept apart from the comm hook (:mod:`distamp.distributed.powersgd`) so the
numerics can be checked against a plain reference without a process group.
Everything here works in FP32, whatever the gradients' dtype, but for
:func:`product_to_bf16_`, which writes a BF16 gradient from FP32 factors.
"""

from __future__ import annotations

import math
import zlib

import torch

__all__ = ["effective_rank", "is_power_of_two", "matrix_shape", "orthogonalize_", "product_to_bf16_", "start_q"]


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


def product_to_bf16_(out: torch.Tensor, p: torch.Tensor, qt: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``scale * p @ qt`` (FP32 factors) into the BF16 matrix ``out`` in one BF16 product; returns ``out``.

    Each factor is split into a high and a low BF16 half (``p = ph + pl``
    keeps 16 of FP32's 24 significant bits), and
    ``[ph ph pl pl] @ [qh; ql; qh; ql]`` is one BF16 matrix product with an
    FP32 accumulator: every partial product of two BF16 numbers is exact in
    FP32, so each term of ``p @ qt`` is right to about 2^-16 of its size
    before the one rounding to BF16 (2^-8). Against rounding an FP32
    ``p @ qt``, which costs a full FP32 matrix plus a conversion pass,
    about 0.2% of the elements differ: by one BF16 unit in the last place,
    or, where the terms of an element cancel, by about 2^-16 of the terms.
    ``scale`` multiplies ``p`` first (exactly, for a power of two).
    """
    if out.dtype != torch.bfloat16 or p.dtype != torch.float32 or qt.dtype != torch.float32:
        raise TypeError(f"product_to_bf16_ writes a bfloat16 out from float32 factors; got out {out.dtype}, "
                        f"p {p.dtype}, qt {qt.dtype}")
    if scale != 1.0:
        p = p * scale
    p_hi = p.to(torch.bfloat16)
    p_lo = (p - p_hi.float()).to(torch.bfloat16)
    q_hi = qt.to(torch.bfloat16)
    q_lo = (qt - q_hi.float()).to(torch.bfloat16)
    left = torch.cat([p_hi, p_hi, p_lo, p_lo], dim=1)
    right = torch.cat([q_hi, q_lo, q_hi, q_lo], dim=0)
    return torch.mm(left, right, out=out)
