"""Which rows of a parameter each rank holds under sharding stage 3 (FSDP2's ``Shard(0)``).

``fully_shard`` cuts every parameter along dim 0 the way ``torch.chunk``
does: chunks of ``ceil(dim0 / world_size)`` rows, the last rank(s) getting
fewer rows or none. So rank ``r`` holds rows ``[r * c, (r + 1) * c)``
clipped to ``[0, dim0)``: one contiguous range of the flattened parameter.
Checkpoints record and cut stage-3 state with these functions;
:func:`local_rows` checks the rule against the rows a DTensor really holds,
so a layout FSDP2 might cut otherwise fails loudly instead of being misread.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["like_local_rows", "local_rows", "row_numel", "rows_of", "rows_of_every_rank"]


def rows_of(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the rows of a ``dim0``-row tensor that ``rank`` of ``world_size`` holds."""
    chunk = math.ceil(dim0 / world_size) if dim0 else 0
    return min(rank * chunk, dim0), min((rank + 1) * chunk, dim0)


def rows_of_every_rank(dim0: int, world_size: int) -> list[tuple[int, int]]:
    """:func:`rows_of` for ranks ``0 .. world_size - 1``."""
    return [rows_of(dim0, world_size, r) for r in range(world_size)]


def row_numel(shape: tuple[int, ...] | list[int] | torch.Size) -> int:
    """Elements per dim-0 row of a tensor of ``shape`` (1 for a 0-d or 1-d tensor)."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def local_rows(tensor: DTensor) -> tuple[int, int]:
    """The rows of ``tensor``'s global shape that this rank's local shard holds.

    Raises:
        ValueError: ``tensor`` is not sharded on dim 0 over a 1-d mesh, or
            its local shard is not the rows :func:`rows_of` gives (a layout
            distamp's stage-3 checkpoints do not know how to cut).
    """
    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    if mesh.ndim != 1 or placements != (Shard(0),) or tensor.dim() == 0:
        raise ValueError(
            f"a stage-3 tensor of shape {tuple(tensor.shape)} is placed as {placements} on a {mesh.ndim}-d mesh; "
            "distamp checkpoints cut only FSDP2's default Shard(0) over one data-parallel mesh dimension"
        )
    start, stop = rows_of(tensor.shape[0], mesh.size(), mesh.get_local_rank())
    local = tensor.to_local().shape
    if tuple(local) != (stop - start, *tensor.shape[1:]):
        raise ValueError(
            f"rank {mesh.get_local_rank()} holds a local shard of shape {tuple(local)} of a tensor of shape "
            f"{tuple(tensor.shape)}, not rows [{start}, {stop}) as torch.chunk cuts it over {mesh.size()} ranks; "
            "distamp checkpoints cannot cut this layout"
        )
    return start, stop


def like_local_rows(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` (this rank's rows of a tensor shaped as ``like``) as a DTensor laid out as ``like``, on its device.

    No collective: every rank wraps its own rows (``run_check=False``).
    """
    return DTensor.from_local(local.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride(), run_check=False)
