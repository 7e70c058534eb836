"""The replica check: ranks that should hold the same bits compare hashes of them, and stop together when they differ.

Data parallelism promises that every rank ends each step with bitwise the
same parameters; nothing in torch notices when they stop doing so (a rank
whose CPU rounds differently, a kernel that is not deterministic, memory
corruption, code that edits parameters on one rank). With
``strategy.check_replicas_every = N`` the meta-optimizer calls
:func:`compare_replicas` on every N-th applied step, as Megatron-LM's
``--check-weight-hash-across-dp-replicas-interval`` does: every rank hashes
each tensor it holds (:func:`tensor_hash`), one ``all_gather`` of a small
int64 tensor brings every rank's hashes to every rank, and when any entry
differs every rank raises the same :class:`ReplicaDivergenceError`, naming
the first differing tensor, how the ranks split on it, and the step. Every
rank takes part in the collective on the same steps (the schedule depends
only on the agreed count of applied steps), so no rank is left waiting.

What is compared is what the ranks hold *as replicas*, before the step's
update, so it is what that step's forward and backward ran with:

* **unsharded** (stage 0, with or without PowerSGD): every parameter, and in
  O2 every FP32 master beside its 16-bit parameter;
* **stages 1 and 2**: every (full, all-gathered) parameter. Each FP32 master
  and its optimizer state live on one rank only, so there is no second copy
  to compare them with; every other rank holds their rounding, the 16-bit
  parameter, which is compared;
* **stage 3**: no rank holds a copy of another rank's FP32 shard, so a shard
  has no replica, and changing one is a change of the one model every rank
  gathers, not a divergence. What the ranks must hold identically is the
  unsharded parameter FSDP2 all-gathers for each forward: for the forward of a
  check step :class:`GatheredParameterHashes` hashes each unit's parameters in
  a forward pre-hook (after FSDP2's own, which gathers them), installed for
  that step only, and those are compared.
  That catches a rank that computes with other values than the rest (a
  faulty gather, an edit of the gathered copy), and costs no gather of its
  own.

With AMP the loss scaler's state (scale and counters) is compared too.
Buffers are not: BatchNorm's running statistics legitimately differ per rank
after a forward on each rank's own batch.

Cost: one pass over the compared tensors (two integer reductions per tensor
on its device) and one all-gather of ``3 x entries`` int64 values, on check
steps only; nothing on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distamp.distributed.groups import data_parallel_group, group_size
from distamp.distributed.timeouts import named_collective
from distamp.model_views import wrapper_prefix

__all__ = ["GatheredParameterHashes", "ReplicaDivergenceError", "compare_replicas", "tensor_hash"]

_COLUMNS = 251
"""Word positions are weighted by their index modulo this prime (see :func:`tensor_hash`)."""
_SHOWN_NAMES = 5  # further differing tensors named after the first
_weights_by_device: dict[torch.device, torch.Tensor] = {}


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold the same bits do not (raised on every rank alike)."""


def _weights(device: torch.device) -> torch.Tensor:
    weights = _weights_by_device.get(device)
    if weights is None:
        weights = _weights_by_device[device] = torch.arange(1, _COLUMNS + 1, dtype=torch.int64, device=device)
    return weights


def tensor_hash(tensor: torch.Tensor) -> torch.Tensor:
    """An exact, cheap checksum of ``tensor``'s bytes: an int64 tensor of two values on its device.

    The bytes are read as 64-bit words ``w_j`` (the last one padded with
    zeros) and summed with wrap-around twice: ``sum(w_j)`` and
    ``sum(((j mod 251) + 1) * w_j)``, both modulo 2**64. Addition modulo
    2**64 does not depend on order, so the result is the same on every CPU
    instruction set and device. It depends on the bits, not on values:
    ``-0.0`` and ``0.0`` differ, as do NaNs with different payloads.

    Any change of one word (one FP32 element, or up to four 16-bit ones in
    one word) changes the first sum, and so the hash; a swap of two words
    whose positions differ modulo 251 changes the second. It is a checksum,
    not a cryptographic digest: changes made to cancel out (or two flips
    of a word's top bit) can go unseen.

    Args:
        tensor: any tensor (a DTensor's local shard, not the DTensor).
    """
    raw = tensor.detach().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 8:  # a view at an odd offset of a flat buffer cannot be read as int64 in place
        raw = raw.clone()
    count = raw.numel() // 8
    words = raw[: count * 8].view(torch.int64)
    weights = _weights(raw.device)
    rows = count // _COLUMNS
    body = words[: rows * _COLUMNS].view(rows, _COLUMNS)
    # int64 matrix-vector products exist on CPU only; both forms are the same sum modulo 2**64.
    weighted = (body @ weights).sum() if raw.device.type == "cpu" else (body * weights).sum()
    rest = words[rows * _COLUMNS :]
    weighted = weighted + (rest * weights[: rest.numel()]).sum()
    total = words.sum()
    tail = raw[count * 8 :]
    if tail.numel():
        padded = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        padded[: tail.numel()] = tail
        last = padded.view(torch.int64)[0]
        total = total + last
        weighted = weighted + last * (count % _COLUMNS + 1)
    return torch.stack([total, weighted])


