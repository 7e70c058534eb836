"""Stage-3 checkpoints of the per-rank format that came before DCP: each rank's part held its rows of every
sharded model entry.

Those checkpoints (``rank-<R>`` parts with ``"model_shard"``, the common
part's ``"model_shards"`` index: global shape and every rank's dim-0 rows)
are still read; stage 3 now saves through
:mod:`~distamp.checkpoint.dcp_tensors`. :func:`rows_needed` says which rows
of each indexed entry the loading model holds (its own rows for a stage-3
model, all of them for an unsharded one), :func:`parts_needed` which saved
parts hold them, and :func:`assemble` cuts them out of those parts: a whole
tensor for a plain entry, a DTensor of this rank's rows for a stage-3 one,
at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.core.shard_rows import like_local_rows, local_rows

__all__ = ["assemble", "parts_needed", "rows_needed"]


def rows_needed(index: Mapping[str, dict], state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Per indexed entry, the rows the loading model (whose ``state_dict()`` is ``state``) holds: its local rows
    for a DTensor, all for a plain tensor.

    Raises:
        ValueError: the model lacks an entry of the checkpoint, or its shape differs.
    """
    missing = [name for name in index if name not in state]
    if missing:
        raise ValueError(f"the checkpoint's model has entries {missing[:5]} that this model lacks; build the model "
                         "as the saving run did")
    rows = {}
    for name, meta in index.items():
        value = state[name]
        if list(value.shape) != list(meta["shape"]):
            raise ValueError(f"the checkpoint's model entry {name!r} has shape {list(meta['shape'])}, this model's "
                             f"{list(value.shape)}; build the model as the saving run did")
        rows[name] = local_rows(value) if isinstance(value, DTensor) else (0, int(meta["shape"][0]))
    return rows


def parts_needed(index: Mapping[str, dict] | None, module: nn.Module) -> list[int]:
    """The saving ranks whose parts hold rows the loading model needs (none for an unsharded checkpoint)."""
    if not index:
        return []
    needed: set[int] = set()
    for name, (start, stop) in rows_needed(index, module.state_dict()).items():
        needed.update(r for r, (lo, hi) in enumerate(index[name]["rows"]) if lo < stop and start < hi)
    return sorted(needed)


def assemble(index: Mapping[str, dict], parts: Mapping[int, Mapping[str, torch.Tensor]],
             module: nn.Module) -> dict[str, torch.Tensor]:
    """The indexed entries as the loading model's ``load_state_dict`` takes them, from the saved ``parts``.

    ``parts`` maps saving ranks to their model shards (at least
    :func:`parts_needed`'s).

    Raises:
        ValueError: the parts do not cover the rows needed (or see :func:`rows_needed`).
    """
    state = module.state_dict()
    out = {}
    for name, (start, stop) in rows_needed(index, state).items():
        meta, target = index[name], state[name]
        chunks, cursor = [], start
        for rank, (lo, hi) in enumerate(meta["rows"]):
            if cursor >= stop:
                break
            if lo <= cursor < hi and name in parts.get(rank, {}):
                last = min(stop, hi)
                chunks.append(parts[rank][name][cursor - lo : last - lo])
                cursor = last
        if cursor < stop:
            raise ValueError(f"the checkpoint's parts do not hold rows [{cursor}, {stop}) of model entry {name!r}")
        local = torch.cat(chunks) if chunks else torch.zeros((0, *meta["shape"][1:]), dtype=target.dtype)
        out[name] = like_local_rows(local, target) if isinstance(target, DTensor) else local.to(target.device)
    return out
