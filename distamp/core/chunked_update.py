"""O2's unscale, inf/NaN check and master update, chunk by chunk: no whole-model FP32 gradient.

The inner optimizer updates FP32 masters from FP32 gradients, and O2's
gradients arrive in 16 bits. Holding an FP32 copy of every gradient costs
4 bytes per parameter, as much as the 16-bit weights and gradients
together. Here the copy only ever exists for one chunk of at most
:func:`chunk_numel` elements, in one scratch buffer, as Apex's FusedAdam
and Megatron-LM's distributed optimizer update their masters chunk by chunk:

1. :func:`check_in_chunks`: copy a chunk of 16-bit gradients into the
   scratch buffer (adding the gradient-merge sum, if any), unscale and check
   it with the fused kernel of torch's ``GradScaler``, keep the flag and the
   maximum; repeat. Nothing is kept but two numbers, unless every gradient
   made one chunk: then that chunk is kept (:class:`CheckedGrads`) for the step.
2. :func:`step_in_chunks` (only when every rank agreed to apply): rebuild
   each chunk's FP32 gradients the same way (the same kernels, so the same
   bits), or take the one kept chunk, run the inner optimizer on that
   chunk's masters only, and round the updated masters into the model.

A parameter larger than a chunk is cut into slices of the flat master
buffer, each given to the inner optimizer as a parameter of its own with
the matching slices of its state. That is only right for optimizers whose
update is elementwise, so only the torch optimizers listed in
:data:`SLICEABLE_OPTIMIZERS` (exact types) are cut; any other optimizer is
stepped once on whole FP32 gradients made for the step and freed after it
(:func:`steps_in_chunks` tells which). Each element sees the same
arithmetic as in one whole step, so the masters are bitwise what one step
on a whole-model FP32 gradient gives; slice boundaries sit at multiples of
:data:`SLICE_ALIGN` elements from the parameter's start, so every slice
begins where a vectorized loop over the whole parameter would.

Step hooks see one step: the whole chunked update runs inside
:func:`as_one_step`, so torch's step pre- and post-hooks (the optimizer's own,
``register_step_pre_hook``, and the global ones) run once around it with the
param groups whole, and the chunks step without them, as an EMA or a step
counter registered on the optimizer expects.

Cost: the inner optimizer's ``step()`` runs once per chunk, about 16 calls
for a model of any size, each with its Python
overhead, which on a GPU can outweigh the kernels. So on CUDA a chunk is as
large as fits below the peak the device's allocator has already reached
(:func:`room_below_peak`, counting 16 bytes per element for the scratch
and the inner optimizer's temporaries): where activations dominate, the
whole model is one chunk and one ``step()``, and the step still raises no
peak; where the parameters dominate, the chunks stay small. A whole-model
chunk is built once, by the check, and kept until the step (which would
allocate the same chunk), and its views are made in one call: on an H100
(185.76M-parameter GPT, BF16 O2, torch 2.11) that took the step from 12.25
to 9.62 ms, against 2.25 ms for torch's own SGD step in BF16 autocast.

Sharding stages 1 and 2 use the same two functions on one rank's 16-bit
gradient slice: there the gradient comes from a :class:`GradSource` per
piece rather than from a model parameter, and the updated masters reach the
model through the all-gather, not through :func:`step_in_chunks`.

Stage 3's gradients are FP32 already (FSDP2's sharded gradients), so
nothing is rebuilt there; :func:`step_and_free_in_chunks` steps a chunk at
a time (small parameters whole, larger ones in slices of their local shard),
smallest first, and frees each gradient once its parameter has stepped, so
the inner optimizer's temporaries are a chunk's and come for the largest
parameters when the other gradients are gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distamp.torch_compat import (
    amp_foreach_non_finite_check_and_unscale_,
    dtensor_local,
    foreach_add_,
    foreach_copy_,
    foreach_norm,
    tell_lr_schedulers_it_stepped,
    unflatten_dense_tensors,
    unhooked_step,
    with_step_hooks,
)

__all__ = ["SLICEABLE_OPTIMIZERS", "SLICE_ALIGN", "CheckedGrads", "GradSource", "Pair", "Piece", "Verdict",
           "adopt_written_values", "as_one_step", "check_in_chunks", "chunk_limit", "chunk_numel",
           "copy_and_unscale_", "holds_rounding_of", "plan_chunks", "room_below_peak", "step_and_free_in_chunks",
           "step_in_chunks", "step_makes_temporaries", "step_only", "steps_in_chunks"]

SLICEABLE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose update of an element depends on that element's gradient and state only."""

