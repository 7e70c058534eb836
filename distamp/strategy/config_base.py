"""What the config dataclasses share: building from a dict (typo hints included) and back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar

from distamp.strategy.checks import show
from distamp.suggest import did_you_mean

if TYPE_CHECKING:
    from dataclasses import Field

    # typing.Self is Python 3.11+; mypy checks for 3.10 (setup.cfg).
    import typing_extensions

__all__ = ["Config"]


class Config:
    """Dict conversion shared by the config dataclasses.

    Subclasses are frozen dataclasses that set ``_OWNER`` (how messages name
    them, e.g. ``"amp_configs"``) and may set ``_RETIRED``: Paddle keys
    distamp does not implement, mapped to advice.
    """

    _OWNER: ClassVar[str] = ""
    _RETIRED: ClassVar[Mapping] = {}

    if TYPE_CHECKING:
        # Set by @dataclass on every subclass; declared so that mypy accepts fields(cls) and fields(self).
        __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @classmethod
    def from_dict(cls, mapping: Any) -> typing_extensions.Self:
        """Build from a dict of keys; unknown keys raise ValueError with a suggestion.

        Unset keys take their defaults. An instance of the class is returned as is.
        """
        if isinstance(mapping, cls):
            return mapping
        names = [f.name for f in fields(cls)]
        if not isinstance(mapping, Mapping):
            # Any bad configuration, wrong types included, is a ValueError (the README's contract).
            raise ValueError(  # noqa: TRY004
                f"{cls._OWNER} must be a dict of config keys; got {show(mapping)} "
                f"({type(mapping).__name__}). Valid keys: {', '.join(names)}."
            )
        for key in mapping:
            if not isinstance(key, str) or key not in names:
                advice = cls._RETIRED.get(key, "") if isinstance(key, str) else ""
                hint = f" {advice}" if advice else did_you_mean(key, names)
                raise ValueError(
                    f"{cls._OWNER} has no key {show(key)}.{hint} Valid keys: {', '.join(names)}."
                )
        return cls(**mapping)

    def to_dict(self) -> dict:
        """Every key with its value; tuples become lists so the dict is plain JSON."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def non_defaults(self) -> dict:
        """Only the keys whose value differs from the default, as in :meth:`to_dict`."""
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if v != default[k]}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
