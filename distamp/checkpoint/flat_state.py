"""Optimizer state in flat-space terms, so a checkpoint saved at one world size and stage loads at another.

A sharded :class:`~distamp.optim.optimizer.AmpOptimizer` holds, on each
rank, the state of part of the flat parameter space
(:mod:`distamp.core.flat_layout`: the parameters laid end to end):

* stages 1 and 2: one slice ``[lo, hi)``, cut anywhere (inside parameters too);
* stage 3 (FSDP2): one range per parameter, the rows of its dim 0 that
  this rank's DTensor shard holds (:mod:`distamp.core.shard_rows`),
  so several ranges ``[[lo, hi], ...]``, recorded for every rank under
  ``"ranges"`` in the layout (:mod:`distamp.sharding.dtensor_state`).

For a checkpoint that state is split in two (:func:`split`):

* the *common* part, the same on every rank and written once by rank 0:
  loss scaler, counters, param-group options, and the layout (parameter
  sizes and shapes, group membership, the slice bounds or the ranges of
  every rank of the saving run);
* one *shard* part per rank, written by that rank: the flat ranges it
  holds (``"lo"``/``"hi"`` for a stage-1/2 slice, as always; ``"ranges"``
  at stage 3), its FP32 masters (O2) and every per-element state tensor
  (``exp_avg``, ``momentum_buffer``, ...) as one flat tensor over those
  ranges laid end to end, and per piece (a range within one parameter) the
  non-element state (``step``) and which keys it has. Nothing is gathered:
  a stage-3 rank writes its local shards.

:func:`join` builds, from the common part and the shard parts covering
what the loading rank holds, the ``state_dict`` the loading optimizer
takes as its own: unsharded, stage 1/2 (one slice) or stage 3 (local
shards, with the layout), at any world size. An unsharded checkpoint is
read as one part covering everything. Which parts a rank needs is
:func:`parts_needed`: only those whose ranges overlap its own (plus, at
stage 3, one element of each parameter it holds no rows of, for the
parameter's ``step`` and state keys).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distamp.core.flat_layout import FlatLayout, Piece
from distamp.core.shard_rows import row_numel, rows_of

__all__ = ["Target", "check_fits", "describe", "join", "parts_needed", "saved_ranges", "split"]


@dataclass(frozen=True)
class Target:
    """What a loading optimizer's own ``state_dict`` looks like.

    Attributes:
        numels: element count of each parameter, in flat order.
        shapes: each parameter's shape.
        groups: the flat indices of each param group's parameters.
        pure: O2 (FP32 masters saved with the optimizer).
        sharding: the sharded optimizer's layout state (world size, rank,
            bounds for stages 1 and 2, every rank's ranges for stage 3, ...),
            or None for an unsharded one.
        rank: this process's rank (which per-rank PowerSGD part it takes).
        world_size: the number of ranks loading.
    """

    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    pure: bool
    sharding: dict | None
    rank: int = 0
    world_size: int = 1

    @property
    def fully_sharded(self) -> bool:
        """Stage 3: state held as local shards of each parameter's dim 0."""
        return self.sharding is not None and "ranges" in self.sharding

    def range(self) -> tuple[int, int]:
        """The flat range an unsharded or stage-1/2 optimizer holds state for (see :meth:`needs` for stage 3)."""
        if self.sharding is None:
            return 0, sum(self.numels)
        if self.fully_sharded:
            raise ValueError("a stage-3 optimizer holds one range per parameter, not one slice: use needs()")
        rank = self.sharding["rank"]
        return self.sharding["bounds"][rank], self.sharding["bounds"][rank + 1]

    def needs(self) -> list[tuple[int, int]]:
        """The flat ranges whose saved state this optimizer loads, sorted.

        Stage 3: this rank's range of each parameter, and the first element
        of each parameter it holds no rows of (its state still has ``step``
        and empty per-element tensors, which must agree with the others').
        """
        if not self.fully_sharded:
            return [self.range()]
        assert self.sharding is not None
        layout = FlatLayout(self.numels, 1)
        needed = []
        for i, shape in enumerate(self.shapes):
            lo, hi = _rows_range(layout, i, shape, self.sharding["world_size"], self.sharding["rank"])
            if hi > lo:
                needed.append((lo, hi))
            elif self.numels[i]:
                needed.append((layout.offsets[i], layout.offsets[i] + 1))
        return needed