def compare_replicas(names: Sequence[str], hashes: Sequence[torch.Tensor | None], *, step: int, applied_step: int,
                     group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
    """Compare each rank's ``hashes`` over the group; raise the same error on every rank when any differs (collective).

    Every rank must pass the same names in the same order. A hash is what
    :func:`tensor_hash` returned; ``None`` marks a tensor this rank does not
    hold (which differs from a held one). A no-op in a one-process world.

    Args:
        names: what each hash is of, in the order to report them.
        hashes: one per name.
        step: the step being checked (applied and skipped ones counted), for the message.
        applied_step: its number among the applied steps, for the message.
        group: the data-parallel group (``None``: the default one).
        device: where the hashes are gathered (NCCL: this rank's GPU); default: the first hash's device.

    Raises:
        ReplicaDivergenceError: some entry differs between ranks.
    """
    group = data_parallel_group(group)
    world = group_size(group)
    if world == 1:
        return
    if device is None:
        device = next((h.device for h in hashes if h is not None), torch.device("cpu"))
    mine = torch.zeros(len(hashes), 3, dtype=torch.int64, device=device)  # [held, sum, weighted sum] per entry
    for i, value in enumerate(hashes):
        if value is not None:
            mine[i, 0] = 1
            mine[i, 1:] = value.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    with named_collective(f"the replica check of step {step}"):
        dist.all_gather(gathered, mine, group=group)
    per_rank = [rows.tolist() for rows in gathered]
    differing = [i for i in range(len(names)) if any(rows[i] != per_rank[0][i] for rows in per_rank[1:])]
    if differing:
        raise ReplicaDivergenceError(_message(names, per_rank, differing, step, applied_step))


def _message(names: Sequence[str], per_rank: list[list[list[int]]],
             differing: list[int], step: int, applied_step: int) -> str:
    first = differing[0]
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, rows in enumerate(per_rank):
        groups.setdefault(tuple(rows[first]), []).append(rank)
    held = [ranks for key, ranks in groups.items() if key[0]]
    missing = [r for key, ranks in groups.items() if not key[0] for r in ranks]
    if len(held) == 2 and len(held[0]) == len(held[1]) == 1 and not missing:
        split = f"ranks {held[0][0]} and {held[1][0]} hold different values"
    else:
        split = "ranks grouped by the value they hold: " + " | ".join(str(ranks) for ranks in held)
        if missing:
            split += f"; rank(s) {missing} did not hold it"
    others = [names[i] for i in differing[1:]]
    more = ""
    if others:
        shown = ", ".join(repr(name) for name in others[:_SHOWN_NAMES])
        rest = len(others) - _SHOWN_NAMES
        more = f" {len(others)} more differ: {shown}{f' and {rest} more' if rest > 0 else ''}."
    return (
        f"replica check (strategy.check_replicas_every) at step {step} (applied step {applied_step}): the "
        f"data-parallel ranks no longer hold the same {names[first]!r}: {split}.{more} Every rank stops "
        "here: data-parallel ranks must stay bitwise equal, and these would train different models from now on. "
        "Look for a rank that computes differently (another CPU instruction set or build, a nondeterministic "
        "kernel), code that changes parameters on one rank only, or failing memory; resume from the last "
        "checkpoint once the cause is fixed."
    )


class GatheredParameterHashes:
    """Stage 3: hashes of the unsharded parameters FSDP2 gathered for a forward, taken on check steps.

    While armed (:meth:`arm`, for the forward of a check step), a forward
    pre-hook on every ``FSDPModule`` of ``model`` runs after FSDP2's own
    pre-hook has all-gathered the unit's parameters and hashes each of the
    unit's parameters that is no longer a DTensor (the gathered one), once
    per step (the first forward of a gradient-merge window, not
    recomputations). Disarmed, no hook is installed, so other steps cost
    nothing, compiled or not; the hooks run eagerly (``torch.compile``
    breaks its graph there on check steps only).

    Args:
        model: the sharded model (its qualified names, inside any
            ``torch.compile`` wrapper, are the ones reported).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.hashes: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def armed(self) -> bool:
        """Whether the hooks are installed."""
        return bool(self._handles)

    def arm(self, on: bool) -> None:
        """Install the hooks (``on``) or remove them; a no-op when they already are as asked."""
        if on and not self._handles:
            # Registered after fully_shard's own pre-hook, so each runs once the unit's parameters are gathered.
            # Named as in the model inside torch.compile's wrapper (the optimizer's names for the parameters).
            wrappers = wrapper_prefix(self.model)
            self._handles = [
                module.register_forward_pre_hook(self._recorder(f"{prefix}." if prefix else "", wrappers))
                for prefix, module in self.model.named_modules()
                if isinstance(module, nn.Module) and isinstance(module, FSDPModule)
            ]
        elif not on:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def _recorder(self, prefix: str, wrappers: str) -> Callable[[nn.Module, object], None]:
        # Eager even inside torch.compile: the hash reads raw bytes (views as other dtypes, storage offsets).
        @torch.compiler.disable
        def record(module: nn.Module, args: object) -> None:
            with torch.no_grad():
                for name, param in module.named_parameters():
                    qualified = (prefix + name).removeprefix(wrappers)
                    if qualified not in self.hashes and not isinstance(param, DTensor):
                        self.hashes[qualified] = tensor_hash(param)

        return record

    def hashes_of(self, names: Sequence[str]) -> list[torch.Tensor | None]:
        """The recorded hash of each of ``names`` (``None``: not gathered since the last :meth:`clear`)."""
        return [self.hashes.get(name) for name in names]

    def clear(self) -> None:
        """Forget this step's hashes (the next check step records anew)."""
        self.hashes.clear()
