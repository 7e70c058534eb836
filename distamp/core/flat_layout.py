"""The flat parameter space of an optimizer and its split into one contiguous slice per rank.

Sharding (ZeRO, https://arxiv.org/abs/1910.02054) gives each rank a part of
the optimizer's work. distamp lays the optimizer's parameters end to end, in
the order its param groups list them, and cuts that flat space into
``world_size`` contiguous slices whose sizes differ by at most one element:
rank ``r`` owns ``[r * N // W, (r + 1) * N // W)``. A slice may start or end
inside a parameter (balance does not depend on parameter sizes, unlike
torch's ``ZeroRedundancyOptimizer``, which assigns whole parameters), so
what a rank updates is a list of :class:`Piece` s: ranges of parameters.

Everything that must agree between ranks (who sends what to whom, where a
checkpoint's slices lie) is computed from :class:`FlatLayout`, a pure
function of the parameters' sizes and the world size.

Example::

    layout = FlatLayout([6, 4], world_size=3)      # 10 elements: slices 0-3, 3-6, 6-10
    layout.bounds                                   # (0, 3, 6, 10)
    layout.pieces(*layout.range_of(1))              # [Piece(param=0, start=3, stop=6, offset=3)]
    layout.pieces(*layout.range_of(2))              # [Piece(param=1, start=0, stop=4, offset=6)]
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "Piece"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), at flat offset ``offset``.

    Attributes:
        param: the parameter's index in the flat order.
        start: first element, within the flattened parameter.
        stop: one past the last element.
        offset: where element ``start`` lies in the flat space.
    """

    param: int
    start: int
    stop: int
    offset: int

    @property
    def length(self) -> int:
        """Number of elements."""
        return self.stop - self.start


class FlatLayout:
    """Parameters of sizes ``numels`` laid end to end and split into ``world_size`` balanced slices.

    Args:
        numels: element count of each parameter, in the optimizer's order.
        world_size: number of slices (ranks), >= 1.

    Raises:
        ValueError: ``world_size`` < 1 or a negative size.
    """

    def __init__(self, numels: Sequence[int], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be >= 1")
        if any(n < 0 for n in numels):
            raise ValueError(f"numels={list(numels)!r} must be sizes >= 0")
        self.numels: tuple[int, ...] = tuple(int(n) for n in numels)
        self.world_size = int(world_size)
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.total = offsets[-1]
        self.bounds: tuple[int, ...] = tuple(r * self.total // self.world_size for r in range(self.world_size + 1))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlatLayout):
            return NotImplemented
        return self.numels == other.numels and self.world_size == other.world_size

    def __hash__(self) -> int:
        return hash((self.numels, self.world_size))

    def __repr__(self) -> str:
        return f"FlatLayout({len(self.numels)} parameters, {self.total} elements, world_size={self.world_size})"

    def range_of(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)``: the flat range rank ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside [0, {self.world_size})")
        return self.bounds[rank], self.bounds[rank + 1]

    def param_range(self, param: int) -> tuple[int, int]:
        """``(lo, hi)``: where parameter ``param`` lies in the flat space."""
        return self.offsets[param], self.offsets[param + 1]

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The parameter ranges that make up flat range ``[lo, hi)``, in flat order (empty parameters skipped)."""
        if hi <= lo:
            return []
        out = []
        index = bisect.bisect_right(self.offsets, lo) - 1
        while index < len(self.numels) and self.offsets[index] < hi:
            first, last = max(lo, self.offsets[index]), min(hi, self.offsets[index + 1])
            if last > first:
                out.append(Piece(index, first - self.offsets[index], last - self.offsets[index], first))
            index += 1
        return out

    def owners(self, param: int, start: int = 0, stop: int | None = None) -> list[tuple[int, Piece]]:
        """``(rank, piece)`` for each rank owning part of elements ``[start, stop)`` of ``param``."""
        base = self.offsets[param]
        stop = self.numels[param] if stop is None else stop
        lo, hi = base + start, base + stop
        if hi <= lo:
            return []
        out = []
        rank = bisect.bisect_right(self.bounds, lo) - 1
        while rank < self.world_size and self.bounds[rank] < hi:
            first, last = max(lo, self.bounds[rank]), min(hi, self.bounds[rank + 1])
            if last > first:
                out.append((rank, Piece(param, first - base, last - base, first)))
            rank += 1
        return out
