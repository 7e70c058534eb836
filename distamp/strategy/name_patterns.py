"""Module-name patterns (``custom_black_varnames``, ``sharding_configs["units"]``) matched against a model."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from distamp.suggest import did_you_mean, listed

__all__ = ["check_patterns_match", "name_matches"]

_SHOWN_NAMES = 8


def name_matches(name: str, pattern: str) -> bool:
    """Whether the qualified module ``name`` is ``pattern`` or matches it as an fnmatch pattern."""
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def check_patterns_match(model: nn.Module, names: Sequence[str], patterns: Iterable[str], key: str,
                         listing: str = "available") -> None:
    """Refuse the first of ``patterns`` that matches none of ``names`` (module names of ``model``).

    Raises:
        ValueError: naming ``key``, the pattern, the closest name and, after
            ``listing``, some of the available ones (the root's ``""`` is
            matched but not shown).
    """
    for pattern in patterns:
        if not any(name_matches(name, pattern) for name in names):
            shown_names = [name for name in names if name]
            shown = listed([repr(n) for n in shown_names], _SHOWN_NAMES)
            raise ValueError(
                f"{key} pattern {pattern!r} matches no submodule of "
                f"{type(model).__name__}.{did_you_mean(pattern, shown_names)} Patterns are "
                f"qualified names from model.named_modules() or fnmatch patterns; {listing}: {shown}."
            )
