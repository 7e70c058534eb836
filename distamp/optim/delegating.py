"""The ``torch.optim.Optimizer`` surface of a meta-optimizer, delegated to the inner optimizer.

LR schedulers, hooks and user code that reads ``param_groups``, ``state``
or ``defaults`` see the inner optimizer's objects, so a wrapped optimizer
behaves like the one it wraps wherever AMP does not change anything. The
``state_dict`` hooks are the wrapper's own: they see the meta-optimizer's
state dict (inner state, masters, scale), which is what ``state_dict()``
returns and ``load_state_dict()`` takes.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["DelegatingOptimizer"]

_WRAPPED = "_distamp_wrapped"  # set on an inner optimizer once a meta-optimizer has taken it over


class DelegatingOptimizer(torch.optim.Optimizer):
    """Base of :class:`~distamp.optim.optimizer.AmpOptimizer`: everything torch asks of an optimizer.

    ``torch.optim.Optimizer.__init__`` is deliberately not called: the
    param groups, state and defaults are the inner optimizer's.

    Args:
        optimizer: the inner optimizer.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, is
            already wrapped, or cannot step without a closure
            (``torch.optim.LBFGS``).
        ValueError: ``optimizer`` was taken over by another meta-optimizer
            already (see :meth:`take_over_inner`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, DelegatingOptimizer):
            raise TypeError("optimizer is already an AmpOptimizer; wrap the inner optimizer only once")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if getattr(optimizer, _WRAPPED, False):
            raise ValueError(
                f"this {type(optimizer).__name__} was already given to fleet.distributed_optimizer, which took it "
                "over (in O2 or with sharding its param groups now hold FP32 masters, not the model's parameters) "
                "and returned the AmpOptimizer to train with. Use that one: wrap each torch optimizer once; a new "
                "meta-optimizer needs a new torch optimizer built on the model's parameters"
            )
        if _step_needs_closure(optimizer):
            name = type(optimizer).__name__
            raise TypeError(
                f"{name}.step() needs a closure, which it evaluates several times per step (LBFGS's line search); "
                "distamp's step(closure) runs the closure once, unscales and agrees on inf/NaN over the ranks, then "
                f"steps the inner optimizer without a closure, so it cannot drive {name}. Use an optimizer whose "
                "step() works without a closure (SGD, Adam, AdamW, ...)"
            )
        self.inner_opt = optimizer
        self._state_dict_hooks: dict[str, OrderedDict[int, Callable]] = {
            kind: OrderedDict() for kind in ("state_dict_pre", "state_dict_post", "load_pre", "load_post")}

    def take_over_inner(self) -> None:
        """Mark the inner optimizer as this meta-optimizer's: wrapping it again raises ``ValueError``.

        Called once the inner optimizer has been changed for this wrapper
        (its parameters replaced by masters or slices); a second wrapper
        would take those for the model's parameters and never update the model.
        """
        setattr(self.inner_opt, _WRAPPED, True)

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

    def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        """``hook(optimizer)`` runs before ``state_dict()`` (and ``local_state_dict()``) builds the state."""
        return self._add_state_dict_hook("state_dict_pre", hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        """``hook(optimizer, state_dict)`` runs on the built state; a dict it returns replaces it, as torch's."""
        return self._add_state_dict_hook("state_dict_post", hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        """``hook(optimizer, state_dict)`` runs before :meth:`load_state_dict`; a dict it returns is loaded instead."""
        return self._add_state_dict_hook("load_pre", hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:
        """``hook(optimizer)`` runs after :meth:`load_state_dict` has loaded, as torch's."""
        return self._add_state_dict_hook("load_post", hook, prepend)

    def _add_state_dict_hook(self, kind: str, hook: Callable, prepend: bool) -> RemovableHandle:
        hooks = self._state_dict_hooks[kind]
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        if prepend:
            hooks.move_to_end(handle.id, last=False)
        return handle

    def _with_state_dict_hooks(self, build: Callable[[], dict]) -> dict:
        """``build()`` (the state dict) with the state_dict pre- and post-hooks around it."""
        for hook in list(self._state_dict_hooks["state_dict_pre"].values()):
            hook(self)
        state_dict = build()
        for hook in list(self._state_dict_hooks["state_dict_post"].values()):
            replaced = hook(self, state_dict)
            state_dict = state_dict if replaced is None else replaced
        return state_dict

    def _with_load_hooks(self, state_dict: dict, load: Callable[[dict], None]) -> None:
        """``load(state_dict)`` with the load_state_dict pre- and post-hooks around it."""
        for hook in list(self._state_dict_hooks["load_pre"].values()):
            replaced = hook(self, state_dict)
            state_dict = state_dict if replaced is None else replaced
        load(state_dict)
        for hook in list(self._state_dict_hooks["load_post"].values()):
            hook(self)

    def __getstate__(self) -> dict:
        raise TypeError(f"{type(self).__name__} is not picklable; save optimizer.state_dict() instead")


def _step_needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` has an argument without a default (LBFGS's ``closure``)."""
    try:
        # The class's step (through torch's hook wrapper to the function it wraps), not the bound attribute,
        # which an LR scheduler may have replaced by a wrapper of its own.
        signature = inspect.signature(type(optimizer).step)
    except (TypeError, ValueError):  # no signature to read: assume the usual step(self, closure=None)
        return False
    after_self = list(signature.parameters.values())[1:]
    return any(p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
               for p in after_self)
