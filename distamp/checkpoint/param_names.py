"""Optimizer state follows parameter names: a checkpoint resumes a model that defines its parameters in another order.

torch's optimizer state, distamp's FP32 masters and the flat layouts of
sharded state all number the parameters by position (flat order over the
param groups). A checkpoint therefore records, next to that state, the
qualified name (in the model inside its wrappers,
``named_parameters(remove_duplicate=True)``) and shape of each parameter in
that order, with the group each belongs to (:func:`record`). At load,
:func:`order` compares it with the loading model and optimizer:

* the same names in the same order, or a checkpoint without names (saved
  before they were recorded, or over tensors the model does not have):
  the state loads by position, as it always did;
* the same names in another order, each param group keeping its members
  and each name its shape: the state is renumbered by name
  (:func:`reorder_common` for the common part, :func:`reorder_part` for a
  rank's slice), as ``torch.distributed.checkpoint`` keys optimizer state
  by name;
* anything else: ``ValueError`` naming the first parameters that differ,
  before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from distamp.core.flat_layout import FlatLayout
from distamp.model_views import unwrap_model
from distamp.optim.optimizer import AmpOptimizer
from distamp.suggest import listed

from . import flat_state

__all__ = ["KEY", "order", "record", "reorder_common", "reorder_part"]

KEY = "optimizer_parameter_names"
"""The common payload's entry holding :func:`record`'s value (absent from checkpoints saved before it)."""

_FIX = ("build the model and optimizer the way the saving run did (the same parameter names, shapes and param "
        "groups)")


def record(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """``{"names": [...], "shapes": [[...], ...], "groups": [[index, ...], ...]}`` of ``optimizer``'s parameters
    in the order its state numbers them; None when one of them is not a parameter of ``model``.

    ``groups`` holds, per param group, its parameters' indices into ``names``.
    A distamp ``AmpOptimizer`` numbers its model's parameters (not the FP32
    masters its inner optimizer steps); any other optimizer its own.
    """
    target = flat_state.describe(optimizer)
    if isinstance(optimizer, AmpOptimizer) and target is not None:
        params = list(optimizer.master_weights.model_params)
        groups = [list(g) for g in target.groups]
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        sizes = [len(group["params"]) for group in optimizer.param_groups]
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        groups = [list(range(start, start + size)) for start, size in zip(starts, sizes, strict=True)]
    name_of = {id(p): name for name, p in unwrap_model(model).named_parameters(remove_duplicate=True)}
    if any(id(p) not in name_of for p in params):
        return None
    return {"names": [name_of[id(p)] for p in params], "shapes": [list(p.shape) for p in params], "groups": groups}


def order(saved: dict | None, current: dict | None) -> list[int] | None:
    """For each of the loading optimizer's parameters, the index of the saved one of its name; None when the
    state loads by position (the same names in the same order, or names missing on either side).

    Raises:
        ValueError: a name on one side only, a param group whose members
            changed, or a name whose shape changed, naming the first such
            parameter(s) on both sides.
    """
    if saved is None or current is None or list(saved["names"]) == list(current["names"]):
        return None
    old, new = list(saved["names"]), list(current["names"])
    old_set, new_set = set(old), set(new)
    missing = [n for n in old if n not in new_set]
    extra = [n for n in new if n not in old_set]
    if missing or extra:
        raise ValueError(
            "the checkpoint's optimizer state is for other parameters than this optimizer's: "
            f"{_which(missing, 'the checkpoint has', 'which this one lacks')}"
            f"{'; ' if missing and extra else ''}"
            f"{_which(extra, 'this one has', 'which the checkpoint lacks')}; {_FIX}"
        )
    saved_group = {old[i]: g for g, members in enumerate(saved["groups"]) for i in members}
    current_group = {new[i]: g for g, members in enumerate(current["groups"]) for i in members}
    moved = [n for n in new if saved_group.get(n) != current_group.get(n)]
    if moved or len(saved["groups"]) != len(current["groups"]):
        name = moved[0] if moved else new[0]
        raise ValueError(
            f"the checkpoint's param groups hold other parameters than this optimizer's: {name!r} is in group "
            f"{saved_group.get(name)} of {len(saved['groups'])} in the checkpoint and in group "
            f"{current_group.get(name)} of {len(current['groups'])} here; {_FIX}"
        )
    saved_shape = {n: list(s) for n, s in zip(old, saved["shapes"], strict=True)}
    for name, shape in zip(new, current["shapes"], strict=True):
        if saved_shape[name] != list(shape):
            raise ValueError(
                f"parameter {name!r} has shape {saved_shape[name]} in the checkpoint and {list(shape)} in this "
                f"model; {_FIX}"
            )
    index = {n: i for i, n in enumerate(old)}
    return [index[n] for n in new]


def _which(names: Sequence[str], side: str, lack: str) -> str:
    if not names:
        return ""
    noun = "parameter" if len(names) == 1 else "parameters"
    return f"{side} {noun} {listed([repr(n) for n in names], 3)}, {lack}"


def reorder_common(state: dict, order: Sequence[int]) -> dict:
    """The common part of a checkpoint's optimizer state, renumbered so that parameter ``j`` holds what the saved
    parameter ``order[j]`` held.

    Takes a distamp ``AmpOptimizer`` state (whole: inner state and FP32
    masters by parameter, or sliced: the layout of the saving ranks' slices,
    whose ranges move to where the parameters lie now) and a torch
    optimizer's. Slots for tensors in DCP files move with their parameter.
    """
    if "inner" not in state:  # a torch optimizer's state_dict
        return _reorder_torch(state, order)
    out = {**state, "inner": _reorder_torch(state["inner"], order)}
    if state.get("master_weights"):
        out["master_weights"] = [state["master_weights"][s] for s in order]
    if state.get("sharding") is not None:
        out["sharding"] = _reorder_layout(state["sharding"], order)
    return out


def _reorder_torch(state: dict, order: Sequence[int]) -> dict:
    """A torch ``state_dict``, whose ``state`` is keyed by position; each group's ``params`` stays as it is (the
    positions of its members, which kept their group)."""
    saved = {int(k): v for k, v in state["state"].items()}
    return {**state, "state": {j: saved[s] for j, s in enumerate(order) if s in saved}}


def _reorder_layout(layout: dict, order: Sequence[int]) -> dict:
    """A sliced state's layout in the loading order: sizes, shapes and groups by the new positions, and each
    saving rank's slice as the flat ranges (``"ranges"``) its elements now lie in."""
    saved, current, new_index = _spaces(layout["numels"], order)
    held = [_moved(ranges, saved, current, new_index) for ranges in flat_state.saved_ranges(layout)]
    rest = {k: v for k, v in layout.items() if k != "bounds"}
    return {
        **rest,
        "numels": [layout["numels"][s] for s in order],
        "shapes": [layout["shapes"][s] for s in order],
        "groups": [sorted(new_index[i] for i in group) for group in layout["groups"]],
        "ranges": [sorted(r for r in ranges if r[1] > r[0]) for ranges in held],
    }