SLICE_ALIGN = 4096
"""Slices of a parameter start at multiples of this many elements (a multiple of every SIMD width)."""

_MIN_CHUNK = 1 << 16  # 256 KB of FP32: below this, per-chunk overhead outweighs the memory saved
_CHUNKS = 16  # about this many chunks per model: at most 1/16 of its FP32 gradient exists at once


class GradSource(Protocol):
    """Where a master's 16-bit gradient is read from: a model parameter, or a piece of a sharded gradient slice."""

    @property
    def grad(self) -> torch.Tensor | None:
        """The gradient, shaped like the master (or at least with as many elements, contiguous)."""


Pair = tuple[GradSource, nn.Parameter]
"""``(where the gradient is, the FP32 master it updates)``."""


_BYTES_PER_ELEMENT = 16  # an FP32 scratch element plus up to three FP32 temporaries of the inner optimizer's


def chunk_numel(total: int, room_bytes: int = 0) -> int:
    """Elements per chunk for a model of ``total`` gradient elements.

    About 1/16 of it, at least 2**16, or more where ``room_bytes`` (memory
    free below the peak already reached, :func:`room_below_peak`) holds more
    at :data:`_BYTES_PER_ELEMENT` each; a multiple of :data:`SLICE_ALIGN`.
    """
    per_chunk = max(_MIN_CHUNK, math.ceil(total / _CHUNKS), min(total, room_bytes // _BYTES_PER_ELEMENT))
    return math.ceil(per_chunk / SLICE_ALIGN) * SLICE_ALIGN


def chunk_limit(pairs: Sequence[Pair]) -> int:
    """:func:`chunk_numel` for ``pairs`` (on one device): the elements their masters hold on it (a DTensor's local
    shard), the room below that device's peak."""
    return chunk_numel(sum(_local(master).numel() for _, master in pairs), room_below_peak(pairs[0][1].device))


def room_below_peak(device: torch.device) -> int:
    """Bytes the CUDA allocator may hand out on ``device`` without passing its peak so far; 0 elsewhere.

    The peak is ``torch.cuda.max_memory_allocated`` (since the process began
    or the user's last ``reset_peak_memory_stats``). Other devices keep no
    such statistic, so their chunks stay at 1/16 of the model.
    """
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of the flattened pair ``index``; ``whole`` when that is all of it."""

    index: int
    lo: int
    hi: int
    whole: bool


@dataclass(frozen=True)
class CheckedGrads:
    """The unscaled FP32 gradients :func:`check_in_chunks` built when every pair fitted in one chunk.

    Kept from the check to the step that follows it, :func:`step_in_chunks`
    steps on them instead of building the same bits again: one pass less
    over the gradients and one fill less, whose per-tensor Python calls are
    what a GPU step waits on. They occupy the chunk the step would allocate
    anyway, so the step's peak is unchanged.
    """

    masters: tuple[int, ...]
    """``id`` of each pair's master, in order: the pairs these gradients were built for."""
    pieces: list[Piece]
    grads: list[torch.Tensor]
    """One per piece, shaped like its master (views of one scratch buffer)."""

    def built_for(self, pairs: Sequence[Pair]) -> bool:
        """Whether these are the gradients of ``pairs`` (the same masters, in the same order)."""
        return len(pairs) == len(self.masters) and all(
            id(master) == kept for (_, master), kept in zip(pairs, self.masters, strict=True))


class Verdict(NamedTuple):
    """What :func:`check_in_chunks` found."""

    found: torch.Tensor
    """One-element FP32 tensor, nonzero when a gradient is inf or NaN."""
    grad_max: torch.Tensor | None
    """``max |g|`` over the unscaled gradients (zero-dim FP32) when asked for, else None."""
    kept: CheckedGrads | None
    """The unscaled FP32 gradients, when asked to keep them and they made one chunk."""


def plan_chunks(numels: Sequence[int], limit: int, sliceable: Sequence[bool]) -> list[list[Piece]]:
    """Cut parameters of ``numels`` elements into chunks of at most ``limit`` elements, in order.

    Parameters that fit share a chunk; a larger one, where ``sliceable``,
    is cut into slices of ``limit`` elements (``limit`` is a multiple of
    :data:`SLICE_ALIGN`), each in a chunk of its own; one that may not be
    cut is a chunk of its own, whatever its size.
    """
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = 0
    for index, (n, cut) in enumerate(zip(numels, sliceable, strict=True)):
        if n <= room:
            current.append(Piece(index, 0, n, True))
            room -= n
            continue
        if current:
            chunks.append(current)
        current, room = [], 0
        if n <= limit:
            current, room = [Piece(index, 0, n, True)], limit - n
        elif not cut:
            chunks.append([Piece(index, 0, n, True)])
        else:
            chunks.extend([Piece(index, lo, min(lo + limit, n), False)] for lo in range(0, n, limit))
    if current:
        chunks.append(current)
    return chunks


class _Filler:
    """Builds a chunk's unscaled FP32 gradients in one scratch buffer: copy, add the merge sum, unscale."""

    def __init__(self, pairs: Sequence[Pair], extra: dict[int, torch.Tensor] | None,
                 inv_scale: float, limit: int) -> None:
        self.pairs, self.extra = pairs, extra or {}
        device = pairs[0][1].device
        self.scratch = torch.empty(min(limit, sum(m.numel() for _, m in pairs)), dtype=torch.float32, device=device)
        self.found = torch.zeros(1, dtype=torch.float32, device=device)
        # Like GradScaler: the reciprocal in double, rounded once to float32.
        self.factor = torch.full((1,), inv_scale, dtype=torch.float32, device=device)

    def fill(self, chunk: list[Piece]) -> list[torch.Tensor]:
        """The chunk's unscaled FP32 gradients, one per piece (scratch views, valid until the next call)."""
        needed = sum(p.hi - p.lo for p in chunk)
        if needed > self.scratch.numel():  # a parameter that may not be cut, larger than a chunk
            self.scratch = torch.empty(needed, dtype=torch.float32, device=self.scratch.device)
        pairs = [self.pairs[piece.index] for piece in chunk]
        if all(piece.whole for piece in chunk):  # every view in one call, not two per parameter
            dst = list(unflatten_dense_tensors(self.scratch[:needed], [master for _, master in pairs]))
        else:
            dst, offset = [], 0
            for piece, (_, master) in zip(chunk, pairs, strict=True):
                view = self.scratch[offset : offset + piece.hi - piece.lo]
                offset += piece.hi - piece.lo
                dst.append(view.view(master.shape) if piece.whole else view)
        src, add_dst, add_src = [], [], []
        for piece, (model_p, _), view in zip(chunk, pairs, dst, strict=True):
            grad = model_p.grad
            if grad is None:
                raise RuntimeError("a gradient disappeared between the inf/NaN check and the step")
            src.append(grad if piece.whole else grad.view(-1)[piece.lo : piece.hi])
            extra = self.extra.get(id(model_p)) if self.extra else None
            if extra is not None:
                add_dst.append(view)
                add_src.append(extra.view(view.shape) if piece.whole else extra.view(-1)[piece.lo : piece.hi])
        copy_and_unscale_(dst, src, self.found, self.factor, add_dst, add_src)
        return dst


def copy_and_unscale_(dst: list[torch.Tensor], src: list[torch.Tensor], found: torch.Tensor, factor: torch.Tensor,
                      add_dst: Sequence[torch.Tensor] = (), add_src: Sequence[torch.Tensor] = ()) -> None:
    """Copy 16-bit ``src`` into FP32 ``dst``, add ``add_src`` into ``add_dst`` (views of ``dst``), then unscale.

    The unscale is ``GradScaler``'s fused kernel with the one-element
    ``factor``; ``found`` becomes nonzero on an inf or NaN. Every FP32
    gradient built from 16-bit ones, a chunk or a whole copy, is made here,
    so they hold the same bits.
    """
    foreach_copy_(dst, src)
    if add_dst:
        foreach_add_(list(add_dst), list(add_src))
    amp_foreach_non_finite_check_and_unscale_(dst, found, factor)


def check_in_chunks(pairs: Sequence[Pair], extra: dict[int, torch.Tensor] | None,
                    inv_scale: float, needs_max: bool, limit: int, keep: bool = False) -> Verdict:
    """Unscale and check the FP32 gradients of ``pairs``, one chunk at a time.

    ``pairs`` are ``(model parameter or other gradient source, FP32
    master)`` on one device, each with a gradient; ``extra`` maps
    ``id(source)`` to an FP32 gradient-merge sum to add first. The model's
    gradients are not changed. With ``keep``, the FP32 gradients are kept
    in the :class:`Verdict` when all of them made one chunk (on CUDA, where
    they fit below the peak already reached: see :func:`room_below_peak`).
    """
    filler = _Filler(pairs, extra, inv_scale, limit)
    maxima = []
    chunks = plan_chunks([m.numel() for _, m in pairs], limit, [_contiguous(p) for p, _ in pairs])
    grads: list[torch.Tensor] = []
    for chunk in chunks:
        grads = filler.fill(chunk)
        if needs_max:
            maxima.append(torch.stack(foreach_norm(grads, math.inf)).max())
    grad_max = torch.stack(maxima).max() if maxima else None
    kept = None
    if keep and len(chunks) == 1:
        kept = CheckedGrads(tuple(id(master) for _, master in pairs), chunks[0], grads)
    return Verdict(filler.found, grad_max, kept)


def steps_in_chunks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped on slices of its parameters (elementwise, not differentiable)."""
    return type(optimizer) in SLICEABLE_OPTIMIZERS and not any(
        g.get("differentiable", False) for g in optimizer.param_groups)


def step_makes_temporaries(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a ``step()`` of ``optimizer`` allocates tensors the size of the parameters it updates.

    Adam and AdamW always do (``exp_avg_sq``'s square root, the update);
    SGD only with weight decay, ``maximize`` or Nesterov momentum (the
    gradient it steps on is then a new tensor), fused, or a tensor learning
    rate (compiled, it multiplies the gradients out of place). Plain SGD,
    with or without momentum, updates in place, for-loop or foreach:
    stepping it in chunks bounds nothing.
    """
    if type(optimizer) is not torch.optim.SGD:
        return True
    return any(g.get("weight_decay", 0) != 0 or g.get("maximize") or g.get("nesterov") or g.get("fused")
               or isinstance(g.get("lr"), torch.Tensor) for g in optimizer.param_groups)


def step_in_chunks(optimizer: torch.optim.Optimizer, pairs: Sequence[Pair],
                   extra: dict[int, torch.Tensor] | None, inv_scale: float, limit: int,
                   into_model: bool = True, kept: CheckedGrads | None = None) -> None:
    """Step ``optimizer`` on the masters of ``pairs`` chunk by chunk and round each chunk into the model.

    Each chunk's FP32 gradients are rebuilt as :func:`check_in_chunks`
    built them, or taken from ``kept``, the gradients that check kept for
    these pairs; the inner optimizer's param groups hold only that chunk's
    masters (or slices of them) while it steps, and are restored after.
    ``optimizer`` must satisfy :func:`steps_in_chunks`. With ``into_model``
    False the masters are not copied anywhere (``pairs`` then need not be
    model parameters: the sharded stages all-gather the masters instead).
    """
    group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    # Masters the optimizer has no state for yet: each of their slices starts from nothing, as the whole would.
    fresh = {id(m) for _, m in pairs if not optimizer.state.get(m)}
    # Per-parameter scalars (Adam's step) as they were before the step: every slice advances its own copy.
    before: dict[int, dict[str, object]] = {}
    if kept is not None and kept.built_for(pairs):
        chunks, filler = [kept.pieces], None
    else:
        filler = _Filler(pairs, extra, inv_scale, limit)
        chunks = plan_chunks([m.numel() for _, m in pairs], limit, [_contiguous(p) for p, _ in pairs])
    for chunk in chunks:
        pieces = [p for p in chunk if id(pairs[p.index][1]) in group_of]
        if not pieces:
            continue
        if filler is None:
            grads = [grad for p, grad in zip(chunk, cast(CheckedGrads, kept).grads, strict=True)
                     if id(pairs[p.index][1]) in group_of]
        else:
            grads = filler.fill(pieces)
        members: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
        slices: list[tuple[Piece, nn.Parameter]] = []
        for piece, grad in zip(pieces, grads, strict=True):
            master = pairs[piece.index][1]
            target = master if piece.whole else _slice_param(optimizer, master, piece, id(master) in fresh, before)
            target.grad = grad
            members[group_of[id(master)]].append(target)
            if not piece.whole:
                slices.append((piece, target))
        _step_with(optimizer, members)
        for piece, target in slices:
            _merge_slice_state(optimizer, pairs[piece.index][1], piece, target)
        if into_model:
            _round_into_model(pairs, pieces)
        for chunk_params in members:
            for target in chunk_params:
                target.grad = None


def step_only(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> None:
    """``optimizer.step()`` with its param groups holding only those of ``params`` they hold (restored after)."""
    wanted = {id(p) for p in params}
    _step_with(optimizer, [[p for p in group["params"] if id(p) in wanted] for group in optimizer.param_groups])


def as_one_step(optimizer: torch.optim.Optimizer, update: Callable[[], None]) -> None:
    """Run ``update``, which steps ``optimizer`` a chunk at a time, as one ``optimizer.step()`` to its hooks.

    torch's step pre-hooks (global ones, then ``optimizer.register_step_pre_hook``'s)
    run once before ``update`` and the post-hooks once after it, with the
    param groups whole, as around one ``step()``; the chunks inside step
    without them, and LR schedulers built on ``optimizer`` see one step.
    Every chunked step (:func:`step_in_chunks`, :func:`step_only`,
    :func:`step_and_free_in_chunks`) runs inside one.
    """
    with_step_hooks(lambda _: update())(optimizer)
    tell_lr_schedulers_it_stepped(optimizer)  # the chunks bypassed the wrapper a scheduler put on optimizer.step


def _step_with(optimizer: torch.optim.Optimizer, members: Sequence[Sequence[nn.Parameter]]) -> None:
    """One chunk's ``step()`` (without step hooks: see :func:`as_one_step`), with param group ``i`` holding
    ``members[i]`` only; the groups are restored after."""
    saved = [list(group["params"]) for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, members, strict=True):
            group["params"][:] = params
        unhooked_step(optimizer)()
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"][:] = params


def step_and_free_in_chunks(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], limit: int) -> None:
    """Step ``optimizer`` on ``params`` a chunk at a time, smallest parameters first, freeing each parameter's
    ``.grad`` once all of it has stepped (those without a gradient, or not in ``optimizer``, are left alone).

    A chunk holds at most ``limit`` elements of this device's tensors (a
    DTensor's local shard): whole parameters, or one slice of a larger one
    (stepped on the local tensors, with the matching slices of its state).
    The gradients exist whole already; what the chunks bound is the inner
    optimizer's temporaries (a for-loop AdamW makes two the size of what it
    updates), and the largest parameters step last, when the other gradients
    are freed. ``optimizer`` must satisfy :func:`steps_in_chunks`, so no
    element's arithmetic depends on what steps with it: the result is
    bitwise one ``optimizer.step()``'s.
    """
    group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
    stepped = (p for p in params if p.grad is not None and id(p) in group_of)
    ordered = sorted(stepped, key=lambda p: _local(p).numel())
    fresh = {id(p) for p in ordered if not optimizer.state.get(p)}
    before: dict[int, dict[str, object]] = {}
    sliceable = [_local(p).is_contiguous() and _local(cast(torch.Tensor, p.grad)).is_contiguous() for p in ordered]
    numels = [_local(p).numel() for p in ordered]
    for chunk in plan_chunks(numels, limit, sliceable):
        if chunk[0].whole:
            step_only(optimizer, [ordered[piece.index] for piece in chunk])
        else:
            piece = chunk[0]
            master = ordered[piece.index]
            target = _slice_param(optimizer, master, piece, id(master) in fresh, before)
            target.grad = _local(cast(torch.Tensor, master.grad)).view(-1)[piece.lo : piece.hi]
            _step_with(optimizer, [[target] if gi == group_of[id(master)] else []
                                   for gi in range(len(optimizer.param_groups))])
            _merge_slice_state(optimizer, master, piece, target)
        for piece in chunk:
            if piece.hi == numels[piece.index]:  # all of it has stepped (whole, or its last slice)
                ordered[piece.index].grad = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the stored tensor itself), or the tensor itself."""
    return dtensor_local(tensor) if isinstance(tensor, DTensor) else tensor


def _contiguous(source: GradSource) -> bool:
    """Whether a slice of ``source``'s gradient (and of the model parameter it is, if so) is a flat range."""
    grad = source.grad
    if isinstance(source, torch.Tensor) and not source.is_contiguous():
        return False  # a channels_last or transposed model parameter is rounded into whole
    return grad is not None and grad.is_contiguous()


def _slice_param(optimizer: torch.optim.Optimizer, master: nn.Parameter, piece: Piece, fresh: bool,
                 before: dict[int, dict[str, object]]) -> nn.Parameter:
    """A parameter viewing ``master``'s elements ``[lo, hi)`` with its state's slices (none if ``fresh``).

    ``before`` keeps, per master, its state's other values as they were
    before its first slice stepped, so that every slice starts from them.
    """
    target = nn.Parameter(_local(master).detach().view(-1)[piece.lo : piece.hi], requires_grad=master.requires_grad)
    whole = optimizer.state.get(master)
    if whole and not fresh:
        kept = before.setdefault(id(master), {k: v.clone() if torch.is_tensor(v) else v
                                              for k, v in whole.items() if not _elementwise(v, master)})
        optimizer.state[target] = {
            k: _local(v).view(-1)[piece.lo : piece.hi] if _elementwise(v, master) else _copy(kept[k])
            for k, v in whole.items()
        }
    return target


def _elementwise(value: object, master: nn.Parameter) -> bool:
    return torch.is_tensor(value) and value.shape == master.shape


def _copy(value: object) -> object:
    return value.clone() if torch.is_tensor(value) else value


def _merge_slice_state(optimizer: torch.optim.Optimizer, master: nn.Parameter, piece: Piece,
                       target: nn.Parameter) -> None:
    """Move a slice's state into ``master``'s: new elementwise tensors into place, scalars as they are."""
    sliced = optimizer.state.pop(target, {})
    whole = optimizer.state[master]
    n = piece.hi - piece.lo
    for key, value in sliced.items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == n and value.numel() != 1:
            if key not in whole or not torch.is_tensor(whole[key]) or whole[key].shape != master.shape:
                # The first step made this state for the slice: the whole tensor (a DTensor for a DTensor master,
                # as the optimizer's own zeros_like makes) is assembled slice by slice.
                whole[key] = torch.empty_like(master.detach(), dtype=value.dtype)
            dest = _local(whole[key]).view(-1)[piece.lo : piece.hi]
            if dest.data_ptr() != value.data_ptr():
                dest.copy_(value)
        elif torch.is_tensor(value) and torch.is_tensor(whole.get(key)) and whole[key].shape == value.shape:
            whole[key].copy_(value)
        else:
            whole[key] = value


def _round_into_model(pairs: Sequence[Pair], pieces: list[Piece]) -> None:
    dst, src = [], []
    for piece in pieces:
        model_p, master = pairs[piece.index]
        assert isinstance(model_p, torch.Tensor), "only model parameters are rounded into"
        if piece.whole:
            dst.append(model_p.data)
            src.append(master.detach())
        else:
            dst.append(model_p.data.view(-1)[piece.lo : piece.hi])
            src.append(master.detach().view(-1)[piece.lo : piece.hi])
    with torch.no_grad():
        foreach_copy_(dst, src)


def holds_rounding_of(low: torch.Tensor, fp32: torch.Tensor) -> bool:
    """Whether ``low`` (16-bit, or FP32) holds exactly ``fp32`` rounded to its dtype.

    A version counter that moved says a tensor was written, not that its
    values changed: torch's ``clip_grad_norm_`` multiplies every gradient in
    place, by 1.0 when the norm is below the limit, and taking those 16-bit
    values back would flush the unscaled gradients below FP16's range (which
    loss scaling exists to keep) to zero. Gradients are taken back whole;
    model parameters written between steps go element by element
    (:func:`adopt_written_values`).
    """
    return torch.equal(low, fp32.to(low.dtype).view_as(low))


def adopt_written_values(low: torch.Tensor, fp32: torch.Tensor) -> bool:
    """Give ``fp32`` the values of ``low`` where ``low`` no longer holds ``fp32`` rounded; whether any changed.

    Element by element, as :func:`holds_rounding_of` decides for the
    whole tensor: an in-place write that changes some elements of a
    parameter (``nn.Embedding(max_norm=...)`` renormalising the rows it
    looked up) takes those into the master (widening is exact) and leaves
    the others' finer FP32 bits alone.
    """
    master = fp32.view_as(low)
    differs = master.to(low.dtype) != low
    if not bool(differs.any()):
        return False
    master.copy_(torch.where(differs, low.to(fp32.dtype), master))
    return True
