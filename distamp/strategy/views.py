"""Read-only views returned by ``strategy.amp_configs``, ``gradient_merge_configs`` and ``sharding_configs``.

Writing into them would be silently lost (the typed config is the source of
truth), so every mutation raises ``TypeError`` and says how to do it instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from distamp.strategy.config_base import Config

__all__ = ["ConfigView"]


def _read_only_message(owner: str, key: Any = None) -> str:
    """Why a view refuses a write, and the assignment that does it."""
    example = f"{{**strategy.{owner}, {key!r}: ...}}" if key is not None else f"{{**strategy.{owner}, 'key': ...}}"
    return (
        f"strategy.{owner} is a read-only view of the effective config; assign a whole dict "
        f"instead, e.g. strategy.{owner} = {example}"
    )


class _ReadOnlyList(list):
    """A list value inside a config view; mutation raises TypeError."""

    def __init__(self, items: Iterable[Any], owner: str, key: str) -> None:
        super().__init__(items)
        self._message = _read_only_message(owner, key)

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(self._message)

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):
        return (list, (list(self),))  # copies are ordinary, editable lists


class ConfigView(dict):
    """The full effective config as a dict; mutation raises TypeError."""

    def __init__(self, config: Config) -> None:
        owner = config._OWNER
        super().__init__(
            (k, _ReadOnlyList(v, owner, k) if isinstance(v, list) else v) for k, v in config.to_dict().items()
        )
        self._owner = owner

    def _refuse(self, key: Any = None, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(_read_only_message(self._owner, key if isinstance(key, str) else None))

    __setitem__ = __delitem__ = setdefault = pop = _refuse

    def update(self, *args, **kwargs):
        self._refuse()

    def clear(self):
        self._refuse()

    def popitem(self):
        self._refuse()

    def _refuse_merge(self, other: Any) -> NoReturn:
        self._refuse()

    # Assigned rather than defined under its own name: mypy checks a def'd __ior__ against
    # dict.__or__'s overloads (typeshed's own dict.__ior__ needs a type: ignore for it).
    __ior__ = _refuse_merge

    def copy(self) -> dict:
        """An ordinary, editable dict (with ordinary lists) to change and assign back."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self.items()}

    def __reduce__(self):
        return (dict, (self.copy(),))