def reorder_part(part: dict, order: Sequence[int], saved_numels: Sequence[int]) -> dict:
    """A saving rank's slice of the optimizer state (:func:`~distamp.checkpoint.flat_state.split`'s shard part)
    with its ranges and pieces moved to where their parameters lie in the loading order.

    The tensors stay as written; the ranges (``"ranges"``, replacing
    ``"lo"``/``"hi"``) say, in the order the tensors lay them end to end,
    where each saved piece's elements lie now.
    """
    saved, current, new_index = _spaces(saved_numels, order)
    ranges = [(int(part["lo"]), int(part["hi"]))] if "lo" in part else [tuple(r) for r in part["ranges"]]
    rest = {k: v for k, v in part.items() if k not in ("lo", "hi")}
    return {
        **rest,
        "ranges": [list(r) for r in _moved(ranges, saved, current, new_index)],
        "pieces": [[new_index[int(param)], start, stop] for param, start, stop in part["pieces"]],
    }


def _spaces(numels: Sequence[int], order: Sequence[int]) -> tuple[FlatLayout, FlatLayout, dict[int, int]]:
    """The saved and the loading flat spaces, and each saved parameter's new position."""
    return FlatLayout(numels, 1), FlatLayout([numels[s] for s in order], 1), {s: j for j, s in enumerate(order)}


def _moved(ranges: Sequence[Any], saved: FlatLayout, current: FlatLayout,
           new_index: dict[int, int]) -> list[tuple[int, int]]:
    """Saved flat ranges, piece by piece, where those elements lie in ``current`` (in the same order)."""
    out = []
    for lo, hi in ranges:
        for piece in saved.pieces(int(lo), int(hi)):
            base = current.offsets[new_index[piece.param]]
            out.append((base + piece.start, base + piece.stop))
    return out
