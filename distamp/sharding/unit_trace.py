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

The same all-reduce carries a second check: that FSDP2 finished each unit's
backward, which leaves its parameters sharded (DTensors) again. It does not
when a unit runs more than once in one forward and a run is inside a
reentrant activation checkpoint (``torch.utils.checkpoint(...,
use_reentrant=True)``, torch's default when ``use_reentrant`` is not given):
the unit's parameters stay unsharded and only part of its gradient reaches
its shards. Measured on 2 gloo ranks, one block run three times, each run
checkpointed: the step applied an update of that block 76% off the right
one, the same on both ranks, with no error (torch's own ``fully_shard``
leaves the same unsharded parameters). Such a unit is named, with the fixes,
on every rank before anything is applied; in one process too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.distributed.flag_sync import all_reduce_max
from distamp.distributed.groups import group_size

__all__ = ["UnitTrace"]

# digest = (digest * _BASE + unit + 1) mod _MODULUS: the product stays within int64.
_MODULUS = 2**31 - 1
_BASE = 1_000_003
_SHOWN_UNITS = 6


class UnitTrace:
    """The sequence of unit forwards since the last :meth:`agree`, as a digest and per-unit counts, and
    whether FSDP2 finished each unit's backward.

    Args:
        units: ``(qualified name, module)`` of every unit (each a separate
            ``fully_shard`` call, the root excluded: it runs in every forward).
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in units]
        self._modules = [module for _, module in units]
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

    def unfinished(self) -> list[str]:
        """The units whose parameters are not all sharded (DTensors): FSDP2 did not finish their backward."""
        return [name for name, module in zip(self.names, self._modules, strict=True)
                if not all(isinstance(p, DTensor) for p in module.parameters())]

    def agree(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        """Check that every rank of ``group`` ran the same unit forwards in the same order and that FSDP2
        finished every unit's backward; start afresh (collective; ``group=None``: one process, no collective).

        Raises:
            RuntimeError: on every rank, when the ranks differ, naming the
                units each rank ran a different number of times; or when a
                unit's backward was not finished on some rank, naming it.
        """
        digest = (self._digest * _BASE + int(self._compiled_digest)) % _MODULUS
        counts = [a + b for a, b in zip(self._counts, self._compiled_counts.tolist(), strict=True)]
        self._digest, self._counts = 0, [0] * len(self.names)
        self._compiled_digest.zero_()
        self._compiled_counts.zero_()
        unfinished = self.unfinished()
        values = torch.tensor([digest, -digest, int(bool(unfinished))], dtype=torch.int64, device=device)
        all_reduce_max(values, group)
        highest, lowest, any_unfinished = values[0].item(), -values[1].item(), values[2].item()
        if highest == lowest and not any_unfinished:
            return
        per_rank: list = [(counts, unfinished)]
        if group is not None and group_size(group) > 1:
            per_rank = [None] * group_size(group)
            dist.all_gather_object(per_rank, (counts, unfinished), group=group)
        if highest != lowest:
            raise RuntimeError(_diverged(self.names, [entry[0] if entry else [] for entry in per_rank]))
        names = sorted({name for entry in per_rank if entry for name in entry[1]})
        raise RuntimeError(_unfinished_backward(names))


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


def _unfinished_backward(names: list[str]) -> str:
    return (
        f"sharding stage 3: FSDP2 did not finish the backward of {names}: their parameters are still unsharded "
        "after it, and only part of their gradients reached their shards, so this step was not applied on any "
        "rank. This happens when a unit runs more than once in one forward and one of its runs is inside a "
        "reentrant activation checkpoint (torch.utils.checkpoint(..., use_reentrant=True), which is also "
        "torch's choice when use_reentrant is not given, and checkpoint_sequential's). Checkpoint with "
        "use_reentrant=False, or leave the module that runs several times out of sharding_configs['units'] "
        "(name the units it is not part of), so that it stays in the root"
    )
