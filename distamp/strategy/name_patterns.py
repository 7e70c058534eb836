"""Module-name patterns (``custom_black_varnames``, ``sharding_configs["units"]``) matched against a model.

Names are those of the user's module inside compile and data-parallel
wrappers (:func:`~distamp.model_views.unwrap_model`): ``"head"`` on
``torch.compile(model)`` as on ``model``. A pattern that matches none of them
but matches the name as the wrapper spells it (``"_orig_mod.head"``, from
``named_modules()`` of the compiled model) is matched in that spelling, so
patterns written for the wrapper keep working; the user's names are tried
first, so a pattern never matches by both spellings.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from distamp.model_views import unwrap_model, wrapper_prefix
from distamp.suggest import did_you_mean, listed

__all__ = ["ModulePatterns", "name_matches"]

_SHOWN_NAMES = 8


def name_matches(name: str, pattern: str) -> bool:
    """Whether the qualified module ``name`` is ``pattern`` or matches it as an fnmatch pattern."""
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


class ModulePatterns:
    """``patterns`` checked against the user's module names in ``model``; :meth:`matches` says which they name.

    Args:
        model: the model, possibly inside compile / data-parallel wrappers.
        names: qualified names of modules of ``unwrap_model(model)`` that
            the patterns may name (the root's ``""`` is matched but not shown).
        patterns: qualified names or fnmatch patterns.
        key: the setting the patterns come from, for the error.
        listing: what the error calls the list of names it shows.

    Raises:
        ValueError: naming ``key``, the first pattern that matches none of
            ``names`` in either spelling, the closest name and some of the
            available ones.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], patterns: Iterable[str], key: str,
                 listing: str = "available") -> None:
        self._prefix = wrapper_prefix(model)
        self._users: list[str] = []  # patterns of the user's names
        self._wrapped: list[str] = []  # patterns of the wrapper's spelling of them
        for pattern in patterns:
            if any(name_matches(name, pattern) for name in names):
                self._users.append(pattern)
            elif self._prefix and any(name_matches(self._wrapper_spelling(name), pattern) for name in names):
                self._wrapped.append(pattern)
            else:
                shown_names = [name for name in names if name]
                shown = listed([repr(n) for n in shown_names], _SHOWN_NAMES)
                raise ValueError(
                    f"{key} pattern {pattern!r} matches no submodule of "
                    f"{type(unwrap_model(model)).__name__}.{did_you_mean(pattern, shown_names)} Patterns are "
                    f"qualified names from model.named_modules() or fnmatch patterns; {listing}: {shown}."
                )

    def _wrapper_spelling(self, name: str) -> str:
        return f"{self._prefix}{name}" if name else self._prefix[:-1]

    def matches(self, name: str) -> bool:
        """Whether a pattern names the module called ``name`` in the user's module."""
        return (any(name_matches(name, p) for p in self._users)
                or any(name_matches(self._wrapper_spelling(name), p) for p in self._wrapped))
