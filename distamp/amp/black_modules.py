"""Black-listed modules (``custom_black_varnames``): submodules kept entirely in FP32.

Example::

    handle = keep_in_fp32(model, ["head", "encoder.*.norm"])
    with auto_cast(dtype="float16"):
        out = model(x)      # "head" and the norms compute in FP32, outputs FP32
    handle.remove()         # back to plain auto_cast behaviour

A pattern names a module by its qualified name (as in ``model.named_modules()``;
for a compiled model, of the model inside it: see
:mod:`distamp.strategy.name_patterns`), either exactly or as an
:mod:`fnmatch` pattern; a matched module's whole subtree is black: its
floating-point inputs are cast to FP32 and autocast is switched off while
it runs, so every op inside computes in FP32 and its outputs are FP32. O2
leaves these subtrees' parameters in FP32 (see
:func:`distamp.amp.fp32_parameters.fp32_parameters`).

The module's ``forward`` is wrapped (an instance attribute, as
``accelerate`` does), not hooked: ``torch.compile`` traces the wrapper, and
``copy.deepcopy`` of the model gives the copy a wrapper bound to the copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distamp.amp.fp32_requests import FP32_REQUESTS
from distamp.model_views import unwrap_model
from distamp.strategy.checks import is_name, show
from distamp.strategy.name_patterns import ModulePatterns
from distamp.torch_compat import tree_map_only

if TYPE_CHECKING:
    # typing.Self is Python 3.11+; mypy checks for 3.10 (setup.cfg).
    import typing_extensions

__all__ = ["BlackModulesHandle", "FP32Forward", "autocast_device_types", "find_black_modules", "keep_in_fp32"]

def _check_patterns(patterns: Any) -> list[str]:
    """The patterns as a list (a single string is one pattern); anything else raises TypeError."""
    if isinstance(patterns, str):
        return [patterns]
    if not isinstance(patterns, Iterable):
        raise TypeError(
            f"custom_black_varnames must be a list of module-name patterns, got {show(patterns)}"
        )
    patterns = list(patterns)
    for pattern in patterns:
        if not is_name(pattern):
            raise TypeError(
                f"custom_black_varnames must hold non-empty strings, got {show(pattern)} in "
                f"{show(patterns)}"
            )
    return patterns


def find_black_modules(model: nn.Module, patterns: Iterable[str]) -> list[tuple[str, nn.Module]]:
    """Return the topmost submodules of ``model`` matched by ``patterns``.

    Args:
        model: the model whose ``named_modules()`` names are matched (the
            root's name is ``""``); inside ``torch.compile`` / data-parallel
            wrappers, the names of the model inside them
            (:func:`~distamp.model_views.unwrap_model`).
        patterns: qualified module names or fnmatch patterns, e.g.
            ``["head", "blocks.*.norm"]``.

    Returns:
        ``(name, module)`` pairs in ``named_modules()`` order, one per module,
        named as in the model inside any wrappers; a match inside an already
        matched subtree is left out.

    Raises:
        ValueError: a pattern matches no module; the message suggests the
            closest name and lists some available ones.
    """
    patterns = _check_patterns(patterns)
    if not patterns:
        return []
    named = list(unwrap_model(model).named_modules(remove_duplicate=False))
    matcher = ModulePatterns(model, [name for name, _ in named], patterns, "custom_black_varnames")
    chosen: list[tuple[str, nn.Module]] = []
    chosen_prefixes: list[str] = []
    seen: set[int] = set()
    for name, module in named:
        if any(name.startswith(prefix) for prefix in chosen_prefixes):
            continue
        if matcher.matches(name):
            # The root's name is "": everything is then under it.
            chosen_prefixes.append(f"{name}." if name else "")
            if id(module) not in seen:
                seen.add(id(module))
                chosen.append((name, module))
    return chosen


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() and t.dtype.itemsize < 4 else t


def autocast_device_types() -> tuple[str, ...]:
    """Device types whose autocast a black module switches off: the CPU, and CUDA when present."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


class FP32Forward:
    """A module's ``forward`` run in FP32: inputs cast up, autocast off.

    Stored as the module's ``forward`` instance attribute by
    :func:`keep_in_fp32`. It keeps a reference to the module (not to a bound
    method), so a deep copy of the model calls the copy's forward.

    Args:
        module: the module to run in FP32.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # An instance-level forward set before ours (another wrapper) is kept and called.
        self.inner = module.__dict__.get("forward")
        self.device_types = autocast_device_types()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, _to_fp32, (args, kwargs))
        forward = self.inner
        if forward is None:
            # The class's forward called with the module as self: torch 2.11's dynamo cannot trace
            # binding it with function.__get__ (a graph break there).
            forward, args = type(self.module).forward, (self.module, *args)
        if any(torch.is_autocast_enabled(device_type) for device_type in self.device_types):
            FP32_REQUESTS.record()
        with torch.autocast("cpu", enabled=False):
            if "cuda" not in self.device_types:
                return forward(*args, **kwargs)
            with torch.autocast("cuda", enabled=False):
                return forward(*args, **kwargs)


class BlackModulesHandle:
    """Keeps some submodules in FP32; :meth:`remove` puts their forwards back."""

    def __init__(self, modules: list[tuple[str, nn.Module]]):
        self.modules = modules
        self._wrapped: list[tuple[nn.Module, FP32Forward]] = []
        for _, module in modules:
            wrapper = FP32Forward(module)
            module.forward = wrapper
            self._wrapped.append((module, wrapper))

    @property
    def names(self) -> list[str]:
        """Qualified names of the black modules."""
        return [name for name, _ in self.modules]

    def remove(self) -> None:
        """Restore each module's previous ``forward``; they behave as before :func:`keep_in_fp32`."""
        for module, wrapper in self._wrapped:
            if module.__dict__.get("forward") is wrapper:
                if wrapper.inner is None:
                    del module.forward
                else:
                    module.forward = wrapper.inner
        self._wrapped.clear()

    def __enter__(self) -> typing_extensions.Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"BlackModulesHandle(names={self.names!r}, active={bool(self._wrapped)})"


def keep_in_fp32(model: nn.Module, patterns: Iterable[str]) -> BlackModulesHandle:
    """Run the submodules matched by ``patterns`` in FP32.

    Each topmost matched module (see :func:`find_black_modules`) gets a
    :class:`FP32Forward`: its floating-point inputs (positional and keyword,
    inside lists, tuples and dicts) are cast to float32 and autocast is off
    while it runs, so every op inside computes in FP32. Outputs stay FP32.

    This does not convert parameters: under O1 they are FP32 already, and O2
    leaves these subtrees' parameters in FP32.

    Args:
        model: the model.
        patterns: qualified module names or fnmatch patterns.

    Returns:
        A :class:`BlackModulesHandle`; its ``remove()`` undoes everything. It is
        also a context manager that removes the wrappers on exit.

    Raises:
        ValueError: a pattern matches no module.
    """
    return BlackModulesHandle(find_black_modules(model, patterns))
