"""The error every ``distrun`` argument check raises, and the shared integer check."""

from __future__ import annotations

__all__ = ["UsageError", "at_least"]


class UsageError(ValueError):
    """Bad command-line input; ``distrun`` exits with code 2 and this message."""


def at_least(flag: str, value: int, minimum: int) -> int:
    """``value`` when it is at least ``minimum``; else a UsageError naming ``flag``."""
    if value < minimum:
        raise UsageError(f"{flag} {value!r} is invalid: it must be an integer >= {minimum}.")
    return value
