"""The ``torch.optim.Optimizer`` surface of a meta-optimizer, delegated to the inner optimizer.

LR schedulers, hooks and user code that reads ``param_groups``, ``state``
or ``defaults`` see the inner optimizer's objects, so a wrapped optimizer
behaves like the one it wraps wherever AMP does not change anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DelegatingOptimizer"]


class DelegatingOptimizer(torch.optim.Optimizer):
    """Base of :class:`~distamp.optim.optimizer.AmpOptimizer`: everything torch asks of an optimizer.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: the
    param groups, state and defaults are the inner optimizer's.

    Args:
        optimizer: the inner optimizer.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or is
            already wrapped.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, DelegatingOptimizer):
            raise TypeError("optimizer is already an AmpOptimizer; wrap the inner optimizer only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.inner_opt = optimizer

    # torch.optim.Optimizer declares param_groups/state/defaults as assignable attributes; this wrapper
    # deliberately exposes the inner optimizer's as read-only views (a setter would let the two diverge).
    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        """The inner optimizer's param groups (FP32 masters in O2)."""
        return self.inner_opt.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-parameter state (keyed by master)."""
        return self.inner_opt.state

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        """The inner optimizer's defaults."""
        return self.inner_opt.defaults

    def register_step_pre_hook(self, hook: Callable) -> Any:
        """Register a hook on the inner optimizer that runs once before each applied step (never on a skipped one).

        It runs once even where the update steps the inner optimizer a chunk
        at a time (O2, sharding), and sees the whole param groups.
        """
        return self.inner_opt.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable) -> Any:
        """Register a hook on the inner optimizer that runs once after each applied step (never on a skipped one).

        It runs once even where the update steps the inner optimizer a chunk
        at a time (O2, sharding), and sees the whole param groups.
        """
        return self.inner_opt.register_step_post_hook(hook)

    def __getstate__(self) -> dict:
        raise TypeError(f"{type(self).__name__} is not picklable; save optimizer.state_dict() instead")
