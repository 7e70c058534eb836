"""Paddle's ``custom_white_list`` / ``custom_black_list`` layered on ``torch.autocast``.

``torch.autocast`` decides per op and per device which ops run in low
precision; its lists are torch's own and are the defaults. A user who needs
one op moved (a ``softmax`` that must stay in FP32, a custom kernel that
should run in BF16) names it in a custom list, and :class:`OpListMode`, a
:class:`~torch.overrides.TorchFunctionMode`, changes just those ops::

    with torch.autocast("cpu", dtype=torch.bfloat16), OpListMode("cpu", torch.bfloat16,
                                                               white=frozenset(), black={"gelu"}):
        y = model(x)          # gelu in FP32, everything else as torch.autocast decides

A listed op gets its floating-point inputs cast to the target dtype
(``float32`` for the black list, the autocast dtype for the white list) and
runs with autocast switched off, so torch's own list cannot cast it back and
every op inside a composite op follows the same dtype (``batch_norm``'s
weight and bias keep the dtype of its running statistics, which it updates in
place). Casts are ordinary
differentiable ``Tensor.to`` calls above autograd, so gradients reach each
input in its own dtype. The mode only acts while autocast is enabled for its
device: inside a ``custom_black_varnames`` module, or a nested
``auto_cast(enable=False)``, it does nothing.

Costs: the mode exists only when a custom list is non-empty. Then every torch
call in the region pays one Python call and a dictionary lookup (about a
microsecond); only listed ops are cast. ``torch.compile`` traces the mode and
bakes the casts into the graph (no graph break).

Limits: a Python-level composite (``F.multi_head_attention_forward``) is seen
as one call, so a listed op *inside* it is not moved. Activation
checkpointing recomputes outside the mode: pass
``context_fn=checkpoint_context_fn`` to ``torch.utils.checkpoint`` (eager
mode, ``use_reentrant=False``) so the recomputation sees the same lists.
``use_reentrant=True`` has no ``context_fn``: it recomputes listed ops in
torch's dtype, and the block's gradients differ silently; do not combine it
with custom lists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distamp.amp.fp32_requests import FP32_REQUESTS
from distamp.strategy.op_names import expand_op_names, functions_named
from distamp.torch_compat import current_function_mode_stack, tree_map_only

__all__ = ["OpListMode", "checkpoint_context_fn"]

# Arguments that ops update in place: casting them would write into a copy.
_MUTATED_POSITIONS: dict[Callable[..., Any], tuple[int, ...]] = {
    F.batch_norm: (1, 2),
    F.instance_norm: (1, 2),
    torch.batch_norm: (3, 4),
    torch.instance_norm: (3, 4),
}
_MUTATED_KWARGS = frozenset({"out", "running_mean", "running_var"})
# batch_norm's kernels take a 16-bit input with FP32 weight, bias and running statistics (as
# torch.autocast runs BatchNorm), but not a 16-bit weight with FP32 statistics, and the statistics
# are updated in place, so never cast: weight and bias keep the statistics' dtype.
_AFFINE_POSITIONS: dict[Callable[..., Any], tuple[int, ...]] = {
    F.batch_norm: (3, 4),
    torch.batch_norm: (1, 2),
}
_AFFINE_KWARGS = frozenset({"weight", "bias"})


class OpListMode(TorchFunctionMode):
    """Run the ops named in ``white`` in ``dtype`` and those in ``black`` in FP32.

    Args:
        device_type: the autocast device type this mode follows (``"cpu"``,
            ``"cuda"``); it acts only while autocast is enabled there.
        dtype: the low-precision dtype for white-listed ops.
        white: op names (see :mod:`distamp.strategy.op_names`; aliases such as
            ``"conv"`` are expanded) forced to ``dtype``.
        black: op names forced to ``float32``. Must not overlap ``white``.

    Raises:
        ValueError: an op is on both lists.
    """

    def __init__(self, device_type: str, dtype: torch.dtype, white: frozenset[str], black: frozenset[str]) -> None:
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        self.white = expand_op_names(white)
        self.black = expand_op_names(black)
        both = self.white & self.black
        if both:
            raise ValueError(f"ops {sorted(both)!r} are on both the white and the black list; keep each on one list")
        # The callables themselves, resolved once: matching is a set lookup per call, which
        # torch.compile traces (in-place forms have other names and are never in these sets).
        self._white_funcs = functions_named(self.white)
        self._black_funcs = functions_named(self.black)

    def copy(self) -> OpListMode:
        """A fresh mode with the same lists (a mode object is pushed once at a time)."""
        return OpListMode(self.device_type, self.dtype, self.white, self.black)

    def _target(self, func: Any) -> torch.dtype | None:
        if func in self._black_funcs:
            return torch.float32
        if func in self._white_funcs:
            return self.dtype
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self._target(func)
        if target is None or kwargs.get("out") is not None or not torch.is_autocast_enabled(self.device_type):
            return func(*args, **kwargs)
        if target is torch.float32:
            FP32_REQUESTS.record()
        args, kwargs = _cast_inputs(func, args, kwargs, target)
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"OpListMode(device_type={self.device_type!r}, dtype={self.dtype}, "
                f"white={sorted(self.white)!r}, black={sorted(self.black)!r})")


def _cast_inputs(func: Any, args: tuple, kwargs: dict, target: torch.dtype) -> tuple[tuple, dict]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == target or t.dtype == torch.float64:
            return t
        if target == torch.float32 and t.dtype.itemsize >= 4:
            return t
        return t.to(target)

    protected = _MUTATED_POSITIONS.get(func, ())
    kept_kwargs = _MUTATED_KWARGS
    if func in _AFFINE_POSITIONS and _statistics_dtype(args, kwargs, protected) not in (None, target):
        protected = protected + _AFFINE_POSITIONS[func]
        kept_kwargs = kept_kwargs | _AFFINE_KWARGS
    new_args = tuple(a if i in protected else tree_map_only(torch.Tensor, cast, a) for i, a in enumerate(args))
    new_kwargs = {k: v if k in kept_kwargs else tree_map_only(torch.Tensor, cast, v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _statistics_dtype(args: tuple, kwargs: dict, positions: tuple[int, ...]) -> torch.dtype | None:
    """The dtype of a norm op's running statistics (``None`` without them)."""
    stats = [args[i] for i in positions if i < len(args)]
    stats += [kwargs.get("running_mean"), kwargs.get("running_var")]
    return next((t.dtype for t in stats if isinstance(t, torch.Tensor)), None)


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that replays the custom op lists.

    ``torch.utils.checkpoint(fn, x, use_reentrant=False)`` restores the
    autocast state when it recomputes ``fn`` during backward, but not torch
    function modes, so ops moved by a custom list would be recomputed in
    another dtype and checkpointing fails with "Recomputed values ... have
    different metadata". With custom lists, call::

        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                          context_fn=checkpoint_context_fn)

    Without custom lists it is not needed (and returns two null contexts).
    torch.compile accepts only selective-checkpointing ``context_fn``\\ s, so
    use it in eager mode.
    """
    modes = [m for m in current_function_mode_stack() if isinstance(m, OpListMode)]
    recompute = modes[-1].copy() if modes else contextlib.nullcontext()
    return contextlib.nullcontext(), recompute