def describe(optimizer: Any) -> Target | None:
    """The :class:`Target` of a distamp ``AmpOptimizer`` (None for any other optimizer).

    The layout comes from the optimizer's precision plugin
    (``checkpoint_layout``): the one interface through which checkpoints
    learn how a capability holds the state.

    Raises:
        RuntimeError: a stage-3 optimizer whose parameters are not sharded yet.
    """
    precision = getattr(optimizer, "precision", None)
    masters = getattr(precision, "master_weights", None)
    if precision is None or masters is None:
        return None
    params = masters.model_params
    groups, sharding = precision.checkpoint_layout(optimizer.param_groups)
    distributed = dist.is_available() and dist.is_initialized()
    return Target(
        numels=tuple(p.numel() for p in params),
        shapes=tuple(tuple(p.shape) for p in params),
        groups=tuple(tuple(g) for g in groups),
        pure=masters.enabled,
        sharding=sharding,
        rank=dist.get_rank() if distributed else 0,
        world_size=dist.get_world_size() if distributed else 1,
    )


# ----------------------------------------------------------------------------- saving


def split(state: dict) -> tuple[dict, dict | None]:
    """``(common, shard)`` of an ``AmpOptimizer`` state; ``shard`` is None when it has no per-rank state.

    ``state`` is ``local_state_dict()``'s (at stage 3 this rank's shards;
    ``state_dict()`` at the other stages). PowerSGD state (error feedback
    differs on every rank) goes to the shard part under ``"powersgd"``; the
    common part keeps only a marker with the saving world size. PowerSGD
    and sharding never come together.
    """
    compressor = state.get("powersgd")
    if compressor is not None and state.get("sharding") is None:
        marker = {"in_rank_parts": True, "world_size": int(compressor["world_size"])}
        return {**state, "powersgd": marker}, {"powersgd": compressor}
    layout = state.get("sharding")
    if layout is None:
        return state, None
    saved = state["inner"]["state"]
    if "ranges" in layout:  # stage 3: state by parameter index, local shards of dim 0
        flat = FlatLayout(layout["numels"], 1)
        ranges = [(int(lo), int(hi)) for lo, hi in layout["ranges"][layout["rank"]]]
        pieces = [p for lo, hi in ranges for p in flat.pieces(lo, hi)]
        states = [saved.get(p.param, {}) for p in pieces]
        shapes = [_local_shape(layout["shapes"][p.param], p.length) for p in pieces]
        masters = state["master_weights"]
        flat_masters = torch.cat([masters[p.param].reshape(-1) for p in pieces]) if masters and pieces else None
        shard: dict[str, Any] = {"ranges": [list(r) for r in ranges]}
    else:  # stages 1 and 2: state by piece index, one slice
        lo, hi = FlatLayout(layout["numels"], layout["world_size"]).range_of(layout["rank"])
        pieces = FlatLayout(layout["numels"], 1).pieces(lo, hi)
        states = [saved.get(j, {}) for j in range(len(pieces))]
        shapes = [(p.length,) for p in pieces]
        flat_masters = state["master_weights"][0] if state["master_weights"] else None
        shard = {"lo": lo, "hi": hi}
    shard.update(_shard_part(pieces, states, shapes, flat_masters))
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in state["inner"]["param_groups"]]
    common = {**state, "inner": {"state": {}, "param_groups": groups}, "master_weights": []}
    return common, shard


def _shard_part(pieces: list[Piece], states: list[dict], shapes: list[tuple[int, ...]],
                masters: torch.Tensor | None) -> dict:
    """Masters, per-element state laid end to end over ``pieces`` and each piece's other state."""
    length = sum(p.length for p in pieces)
    part: dict[str, Any] = {"masters": masters, "elementwise": {}, "pieces": [], "piece_state": []}
    start = 0
    for piece, entry, shape in zip(pieces, states, shapes, strict=True):
        keys, scalars = _sort_state(entry, shape)
        for key in keys:
            flat = _flat_for(part["elementwise"], key, entry[key], length)
            flat[start : start + piece.length] = entry[key].reshape(-1)
        part["pieces"].append([piece.param, piece.start, piece.stop])
        part["piece_state"].append({"keys": keys, "scalars": scalars})
        start += piece.length
    return part


