"""The parameter all-gather on gloo: every rank's slice sent straight from its parameters into the others'.

Each rank first writes its own updated slice into its own parameters (the
rounding to the parameters' dtype happens there, once), then sends those
parameter elements to every peer and receives each peer's slice straight
into the same places of its own parameters: pairwise ``isend``/``irecv``,
no staging buffer, no packing or unpacking copy. The messages are cut at
:data:`~distamp.sharding.wire_rounds.GLOO_ROUND_BYTES` (gloo sends a
message as one write, which is slow on a shaped link) and are all posted at
once, since they need no memory of their own.

Why pairwise on gloo: :mod:`distamp.sharding.pairwise`. Per step of the
6.56M-parameter benchmark MLP (2 ranks on 2 cores, loopback) the collective
rounds, held to 2 MiB of receive buffers, took 10-21 ms with their packing
and unpacking; these messages take 4-10 ms. NCCL gathers in place on its
own streams and keeps the collective rounds of
:class:`~distamp.sharding.param_gather.SliceAllGather`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from distamp.core.flat_layout import FlatLayout, Piece
from distamp.distributed.comm_hooks import CommStats
from distamp.sharding import wire_rounds
from distamp.sharding.pairwise import peers, receive, send
from distamp.torch_compat import DisableTorchFunction, foreach_copy_

__all__ = ["TAG_GATHER", "DirectGather", "write_own_slice"]

TAG_GATHER = 0x5A2
"""Tag of the gather's messages (apart from any a user sends on the same group)."""


class DirectGather:
    """One gather in flight: this rank's slice written and sent, the peers' slices being received in place.

    Built by :meth:`~distamp.sharding.param_gather.SliceAllGather.start`
    on gloo; finished all at once or by parameter, as
    :class:`~distamp.sharding.param_gather.GatherInFlight` is. Until
    finished, a parameter that receives holds its old values, its new ones
    or a mix, and this rank's own slice of the parameters must not change.

    Args:
        layout: the flat space and its slices.
        rank: this process's rank in ``group``.
        group: the data-parallel group.
        mine: this rank's values, by the flat offset of each of its pieces.
        dest: parameter ``i`` flattened (a contiguous 1-D view in the wire dtype).
        wanted: the parameters to gather (every rank passes the same).
        stats: where this rank's messages are counted (each once, whatever the number of peers).
    """

    def __init__(self, layout: FlatLayout, rank: int, group: dist.ProcessGroup | None,
                 mine: dict[int, torch.Tensor], dest: Callable[[int], torch.Tensor], wanted: Iterable[int],
                 stats: CommStats) -> None:
        self._receives: dict[int, list[dist.Work]] = {}
        self._sends: list[dist.Work] = []
        # No torch function mode sees the copies and views (param_gather_hooks watches the parameters).
        with torch.no_grad(), DisableTorchFunction():
            self._post(layout, rank, group, mine, dest, set(wanted), stats)

    def _post(self, layout: FlatLayout, rank: int, group: dist.ProcessGroup | None,
              mine: dict[int, torch.Tensor], dest: Callable[[int], torch.Tensor], members: set[int],
              stats: CommStats) -> None:
        """Write this rank's slice into its parameters, then post every receive and send."""
        slices = [[p for p in layout.pieces(*layout.range_of(r)) if p.param in members]
                  for r in range(layout.world_size)]
        write_own_slice(slices[rank], mine, dest, members)
        outgoing = _messages(slices[rank], dest)
        incoming = {peer: _messages(slices[peer], dest) for peer in peers(rank, layout.world_size)}
        for k in range(max([len(outgoing), *map(len, incoming.values())])):
            for peer, messages in incoming.items():
                if k < len(messages):
                    param, view = messages[k]
                    self._receives.setdefault(param, []).append(receive(view, group, peer, TAG_GATHER))
                if k < len(outgoing):
                    self._sends.append(send(outgoing[k][1], group, peer, TAG_GATHER))
        # Counted as contributed (each message once), as the collective rounds count.
        stats.calls += len(outgoing)
        stats.bytes += sum(view.numel() * view.element_size() for _, view in outgoing)

    @property
    def done(self) -> bool:
        """Whether every receive and send has been waited on."""
        return not self._receives and not self._sends

    def finish(self) -> None:
        """Wait for every message (raises the backend's error, or its timeout)."""
        self.finish_params(list(self._receives))

    def finish_params(self, params: Iterable[int]) -> None:
        """Wait until parameters ``params`` (indices in the layout) hold every rank's values."""
        for param in params:
            for work in self._receives.pop(param, ()):
                work.wait()
        if not self._receives:
            sends, self._sends = self._sends, []
            for work in sends:
                work.wait()


def write_own_slice(pieces: Sequence[Piece], mine: dict[int, torch.Tensor], dest: Callable[[int], torch.Tensor],
                    members: set[int]) -> None:
    """Copy (and round) this rank's values of ``pieces`` of parameters ``members`` into their destinations.

    ``mine`` holds the values by the flat offset of each piece; a value
    that already is its destination (O1's slices are views of the model)
    is not copied onto itself.
    """
    pairs = [(dest(p.param)[p.start : p.stop], mine[p.offset]) for p in pieces if p.param in members]
    pairs = [(target, value) for target, value in pairs if target.data_ptr() != value.data_ptr()]
    if pairs:
        foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


def _messages(pieces: Sequence[Piece], dest: Callable[[int], torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(parameter, destination view)`` of each message of a slice: its pieces cut at GLOO_ROUND_BYTES."""
    out = []
    for piece in pieces:
        flat = dest(piece.param)
        step = max(1, wire_rounds.GLOO_ROUND_BYTES // flat.element_size())
        for lo in range(piece.start, piece.stop, step):
            out.append((piece.param, flat[lo : min(lo + step, piece.stop)]))
    return out
