"""Where an inf came from: per-parameter attribution of skipped steps.

When a step is skipped, the question is which layer overflowed.
:func:`nonfinite_parameters` answers it with one fused kernel over the
reduced gradients (a per-tensor max-abs norm), and one all-reduce (MAX) of
the per-parameter verdicts, so every rank names the same parameters even
when the inf appeared on one rank only after communication. It runs only
on skipped steps: applied steps pay nothing.

:class:`OverflowLog` keeps ``last_overflow`` for ``optimizer.stats()``,
logs one warning line per skipped step, and once a module keeps showing up
suggests keeping it in FP32 with ``custom_black_varnames``. Only overflows at
a loss scale that could not fall count toward that hint (at
``min_loss_scaling``, or a fixed scale: BF16, or dynamic scaling off): while
the scale is still backing off from a value too high for the model (e.g.
``init_loss_scaling`` 2**24), every gradient overflows because of the scale,
not because of a module, and blaming the first layers would send the user
after the wrong fix.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distamp.distributed.flag_sync import all_reduce_max
from distamp.torch_compat import foreach_norm

__all__ = ["SUGGEST_AFTER", "OverflowLog", "nonfinite_parameters"]

logger = logging.getLogger("distamp")

SUGGEST_AFTER = 5
"""Skipped steps naming the same module, at a scale that could not fall, before the log suggests
``custom_black_varnames`` for it."""

_SHOWN_NAMES = 6


def nonfinite_parameters(
    params: Sequence[nn.Parameter],
    names: Sequence[str],
    group: dist.ProcessGroup | None,
    grads: Sequence[tuple[int, torch.Tensor]] | None = None,
) -> list[str]:
    """Names of ``params`` whose gradient is non-finite on any rank of ``group`` (same list on every rank).

    Args:
        params: the parameters whose gradients the step applies.
        names: their qualified names, in the same order.
        group: the data-parallel group (``None``: this rank only).
        grads: ``(index into params, tensor)`` pairs holding this rank's
            reduced gradients (see ``reduced_grads()`` of the masters: under
            sharding, the pieces of this rank's slice); ``None``: each ``.grad``.
    """
    if not params:
        return []
    if grads is None:
        grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
    device = grads[0][1].device if grads else params[0].device
    flags = torch.zeros(len(params), dtype=torch.float32, device=device)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for i, grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append((i, grad))
    for members in groups.values():
        maxima = torch.stack(foreach_norm([grad for _, grad in members], math.inf)).float()
        indices = torch.tensor([i for i, _ in members], device=device)
        flags.scatter_reduce_(0, indices, (~torch.isfinite(maxima)).float().to(device), reduce="amax")
    all_reduce_max(flags, group)
    return [names[i] for i in torch.nonzero(flags).flatten().tolist()]


def _module_of(name: str) -> str:
    """The qualified name of the module holding parameter ``name`` (``""``: the model's root)."""
    return name.rpartition(".")[0]


def _times(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


class OverflowLog:
    """``last_overflow``, counts, a warning line per skipped step, and the ``custom_black_varnames`` hint."""

    def __init__(self) -> None:
        self.last_overflow: dict | None = None
        self.overflows = 0
        self._module_counts: collections.Counter[str] = collections.Counter()
        self._suggested: set[str] = set()

    def record(self, step: int, names: list[str], loss_scale: float, retrying: bool = False,
               scale_falls: bool = False) -> None:
        """One non-finite verdict at ``step``: remember it, log it, maybe suggest FP32 for a module.

        Args:
            step: the step's number.
            names: the parameters whose reduced gradient is non-finite.
            loss_scale: the scale the step ran at.
            retrying: the step is retried at a lower scale (``overflow_retries``).
            scale_falls: the loss scaler lowers (or lowered) the scale in answer to
                this overflow. Such an overflow may be the scale's doing, so
                it does not count toward the module hint; a retry always
                lowered the scale.
        """
        self.overflows += 1
        self.last_overflow = {"step": step, "params": list(names)}
        more = len(names) - _SHOWN_NAMES
        shown = ", ".join(names[:_SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")
        action = "retried at a lower loss scale" if retrying else "skipped"
        logger.warning(
            "step %d %s: non-finite gradients in %s (loss scale %g)", step, action, shown or "no parameter", loss_scale
        )
        if retrying or scale_falls:
            return
        for module in dict.fromkeys(_module_of(n) for n in names):
            self._module_counts[module] += 1
            if self._module_counts[module] >= SUGGEST_AFTER and module not in self._suggested:
                self._suggested.add(module)
                self._suggest(module, names, self._module_counts[module], loss_scale)

    @staticmethod
    def _suggest(module: str, names: list[str], count: int, loss_scale: float) -> None:
        seen = f"{_times(count, 'skipped step')} at a loss scale that could not go lower ({loss_scale:g})"
        if module:
            logger.warning(
                "module %r had non-finite gradients in %s; if it keeps overflowing, run it in FP32: "
                "strategy.amp_configs = {..., 'custom_black_varnames': [%r]}",
                module, seen, module,
            )
            return
        params = [n for n in names if "." not in n]
        logger.warning(
            "the model's own parameters %s (of its root module, not of a submodule) had non-finite gradients in "
            "%s; custom_black_varnames names submodules and cannot keep the root in FP32. Move them into a "
            "submodule and list that one in custom_black_varnames, or train with amp_configs['dtype'] = "
            "'bfloat16', whose range is FP32's",
            ", ".join(repr(n) for n in params), seen,
        )

    def copy_of_last(self) -> dict | None:
        """A copy of ``last_overflow`` that the caller may change without changing this log's."""
        last = self.last_overflow
        return None if last is None else {"step": last["step"], "params": list(last["params"])}

    def state_dict(self) -> dict:
        """Counts as plain numbers (``last_overflow`` is diagnostic and not saved)."""
        return {"overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s counts."""
        self.overflows = int(state.get("overflows", 0))