def _local_shape(shape: list[int], length: int) -> tuple[int, ...]:
    """The shape of ``length`` elements of whole dim-0 rows of a tensor of ``shape``."""
    return (length // row_numel(shape), *shape[1:])


def _rows_range(layout: FlatLayout, param: int, shape: tuple[int, ...], world: int, rank: int) -> tuple[int, int]:
    """The flat range of the dim-0 rows of ``param`` that ``rank`` holds at stage 3."""
    start, stop = rows_of(shape[0] if shape else 1, world, rank)
    per_row = row_numel(shape)
    return layout.offsets[param] + start * per_row, layout.offsets[param] + stop * per_row


def _sort_state(state: dict, shape: tuple[int, ...]) -> tuple[list[str], dict]:
    """Split one parameter's state into per-element keys and everything else (``step``, None, ...)."""
    keys, scalars = [], {}
    for key, value in state.items():
        if torch.is_tensor(value) and key != "step" and tuple(value.shape) == tuple(shape):
            keys.append(key)
        else:
            scalars[key] = value
    return keys, scalars


def _flat_for(store: dict, key: str, like: torch.Tensor, length: int) -> torch.Tensor:
    if key not in store:
        store[key] = torch.zeros(length, dtype=like.dtype, device="cpu")
    return store[key]


# ----------------------------------------------------------------------------- loading


def parts_needed(common: dict, target: Target | None, saved_world_size: int | None = None) -> list[int]:
    """Ranks whose shard parts the loading optimizer needs: those overlapping what it holds (:meth:`Target.needs`).

    ``saved_world_size``: the number of ranks of the job that saved the
    checkpoint (its manifest's), which decides whose PowerSGD part a rank
    reads; None takes the PowerSGD marker's word for it.

    Raises:
        ValueError: the checkpoint's parameters differ from the target's, or
            it is sharded and the optimizer is not a distamp AmpOptimizer.
    """
    layout = common.get("sharding") if isinstance(common, dict) else None
    if layout is None:
        source = _compressor_part(common, target, saved_world_size)
        return [] if source is None else [source]
    if target is None:
        raise ValueError("this checkpoint holds sharded optimizer state; load it into fleet.distributed_optimizer's "
                         "optimizer (a distamp AmpOptimizer)")
    _check_same_parameters(layout["numels"], layout["shapes"], target)
    needed = target.needs()
    return [r for r, held in enumerate(saved_ranges(layout)) if _overlap(held, needed)]


def saved_ranges(layout: dict) -> list[list[tuple[int, int]]]:
    """Per saving rank, the sorted flat ranges its part holds, from a checkpoint's layout (any stage)."""
    if "ranges" in layout:
        return [sorted((int(lo), int(hi)) for lo, hi in held) for held in layout["ranges"]]
    bounds = layout["bounds"]
    return [[(bounds[r], bounds[r + 1])] if bounds[r + 1] > bounds[r] else [] for r in range(layout["world_size"])]


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of disjoint ranges share an element."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] < b[j][1] and b[j][0] < a[i][1]:
            return True
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return False


def join(common: dict, parts: dict[int, dict], target: Target | None, saved_world_size: int | None = None) -> dict:
    """The ``state_dict`` the target optimizer loads as its own, from a checkpoint's optimizer state.

    ``parts`` maps saving ranks to their shard parts (at least
    :func:`parts_needed`'s). An unsharded checkpoint loaded by an unsharded
    optimizer is returned as it is. For a stage-3 target the result holds
    this rank's local shards and the target's layout under ``"sharding"``.
    ``saved_world_size`` as for :func:`parts_needed`.

    Raises:
        ValueError: the checkpoint does not fit the target (parameters,
            param groups, O1/O2).
    """
    saved_layout = common.get("sharding")
    compressor_rank = _compressor_part(common, target, saved_world_size)
    if compressor_rank is not None:
        compressor = parts[compressor_rank]["powersgd"]
        if saved_world_size is not None and int(compressor["world_size"]) != saved_world_size:
            # Carried over from another world size by a job that could not use it (written before this was
            # refused): its error feedback fits neither job, so label it with the saving job's world size, whose
            # mismatch makes the compressor drop it.
            compressor = {**compressor, "world_size": saved_world_size}
        common = {**common, "powersgd": compressor}
    check_fits(common, target)
    if target is None or (saved_layout is None and target.sharding is None):
        return common
    if saved_layout is None:
        parts = {0: _part_from_unsharded(common, FlatLayout(target.numels, 1), target.shapes)}
    source = _Source(FlatLayout(target.numels, 1), parts)
    options = [{k: v for k, v in g.items() if k != "params"} for g in common["inner"]["param_groups"]]
    builder = _unsharded if target.sharding is None else _fully_sharded if target.fully_sharded else _sharded
    inner, masters = builder(source, target, options)
    state = {k: v for k, v in common.items() if k != "sharding"}
    if target.sharding is not None:
        state["sharding"] = target.sharding
    return {**state, "inner": inner, "master_weights": masters}


def check_fits(common: dict, target: Target | None) -> None:
    """``ValueError`` unless the optimizer state a checkpoint saved (its common part) fits ``target``.

    Checked before anything is loaded: the param groups (how many
    parameters each holds), O1 vs O2, and the parameters' shapes where the
    checkpoint records them (a sharded layout, or O2's masters). Without
    this an unsharded checkpoint reached torch's ``load_state_dict``, which
    refuses other group sizes only after the model (and the loss scaler)
    had been loaded. Nothing to check for a non-distamp optimizer (None).
    """
    if target is None:
        return
    layout = common.get("sharding")
    if layout is None:
        saved_groups = [list(g["params"]) for g in common["inner"]["param_groups"]]
        masters = common["master_weights"]
        saved_pure = bool(masters)
        if saved_pure:
            shapes = [_saved_shape(m) for m in masters]
            _check_same_parameters([math.prod(shape) for shape in shapes], shapes, target)
    else:
        _check_same_parameters(layout["numels"], layout["shapes"], target)
        saved_groups, saved_pure = layout["groups"], layout["mode"] == "O2"
    _check_groups(saved_groups, target)
    _check_state_slots(common["inner"]["state"], target)
    if saved_pure != target.pure:
        raise ValueError(
            "checkpoint and optimizer disagree on use_pure_fp16 (O2 master weights "
            f"{'present' if saved_pure else 'absent'} in the checkpoint); build the optimizer "
            "with the strategy the checkpoint was saved with"
        )


def _check_state_slots(state: dict, target: Target) -> None:
    """``ValueError`` when a stage-3 checkpoint's per-parameter state (a slot for a tensor in its DCP files, with
    the saved shape) does not have the shape of the parameter that would take it."""
    order = [i for group in target.groups for i in group]  # torch numbers the state in param-group order
    for index, entry in state.items():
        shape = list(target.shapes[order[int(index)]])
        for name, value in entry.items():
            if isinstance(value, dict) and "dcp" in value and list(value["shape"]) != shape:
                raise ValueError(
                    f"the checkpoint's optimizer state {name!r} of parameter {index} has shape "
                    f"{list(value['shape'])}, this one {shape}; build the model and optimizer as the saving run did"
                )


def _saved_shape(master: Any) -> tuple[int, ...]:
    """The shape of a saved O2 master: a tensor, or a stage-3 checkpoint's slot for one in its DCP files."""
    return tuple(master.shape) if torch.is_tensor(master) else tuple(master["shape"])


def _compressor_part(common: Any, target: Target | None, saved_world_size: int | None = None) -> int | None:
    """The saving rank whose PowerSGD part this rank loads: its own at the same world size, else rank 0's.

    Rank 0's at another world size: its Q and step count are the same on
    every rank; its error feedback is dropped when loaded (with one warning).
    The saving job's world size counts, not only the state's: a state whose
    world size differs from its job's is in rank 0's part alone.
    """
    marker = common.get("powersgd") if isinstance(common, dict) else None
    if target is None or not isinstance(marker, dict) or not marker.get("in_rank_parts"):
        return None
    saved = int(marker["world_size"])
    same = saved == target.world_size and (saved_world_size is None or saved_world_size == saved)
    return target.rank if same else 0


def _part_ranges(part: dict) -> list[tuple[int, int]]:
    """The flat ranges a shard part holds, in the order its tensors lay them end to end."""
    if "ranges" in part:
        return [(int(lo), int(hi)) for lo, hi in part["ranges"]]
    return [(int(part["lo"]), int(part["hi"]))]


class _Source:
    """Reads flat ranges of the saved state across the shard parts (each holding one or more ranges)."""

    def __init__(self, layout: FlatLayout, parts: dict[int, dict]) -> None:
        self.layout = layout
        # (flat start, flat stop, part, where the range starts in the part's tensors), by flat start
        segments = []
        for part in parts.values():
            base = 0
            for lo, hi in _part_ranges(part):
                if hi > lo:
                    segments.append((lo, hi, base, part))
                base += hi - lo
        self.segments = sorted(segments, key=lambda s: s[:3])
        self.starts = [s[0] for s in self.segments]
        # (flat start, flat stop, part, piece index) for every saved piece, by flat start
        self.pieces = sorted(
            ((layout.offsets[param] + start, layout.offsets[param] + stop, part, j)
             for part in parts.values() for j, (param, start, stop) in enumerate(part["pieces"])),
            key=lambda entry: entry[:2],
        )
        self.piece_starts = [entry[0] for entry in self.pieces]

    def _piece_at(self, flat: int) -> tuple[int, int, dict, int]:
        i = bisect.bisect_right(self.piece_starts, flat) - 1
        if i < 0 or not self.pieces[i][0] <= flat < self.pieces[i][1]:
            raise ValueError(f"the checkpoint's shard parts do not cover flat element {flat}")
        return self.pieces[i]

    def state_at(self, flat_lo: int, flat_hi: int) -> dict:
        """``{"keys": [...], "scalars": {...}}`` of the saved piece holding flat element ``flat_lo``.

        Raises:
            ValueError: a state tensor that is neither per-element nor a
                scalar (e.g. factored moments), asked for another range than
                the one it was saved for: it cannot be re-sliced.
        """
        start, stop, part, j = self._piece_at(flat_lo)
        saved = part["piece_state"][j]
        shaped = [k for k, v in saved["scalars"].items() if torch.is_tensor(v) and v.dim() > 0]
        if shaped and (start, stop) != (flat_lo, flat_hi):
            raise ValueError(
                f"optimizer state {shaped} of flat elements [{start}, {stop}) is neither per-element nor a "
                f"scalar, so it cannot be re-sliced to [{flat_lo}, {flat_hi}); resume with the world size and "
                "sharding it was saved with"
            )
        return saved

    def read(self, name: str | None, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of ``masters`` (name None) or per-element state ``name``, concatenated."""
        chunks, cursor = [], lo
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        for seg_lo, seg_hi, base, part in self.segments[i:]:
            if seg_lo >= hi or seg_lo > cursor:
                break
            last = min(hi, seg_hi)
            if last > cursor:
                tensor = part["masters"] if name is None else part["elementwise"][name]
                chunks.append(tensor.reshape(-1)[base + cursor - seg_lo : base + last - seg_lo])
                cursor = last
        if cursor < hi:
            raise ValueError(f"the checkpoint's shard parts do not cover flat elements [{lo}, {hi})")
        return torch.cat(chunks).clone() if chunks else torch.zeros(0)

    def piece_state(self, flat_lo: int, flat_hi: int, shape: tuple[int, ...]) -> dict | None:
        """A piece's optimizer state over ``[flat_lo, flat_hi)``, shaped ``shape`` (None: it had none)."""
        saved = self.state_at(flat_lo, flat_hi)
        if not saved["keys"] and not saved["scalars"]:
            return None
        state = {key: self.read(key, flat_lo, flat_hi).view(shape) for key in saved["keys"]}
        return {**state, **saved["scalars"]}

    def empty_state(self, flat: int, shape: tuple[int, ...]) -> dict | None:
        """State of no elements (``shape`` has none) of the parameter holding flat element ``flat``.

        Its per-element tensors are empty, of the saved dtypes; the rest is
        that saved piece's (``step``), so the state agrees with the ranks
        that hold elements of the parameter.
        """
        start, stop, part, _ = self._piece_at(flat)
        saved = self.state_at(start, stop)
        if not saved["keys"] and not saved["scalars"]:
            return None
        state = {key: part["elementwise"][key].new_zeros(shape) for key in saved["keys"]}
        return {**state, **saved["scalars"]}


def _sharded(source: _Source, target: Target, options: list[dict]) -> tuple[dict, list[torch.Tensor]]:
    lo, hi = target.range()
    pieces: list[Piece] = source.layout.pieces(lo, hi)
    group_of = {i: g for g, members in enumerate(target.groups) for i in members}
    state: dict[int, dict] = {}
    members: list[list[int]] = [[] for _ in target.groups]
    for j, piece in enumerate(pieces):
        members[group_of[piece.param]].append(j)
        piece_state = source.piece_state(piece.offset, piece.offset + piece.length, (piece.length,))
        if piece_state is not None:
            state[j] = piece_state
    groups = [{**options[g], "params": m} for g, m in enumerate(members)]
    masters = [source.read(None, lo, hi).float()] if target.pure else []
    return {"state": state, "param_groups": groups}, masters


def _unsharded(source: _Source, target: Target, options: list[dict]) -> tuple[dict, list[torch.Tensor]]:
    """Per parameter index, the whole state and (O2) the whole master."""
    return _per_parameter(source, target, options, lambda i, shape: (*source.layout.param_range(i), shape))


def _fully_sharded(source: _Source, target: Target, options: list[dict]) -> tuple[dict, list[torch.Tensor]]:
    """Stage 3: per parameter index, this rank's local shard of the state and (O2) of the master."""
    assert target.sharding is not None
    world, rank = target.sharding["world_size"], target.sharding["rank"]

    def rows(i: int, shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        lo, hi = _rows_range(source.layout, i, shape, world, rank)
        return lo, hi, _local_shape(list(shape), hi - lo)

    return _per_parameter(source, target, options, rows)


def _per_parameter(source: _Source, target: Target, options: list[dict],
                   cut: Callable[[int, tuple[int, ...]], tuple[int, int, tuple[int, ...]]]
                   ) -> tuple[dict, list[torch.Tensor]]:
    """State keyed by parameter index: ``cut(i, shape)`` is the flat range of parameter ``i`` this rank holds and
    its shape; a parameter with elements but none here still gets its (empty) state and ``step``."""
    state, masters = {}, []
    for i, shape in enumerate(target.shapes):
        lo, hi, local = cut(i, shape)
        if target.numels[i]:
            own = source.piece_state(lo, hi, local) if hi > lo else source.empty_state(source.layout.offsets[i], local)
            if own is not None:
                state[i] = own
        if target.pure:
            masters.append(source.read(None, lo, hi).float().view(local))
    groups = [{**options[g], "params": list(members)} for g, members in enumerate(target.groups)]
    return {"state": state, "param_groups": groups}, masters


def _part_from_unsharded(common: dict, layout: FlatLayout, shapes: tuple[tuple[int, ...], ...]) -> dict:
    """An unsharded ``AmpOptimizer.state_dict()`` as one shard part covering the whole flat space."""
    saved = common["inner"]["state"]
    part: dict[str, Any] = {"lo": 0, "hi": layout.total, "elementwise": {}, "pieces": [], "piece_state": []}
    masters = common["master_weights"]
    part["masters"] = torch.cat([m.reshape(-1).float() for m in masters]) if masters else None
    for i, shape in enumerate(shapes):
        lo, hi = layout.param_range(i)
        if hi == lo:
            continue
        keys, scalars = _sort_state(saved.get(i, {}), shape)
        for key in keys:
            _flat_for(part["elementwise"], key, saved[i][key], layout.total)[lo:hi] = saved[i][key].reshape(-1)
        part["pieces"].append([i, 0, hi - lo])
        part["piece_state"].append({"keys": keys, "scalars": scalars})
    return part


def _check_same_parameters(numels: Any, shapes: Any, target: Target) -> None:
    if list(numels) != list(target.numels) or [list(s) for s in shapes] != [list(s) for s in target.shapes]:
        raise ValueError(
            f"the checkpoint's optimizer manages {len(numels)} parameters of shapes {_short(shapes)}, this one "
            f"{len(target.numels)} of shapes {_short(target.shapes)}; build the model and optimizer as the "
            "saving run did"
        )


def _check_groups(saved: list, target: Target) -> None:
    if [list(g) for g in saved] != [list(g) for g in target.groups]:
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} param groups of sizes {[len(g) for g in saved]}, this "
            f"one {len(target.groups)} of sizes {[len(g) for g in target.groups]}; build the optimizer with the "
            "same param groups as the saving run"
        )


def _short(shapes: Any) -> str:
    text = str([list(s) for s in shapes])
    return text if len(text) <= 120 else text[:117] + "..."
