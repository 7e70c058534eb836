"""Black-listed modules (``custom_black_varnames``): submodules kept entirely in FP32.

Example::

    handle = keep_in_fp32(model, ["head", "encoder.*.norm"])
    with auto_cast(dtype="float16"):
        out = model(x)      # "head" and the norms compute in FP32, outputs FP32
    handle.remove()         # back to plain auto_cast behaviour

A pattern names a module by its qualified name (as in ``model.named_modules()``),
either exactly or as an :mod:`fnmatch` pattern; a matched module's whole
subtree is black. O2 code uses :func:`find_black_modules` to leave these
subtrees' parameters in FP32.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distamp.amp.auto_cast import enter_fp32_region, exit_fp32_region
from distamp.suggest import did_you_mean

if TYPE_CHECKING:
    from typing import Self

__all__ = ["BlackModulesHandle", "find_black_modules", "keep_in_fp32"]

_SHOWN_NAMES = 8


def _check_patterns(patterns: Any) -> list[str]:
    if isinstance(patterns, str):
        return [patterns]
    if not isinstance(patterns, Iterable):
        raise TypeError(
            f"custom_black_varnames must be a list of module-name patterns, got {patterns!r}"
        )
    patterns = list(patterns)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(
                f"custom_black_varnames must hold non-empty strings, got {pattern!r} in "
                f"{patterns!r}"
            )
    return patterns


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def find_black_modules(model: nn.Module, patterns: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """Return the topmost submodules of ``model`` matched by ``patterns``.

    Args:
        model: the model whose ``named_modules()`` names are matched (the
            root's name is ``""``).
        patterns: qualified module names or fnmatch patterns, e.g.
            ``["head", "blocks.*.norm"]``.

    Returns:
        ``(name, module)`` pairs in ``named_modules()`` order, one per module;
        a match inside an already matched subtree is left out.

    Raises:
        ValueError: a pattern matches no module; the message suggests the
            closest name and lists some available ones.
    """
    patterns = _check_patterns(patterns)
    if not patterns:
        return []
    named = list(model.named_modules(remove_duplicate=False))
    unmatched = [p for p in patterns if not any(_matches(name, p) for name, _ in named)]
    if unmatched:
        names = [name for name, _ in named if name]
        shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
        more = f" and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else ""
        raise ValueError(
            f"custom_black_varnames pattern {unmatched[0]!r} matches no submodule of "
            f"{type(model).__name__}.{did_you_mean(unmatched[0], names)} Patterns are "
            f"qualified names from model.named_modules() or fnmatch patterns; available: "
            f"{shown}{more}."
        )
    chosen: list[tuple[str, nn.Module]] = []
    chosen_prefixes: list[str] = []
    seen: set[int] = set()
    for name, module in named:
        if any(name.startswith(prefix) for prefix in chosen_prefixes):
            continue
        if any(_matches(name, p) for p in patterns):
            # The root's name is "": everything is then under it.
            chosen_prefixes.append(f"{name}." if name else "")
            if id(module) not in seen:
                seen.add(id(module))
                chosen.append((name, module))
    return chosen


def _to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dtype.is_floating_point and obj.dtype.itemsize < 4:
            return obj.to(torch.float32)
        return obj
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_fp32(item) for item in obj)
    if type(obj) is dict:
        return {key: _to_fp32(value) for key, value in obj.items()}
    return obj


class BlackModulesHandle:
    """Hooks that keep some submodules in FP32; :meth:`remove` takes them off."""

    def __init__(self, modules: list[tuple[str, nn.Module]]):
        self.modules = modules
        # Per-thread stack of (module, saved auto_cast state): one entry per
        # black module currently running, so nesting and recursion unwind
        # in order.
        self._local = threading.local()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for _, module in modules:
            self._handles.append(
                module.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)
            )
            self._handles.append(
                module.register_forward_hook(self._exit, always_call=True, prepend=True)
            )

    @property
    def names(self) -> list[str]:
        """Qualified names of the black modules."""
        return [name for name, _ in self.modules]

    def _stack(self) -> list[tuple[nn.Module, object]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = _to_fp32(args), _to_fp32(kwargs)
        self._stack().append((module, enter_fp32_region()))
        return args, kwargs

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        # With always_call=True this also runs when forward raised, and even
        # when an earlier pre-hook raised before ours pushed anything.
        if stack and stack[-1][0] is module:
            exit_fp32_region(stack.pop()[1])

    def remove(self) -> None:
        """Remove the hooks; the modules behave as before :func:`keep_in_fp32`."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"BlackModulesHandle(names={self.names!r}, active={bool(self._handles)})"


def keep_in_fp32(model: nn.Module, patterns: Iterable[str]) -> BlackModulesHandle:
    """Run the submodules matched by ``patterns`` in FP32.

    Each topmost matched module (see :func:`find_black_modules`) gets a
    forward pre-hook that casts its floating-point inputs (positional and
    keyword, inside lists, tuples and dicts) to float32 and suspends
    low-precision casting of :class:`~distamp.amp.auto_cast.auto_cast` while
    it runs (white ops run in FP32 there), and a forward hook, called even
    when the forward raises, that restores casting. Outputs stay FP32.

    This does not convert parameters: under O1 they are FP32 already, and O2
    leaves these subtrees' parameters in FP32.

    Args:
        model: the model.
        patterns: qualified module names or fnmatch patterns.

    Returns:
        A :class:`BlackModulesHandle`; its ``remove()`` undoes everything. It is
        also a context manager that removes the hooks on exit.

    Raises:
        ValueError: a pattern matches no module.
    """
    return BlackModulesHandle(find_black_modules(model, patterns))
