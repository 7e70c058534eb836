"""Value checks shared by the configs, the loss scalers and the black-module patterns.

Two layers:

* type predicates that every caller shares (:func:`is_real`,
  :func:`is_integer`, :func:`finite_float`, :func:`is_name`) and the message
  helper :func:`show`, a ``repr`` that cannot fail or flood a message;
* the config checks (:func:`as_bool`, :func:`as_int`, :func:`as_float`,
  :func:`as_choice`, :func:`as_names`): each returns the normalised value or
  raises ``ValueError`` naming ``owner[key]``, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from distamp.suggest import did_you_mean

__all__ = [
    "FLOAT32_MAX",
    "INT64_MAX",
    "as_bool",
    "as_choice",
    "as_float",
    "as_int",
    "as_names",
    "fail",
    "finite_float",
    "is_integer",
    "is_name",
    "is_real",
    "show",
    "where",
]

INT64_MAX = 2**63 - 1  # counters and patience may live in int64 tensors
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the scale is a float32 tensor
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


# -- type predicates ---------------------------------------------------------


def is_real(value: Any) -> bool:
    """True for real numbers (ints, floats, fractions, NumPy scalars), False for bools and the rest."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """True for integers (Python and NumPy), False for bools and the rest."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite_float(value: Any) -> float | None:
    """``float(value)`` for a real number whose float is finite; None otherwise (``float(10**400)`` included)."""
    if not is_real(value):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


def is_name(item: Any) -> bool:
    """True for a string that is not empty or blank (an op name, a module-name pattern)."""
    return isinstance(item, str) and bool(item.strip())


def show(value: Any) -> str:
    """``repr(value)`` that cannot fail or flood the message (huge ints, odd objects)."""
    try:
        text = repr(value)
    except (ValueError, TypeError, AttributeError, RuntimeError, RecursionError):
        # repr of a 5000-digit int raises ValueError in Python >= 3.11
        if isinstance(value, int):
            return f"<int with {value.bit_length()} bits>"
        text = object.__repr__(value)
    return text if len(text) <= 200 else text[:200] + "..."


# -- config checks -----------------------------------------------------------


def where(owner: str, key: str) -> str:
    """How messages name a setting: ``strategy.amp``, ``amp_configs['dtype']`` or ``auto_cast(dtype=...)``."""
    if owner == "strategy":
        return f"strategy.{key}"
    if owner.endswith("()"):
        return f"{owner[:-1]}{key}=...)"
    return f"{owner}[{key!r}]"


def fail(owner: str, key: str, value: Any, allowed: str, hint: str = "") -> NoReturn:
    """Raise the ValueError every config check raises: the setting, what is allowed, the value."""
    raise ValueError(f"{where(owner, key)} must be {allowed}; got {show(value)}.{hint}")


def as_bool(owner: str, key: str, value: Any) -> bool:
    """``value`` if it is a bool; anything else (0 and 1 included) raises ValueError."""
    if not isinstance(value, bool):
        fail(owner, key, value, "a bool (True or False)")
    return value


def as_int(owner: str, key: str, value: Any, low: int) -> int:
    """An int in ``[low, 2**63 - 1]`` (bools are not ints here)."""
    allowed = f"an int >= {low} (at most 2**63 - 1)"
    if not is_integer(value):
        fail(owner, key, value, allowed)
    number = int(value)
    if not low <= number <= INT64_MAX:
        fail(owner, key, value, allowed)
    return number


def as_float(owner: str, key: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    """A finite float (ints accepted, bools not) for which ``ok`` holds."""
    number = finite_float(value)
    if number is None or not ok(number):
        fail(owner, key, value, allowed)
    return number


def as_choice(owner: str, key: str, value: Any, choices: tuple[str, ...], dtypes: bool = False) -> str:
    """One of ``choices``; with ``dtypes`` the matching torch dtype is accepted and returned as its name."""
    if dtypes and isinstance(value, torch.dtype) and _DTYPE_NAMES.get(value) in choices:
        return _DTYPE_NAMES[value]
    if isinstance(value, str) and value in choices:
        return value
    allowed = "one of " + ", ".join(repr(c) for c in choices)
    if dtypes:
        allowed += " (or the matching torch dtype)"
    hint = ""
    if isinstance(value, str):
        alias = _DTYPE_ALIASES.get(value.lower()) if dtypes else None
        hint = f" Did you mean {alias!r}?" if alias in choices else did_you_mean(value, choices)
    fail(owner, key, value, allowed, hint)


def as_names(owner: str, key: str, value: Any, what: str) -> tuple[str, ...]:
    """A list or tuple of non-empty strings, stored as a tuple."""
    allowed = f"a list of {what} (non-empty strings)"
    if isinstance(value, str):
        fail(owner, key, value, allowed, f" Wrap a single name in a list: [{value!r}].")
    if not isinstance(value, (list, tuple)):
        fail(owner, key, value, allowed)
    for item in value:
        if not is_name(item):
            raise ValueError(
                f"{where(owner, key)} must be {allowed}; got {show(value)}, "
                f"whose item {show(item)} is not a non-empty string."
            )
    return tuple(value)
