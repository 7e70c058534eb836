"""Which stage-3 units ran since the last step, so that ranks whose forwards took different paths stop there.

FSDP2 pairs the ranks' collectives by their order alone: each unit's forward
all-gathers its parameters and its backward reduce-scatters its gradients,
and one rank's k-th all-gather meets the others' k-th. When control flow that
differs between ranks (a per-rank LayerDrop, an early exit, routing) runs
another unit on one rank, a unit is gathered from one rank's shards of one
unit and another rank's shards of another. With units of different sizes gloo
aborts ("Received data size doesn't match") and NCCL waits for the group's
timeout; with units of one size, as a transformer's blocks are, nothing
fails: the forward computes with mixed-up parameters and the gradients of
different units are summed together. Measured on 2 gloo ranks, four equal
blocks, rank 0 skipping block 1 and rank 1 block 2 in one step: the step
applied and both ranks ended with the same, wrong, weights.

:class:`UnitTrace` counts every unit forward (a forward pre-hook per unit:
Python integer arithmetic in eager mode, in-place integer tensor ops that
``torch.compile`` traces without a graph break in compiled code) into an
order-sensitive digest, and :meth:`UnitTrace.agree`,
called by the stage-3 precision plugin before its verdict, compares the
digests of all ranks with one all-reduce of two integers. If they differ,
every rank raises the same error, naming the units each rank ran a different
number of times, before anything is applied.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distamp.distributed.flag_sync import all_reduce_max
from distamp.distributed.groups import group_size

__all__ = ["UnitTrace"]

# digest = (digest * _BASE + unit + 1) mod _MODULUS: the product stays within int64.
_MODULUS = 2**31 - 1
_BASE = 1_000_003
_SHOWN_UNITS = 6


class UnitTrace:
    """The sequence of unit forwards since the last :meth:`agree`, as a digest and per-unit counts.

    Args:
        units: ``(qualified name, module)`` of every unit (each a separate
            ``fully_shard`` call, the root excluded: it runs in every forward).
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in units]
        self._digest = 0
        self._counts = [0] * len(self.names)
        # Inside torch.compile the same record goes to tensors: Python integers that change every step would
        # be guarded on and recompile the graph each time.
        self._compiled_digest = torch.zeros((), dtype=torch.int64)
        self._compiled_counts = torch.zeros(len(self.names), dtype=torch.int64)
        for index, (_, module) in enumerate(units):
            module.register_forward_pre_hook(functools.partial(self._record, index))

    def _record(self, index: int, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            with torch.no_grad():
                self._compiled_digest.mul_(_BASE).add_(index + 1).remainder_(_MODULUS)
                self._compiled_counts[index] += 1
        else:
            self._digest = (self._digest * _BASE + index + 1) % _MODULUS
            self._counts[index] += 1

    def agree(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Check that every rank of ``group`` ran the same unit forwards in the same order; start afresh (collective).

        Raises:
            RuntimeError: on every rank, when the ranks differ, naming the
                units each rank ran a different number of times.
        """
        digest = (self._digest * _BASE + int(self._compiled_digest)) % _MODULUS
        counts = [a + b for a, b in zip(self._counts, self._compiled_counts.tolist(), strict=True)]
        self._digest, self._counts = 0, [0] * len(self.names)
        self._compiled_digest.zero_()
        self._compiled_counts.zero_()
        values = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        all_reduce_max(values, group)
        highest, lowest = values[0].item(), -values[1].item()
        if highest == lowest:
            return
        per_rank: list[list[int] | None] = [None] * group_size(group)
        dist.all_gather_object(per_rank, counts, group=group)
        raise RuntimeError(_diverged(self.names, [c or [] for c in per_rank]))


def _diverged(names: list[str], per_rank: list[list[int]]) -> str:
    differing = [i for i in range(len(names)) if len({counts[i] for counts in per_rank}) > 1]
    if differing:
        shown = "; ".join(
            f"{names[i]!r} ran " + ", ".join(f"{counts[i]}x on rank {r}" for r, counts in enumerate(per_rank))
            for i in differing[:_SHOWN_UNITS]
        )
        more = f"; and {len(differing) - _SHOWN_UNITS} more units" if len(differing) > _SHOWN_UNITS else ""
        what = f"different units (forwards per unit since the last step: {shown}{more})"
    else:
        what = "the same units in a different order"
    return (
        f"sharding stage 3: since the last step the ranks ran {what}. FSDP2 pairs the ranks' all-gathers and "
        "reduce-scatters by their order, so parameters and gradients of different units were mixed: this "
        "step's gradients are wrong, and it was not applied on any rank. Stage 3 needs every rank to run the "
        "same units in the same order (a per-rank LayerDrop, early exit or routing breaks that): run every "
        "unit on every rank (multiply an unused output by zero), or use sharding stage 2 with "
        "fleet.distributed_model(model, find_unused_parameters=True), which agrees on the used parameters"
    )
