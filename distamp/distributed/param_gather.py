"""All-gather of the slices each rank updated, into every rank's parameters.

After a sharded step each rank holds the new values of its slice of the
flat parameter space only (see :mod:`distamp.optim.flat_layout`). This
module puts every slice into every rank's copy of the parameters, in each
parameter's own dtype on the wire: 16 bits for O2's low-precision
parameters (half the bytes of FP32), FP32 for parameters kept in FP32 (so
their values stay exact).

The gather goes in rounds of at most ``chunk_bytes`` received per rank
(the strategy's bucket size), one at a time, so the receive buffer never
holds a second copy of the whole model. With one rank it is a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distamp.distributed.comm_hooks import CommStats
from distamp.optim.flat_layout import FlatLayout, Piece

__all__ = ["SliceAllGather"]

# all_gather_single is the non-deprecated name from torch 2.13 on.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class _Entry:
    """One piece in a rank's contribution to a gather: ``piece`` at ``position`` of the contribution."""

    piece: Piece
    position: int


class SliceAllGather:
    """Copies every rank's slice of the flat space into destination tensors on every rank.

    Example::

        gather = SliceAllGather(layout, rank, group, chunk_bytes=25 * 2**20)
        # my_sources: this rank's pieces (FP32 masters); dest(i): parameter i flattened
        gather.run(my_sources, lambda i: params[i].data.view(-1))

    Args:
        layout: the flat space and its slices.
        rank: this process's rank in ``group``.
        group: the data-parallel group (``None`` only with one rank).
        chunk_bytes: at most this many bytes are received per round.
    """

    def __init__(self, layout: FlatLayout, rank: int, group: dist.ProcessGroup | None, chunk_bytes: int) -> None:
        self.layout = layout
        self.rank = rank
        self.group = group
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.stats = CommStats()
        self._plans: dict[tuple, list[list[_Entry]]] = {}

    def run(
        self,
        sources: Sequence[torch.Tensor],
        dest: Callable[[int], torch.Tensor],
        params: Sequence[int] | None = None,
    ) -> None:
        """Write every rank's values of parameters ``params`` (default: all) into ``dest(i)``.

        ``sources`` are this rank's values, one tensor per piece of its slice
        (``layout.pieces(lo, hi)``, any float dtype). ``dest(i)`` is parameter
        ``i`` flattened (a contiguous 1-D view); its dtype is the wire dtype.
        Collective: every rank calls it with the same ``params`` and dtypes.
        """
        wanted = range(len(self.layout.numels)) if params is None else params
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in wanted:
            by_dtype.setdefault(dest(i).dtype, []).append(i)
        pieces = self.layout.pieces(*self.layout.range_of(self.rank))
        mine = {piece.offset: source.detach() for piece, source in zip(pieces, sources, strict=True)}
        if self.layout.world_size == 1:  # nothing to gather: copy (and round) in place, no buffers
            members = set(wanted)
            pairs = [(dest(p.param)[p.start : p.stop], mine[p.offset]) for p in pieces if p.param in members]
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])
            return
        with torch.no_grad():
            for dtype in sorted(by_dtype, key=str):  # the same order on every rank
                self._gather_class(mine, dest, set(by_dtype[dtype]), dtype)

    def _plan(self, members: set[int]) -> list[list[_Entry]]:
        """Per rank: the pieces of ``members`` in its slice, and where they sit in its contribution."""
        key = tuple(sorted(members))
        plan = self._plans.get(key)
        if plan is None:
            plan = []
            for rank in range(self.layout.world_size):
                entries, position = [], 0
                for piece in self.layout.pieces(*self.layout.range_of(rank)):
                    if piece.param in members:
                        entries.append(_Entry(piece, position))
                        position += piece.length
                plan.append(entries)
            self._plans[key] = plan
        return plan

    def _gather_class(
        self, mine: dict[int, torch.Tensor], dest: Callable[[int], torch.Tensor], members: set[int], dtype: torch.dtype
    ) -> None:
        plan = self._plan(members)
        sizes = [sum(e.piece.length for e in entries) for entries in plan]
        longest = max(sizes)
        if longest == 0:
            return
        world = self.layout.world_size
        element = torch.empty((), dtype=dtype).element_size()
        chunk = max(1, min(longest, self.chunk_bytes // (world * element)))
        device = dest(next(iter(members))).device
        for start in range(0, longest, chunk):  # one round at a time: one receive buffer at a time
            self._unpack(plan, dest, *self._launch(plan[self.rank], mine, start, chunk, dtype, device), chunk)

    def _launch(
        self, entries: list[_Entry], mine: dict[int, torch.Tensor], start: int, chunk: int,
        dtype: torch.dtype, device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None, int]:
        """Pack this rank's window ``[start, start + chunk)`` and start the gather of that round."""
        send = torch.zeros(chunk, dtype=dtype, device=device)
        for entry, first, last in _overlap(entries, start, start + chunk):
            source = mine[entry.piece.offset]
            send[entry.position + first - start : entry.position + last - start].copy_(source[first:last])
        out = torch.empty(chunk * self.layout.world_size, dtype=dtype, device=device)
        self.stats.calls += 1
        self.stats.bytes += send.numel() * send.element_size()
        if self.group is None:  # one rank
            out.copy_(send)
            return out, send, None, start
        work = _all_gather(out, send, group=self.group, async_op=True)
        return out, send, work, start

    def _unpack(
        self, plan: list[list[_Entry]], dest: Callable[[int], torch.Tensor],
        out: torch.Tensor, send: torch.Tensor, work: dist.Work | None, start: int, chunk: int,
    ) -> None:
        """Wait for one round and copy each rank's window into the destinations."""
        if work is not None:
            work.wait()
        targets, values = [], []
        for rank, entries in enumerate(plan):
            base = rank * chunk - start
            for entry, first, last in _overlap(entries, start, start + chunk):
                piece = entry.piece
                targets.append(dest(piece.param)[piece.start + first : piece.start + last])
                values.append(out[base + entry.position + first : base + entry.position + last])
        if targets:
            torch._foreach_copy_(targets, values)
        # Free the round's buffers now, on this thread: the communication thread may hold them a
        # moment longer, and would then free them where torch.profiler's memory events do not look.
        for tensor in (out, send):
            tensor.untyped_storage().resize_(0)


def _overlap(entries: list[_Entry], start: int, stop: int):
    """``(entry, first, last)``: the part ``[first, last)`` (relative to each piece) inside the window."""
    for entry in entries:
        lo = max(start, entry.position)
        hi = min(stop, entry.position + entry.piece.length)
        if hi > lo:
            yield entry, lo - entry.position, hi - entry.position
