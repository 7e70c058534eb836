"""Error-message helpers: typo suggestions, and long lists cut short.

Every "unknown key / op / attribute" error in distamp ends with the closest
valid name, so ``init_loss_scale`` points the user at ``init_loss_scaling``::

    >>> did_you_mean("init_loss_scale", ["init_loss_scaling", "incr_ratio"])
    " Did you mean 'init_loss_scaling'?"
    >>> did_you_mean("zzz", ["init_loss_scaling"])
    ''
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["did_you_mean", "listed"]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest of ``choices``, else ``""``.

    Args:
        word: the name the user wrote. Anything that is not a ``str`` (a
            dict key may be ``None`` or bytes) gets no suggestion.
        choices: the valid names; non-``str`` entries are ignored.

    The result starts with a space so it can be appended to a sentence.
    """
    if not isinstance(word, str):
        return ""
    names = sorted({c for c in choices if isinstance(c, str)})
    match = difflib.get_close_matches(word, names, n=1)
    if not match:
        # difflib's ratio punishes case differences; "Init_Loss_Scaling"
        # should still find its key.
        by_lower = {n.lower(): n for n in names}
        lowered = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
        match = [by_lower[m] for m in lowered]
    return f" Did you mean {match[0]!r}?" if match else ""


def listed(items: Sequence[str], limit: int) -> str:
    """``"a, b, c"``, or ``"a, b, c and 4 more"`` when ``items`` holds more than ``limit``.

    >>> listed(["'a'", "'b'", "'c'"], 2)
    "'a', 'b' and 1 more"
    """
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
