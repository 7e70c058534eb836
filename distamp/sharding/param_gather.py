"""All-gather of the slices each rank updated, into every rank's parameters.

After a sharded step each rank holds the new values of its slice of the
flat parameter space only (see :mod:`distamp.core.flat_layout`). This
module puts every slice into every rank's copy of the parameters, in each
parameter's own dtype on the wire: 16 bits for O2's low-precision
parameters (half the bytes of FP32), FP32 for parameters kept in FP32 (so
their values stay exact).

On gloo the slices go as pairwise messages straight from each rank's
parameters into the others' (:mod:`distamp.sharding.direct_gather`): no
receive buffers, no copies. Elsewhere (NCCL) the gather goes in collective
rounds, and at most ``chunk_bytes`` (the strategy's bucket size) are
received per rank at a time, so the receive buffers never hold a second
copy of the whole model; a round receives ``chunk_bytes``, one at a time
(collective rounds forced on gloo send at most
:data:`~distamp.sharding.wire_rounds.GLOO_ROUND_BYTES` to each peer, as
many in flight as fit in ``chunk_bytes``). With one rank it is a copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distamp.core.flat_layout import FlatLayout, Piece
from distamp.distributed.comm_hooks import CommStats
from distamp.sharding.direct_gather import DirectGather, write_own_slice
from distamp.sharding.pairwise import on_gloo
from distamp.sharding.wire_rounds import round_bytes
from distamp.torch_compat import DisableTorchFunction, foreach_copy_

__all__ = ["GATHER_BYTES", "GatherInFlight", "SliceAllGather"]

GATHER_BYTES = 2 << 20
"""Smallest budget (``chunk_bytes``) of the sharded optimizer's gather: received bytes in flight at once.

The optimizer asks for two of the reduce-scatter's buckets
(:func:`~distamp.sharding.reduce_scatter.reduce_bucket_bytes`), at least
this: ``fuse_grad_size_in_MB`` alone (25 MB) would hold a receive buffer of
the whole 16-bit model at step time on a model of a few million
parameters, most of what sharding saves.
"""

# all_gather_single is the non-deprecated name from torch 2.13 on.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class _Entry:
    """One piece in a rank's contribution to a gather: ``piece`` at ``position`` of the contribution."""

    piece: Piece
    position: int


@dataclass(frozen=True)
class _Round:
    """One all-gather: the window ``[start, start + chunk)`` of every rank's contribution to one dtype class."""

    plan: list[list[_Entry]]
    dtype: torch.dtype
    start: int
    chunk: int
    received_bytes: int


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
        chunk_bytes: at most this many bytes are received at a time (collective rounds).
        pairwise: send the slices as pairwise messages straight into the
            destinations (:class:`~distamp.sharding.direct_gather.DirectGather`)
            instead of collective rounds; ``None``: on gloo. Only CPU
            destinations go pairwise (gloo sends CPU tensors only).
    """

    def __init__(self, layout: FlatLayout, rank: int, group: dist.ProcessGroup | None, chunk_bytes: int,
                 pairwise: bool | None = None) -> None:
        self.layout = layout
        self.pairwise = layout.world_size > 1 and (on_gloo(group) if pairwise is None else pairwise)
        self.rank = rank
        self.group = group
        self.chunk_bytes = max(1, int(chunk_bytes))
        self.round_bytes = round_bytes(group) if layout.world_size > 1 else None
        self.stats = CommStats()
        self._plans: dict[tuple, list[list[_Entry]]] = {}
        self._schedules: dict[tuple, tuple[list[_Round], dict[int, int]]] = {}

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
        self.start(sources, dest, params).finish()

    def start(
        self,
        sources: Sequence[torch.Tensor],
        dest: Callable[[int], torch.Tensor],
        params: Sequence[int] | None = None,
    ) -> GatherInFlight | DirectGather:
        """Launch :meth:`run`'s gather and return it unfinished: the caller finishes it, all at once or by parameter.

        Until it is finished, ``sources`` must not change and a destination
        holds its old values wherever a later round writes (collective
        rounds), or old and new values in any mix (pairwise).
        """
        wanted = range(len(self.layout.numels)) if params is None else params
        pieces = self.layout.pieces(*self.layout.range_of(self.rank))
        mine = {piece.offset: source.detach() for piece, source in zip(pieces, sources, strict=True)}
        if self.layout.world_size == 1:  # nothing to gather: copy (and round) in place, no buffers
            with torch.no_grad():
                write_own_slice(pieces, mine, dest, set(wanted))
            return GatherInFlight(self, [], {}, mine, dest)
        targets = [dest(i) for i in wanted]
        if self.pairwise and all(t.device.type == "cpu" for t in targets):  # gloo sends CPU tensors only
            return DirectGather(self.layout, self.rank, self.group, mine, dest, wanted, self.stats)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, target in zip(wanted, targets, strict=True):
            by_dtype.setdefault(target.dtype, []).append(i)
        key = tuple((dtype, tuple(sorted(by_dtype[dtype]))) for dtype in sorted(by_dtype, key=str))
        rounds, last_round = self._schedules.get(key) or self._schedule(key)
        return GatherInFlight(self, rounds, last_round, mine, dest)

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

    def _schedule(self, key: tuple) -> tuple[list[_Round], dict[int, int]]:
        """The rounds of a gather, dtype class by dtype class (the same on every rank), and per parameter the last
        round that writes it."""
        rounds: list[_Round] = []
        last_round: dict[int, int] = {}
        world = self.layout.world_size
        for dtype, members in key:  # classes in the same order on every rank
            plan = self._plan(set(members))
            longest = max(sum(e.piece.length for e in entries) for entries in plan)
            if longest == 0:  # only empty parameters: nothing to send
                continue
            element = torch.empty((), dtype=dtype).element_size()
            chunk = max(1, min(longest, self.chunk_bytes // (world * element)))
            if self.round_bytes is not None:
                chunk = min(chunk, max(1, self.round_bytes // element))
            chunk = -(-longest // -(-longest // chunk))  # the same rounds, evened out: the last is least padded
            for start in range(0, longest, chunk):
                for entries in plan:
                    for entry, _, _ in _overlap(entries, start, start + chunk):
                        last_round[entry.piece.param] = len(rounds)
                rounds.append(_Round(plan, dtype, start, chunk, world * chunk * element))
        self._schedules[key] = (rounds, last_round)
        return rounds, last_round

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
            foreach_copy_(targets, values)
        # Free the round's buffers now, on this thread: the communication thread may hold them a
        # moment longer, and would then free them where torch.profiler's memory events do not look.
        for tensor in (out, send):
            tensor.untyped_storage().resize_(0)


class GatherInFlight:
    """A gather started by :meth:`SliceAllGather.start`; its rounds are unpacked in order, when asked for.

    Rounds are launched while their receive buffers fit in the gather's
    ``chunk_bytes`` (always at least one); unpacking a round lets the next
    ones launch. Which rounds launch when depends only on the calls made,
    never on timing, so every rank issues the same collectives in the same
    order as long as every rank makes the same calls.
    """

    def __init__(self, gather: SliceAllGather, rounds: list[_Round], last_round: dict[int, int],
                 mine: dict[int, torch.Tensor], dest: Callable[[int], torch.Tensor]) -> None:
        self._gather, self._rounds, self._last_round = gather, rounds, last_round
        self._mine, self._dest = mine, dest
        self._launched: deque[tuple[_Round, tuple[torch.Tensor, torch.Tensor, dist.Work | None, int]]] = deque()
        self._next = 0  # the next round to launch
        self._finished = 0  # rounds unpacked
        self._launch_more()

    @property
    def done(self) -> bool:
        """Whether every round has been unpacked into the destinations."""
        return self._finished == len(self._rounds)

    def finish(self) -> None:
        """Unpack every round (waiting for those still on the wire)."""
        self._finish_through(len(self._rounds) - 1)

    def finish_params(self, params: Iterable[int]) -> None:
        """Unpack the rounds up to the last one that writes any of ``params`` (indices in the layout)."""
        self._finish_through(max((self._last_round.get(i, -1) for i in params), default=-1))

    def _finish_through(self, index: int) -> None:
        # No torch function mode sees the copies: a mode watching the parameters (param_gather_hooks) would
        # otherwise be asked about them while they are being written.
        with torch.no_grad(), DisableTorchFunction():
            while self._finished <= index:
                rnd, launched = self._launched.popleft()
                self._gather._unpack(rnd.plan, self._dest, *launched, rnd.chunk)
                self._finished += 1
                self._launch_more()

    def _launch_more(self) -> None:
        budget = self._gather.chunk_bytes - sum(r.received_bytes for r, _ in self._launched)
        while self._next < len(self._rounds) and (
                not self._launched or self._rounds[self._next].received_bytes <= budget):
            rnd = self._rounds[self._next]
            device = self._dest(_first(rnd.plan)).device
            with torch.no_grad(), DisableTorchFunction():
                launched = self._gather._launch(rnd.plan[self._gather.rank], self._mine, rnd.start, rnd.chunk,
                                                rnd.dtype, device)
            self._launched.append((rnd, launched))
            budget -= rnd.received_bytes
            self._next += 1


def _first(plan: list[list[_Entry]]) -> int:
    """Some parameter of a plan (every plan has one: a class is made of its parameters)."""
    return next(e.piece.param for entries in plan for e in entries)


def _overlap(entries: list[_Entry], start: int, stop: int):
    """``(entry, first, last)``: the part ``[first, last)`` (relative to each piece) inside the window."""
    for entry in entries:
        lo = max(start, entry.position)
        hi = min(stop, entry.position + entry.piece.length)
        if hi > lo:
            yield entry, lo - entry.position, hi - entry.position
