"""The AMP checks shared by ``amp_configs`` and ``auto_cast()``: the low-precision dtype and the op lists."""

from __future__ import annotations

from typing import Any

from distamp.strategy.checks import as_choice, as_names, where
from distamp.strategy.op_names import canonical_op_name, expand_op_names, is_inplace_op_name, known_op_names
from distamp.suggest import did_you_mean

__all__ = ["validate_dtype", "validate_op_lists"]


def _canonical_ops(owner: str, key: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Canonical op names (``"torch.matmul"`` -> ``"matmul"``); unknown and in-place ones raise."""
    if not names:
        return names
    known = known_op_names()
    canonical = tuple(canonical_op_name(name) for name in names)
    for name, op in zip(names, canonical, strict=True):
        if op not in known:
            # An in-place name would be refused just below: never suggest one.
            listable = [name for name in known if not is_inplace_op_name(name)]
            hint = did_you_mean(op, listable) or " Ops are torch function names such as 'matmul' or 'softmax'."
            raise ValueError(
                f"{where(owner, key)} contains {name!r}, which is not an op distamp knows.{hint} "
                f"The full list is distamp.strategy.op_names.known_op_names()."
            )
        if is_inplace_op_name(op):
            raise ValueError(
                f"{where(owner, key)} contains {name!r}, an in-place op: in-place ops write into their "
                f"input and keep its dtype, as under torch.autocast. List the out-of-place op "
                f"{op.rstrip('_')!r} instead."
            )
    return canonical


def validate_op_lists(owner: str, white: Any, black: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Check a custom white and black list; returns them as tuples of canonical op names.

    ``owner`` names the caller in messages (``"amp_configs"``, ``"auto_cast()"``).

    Raises:
        ValueError: not a list of strings, an unknown or in-place op (with the
            closest valid name), or an op on both lists (after expanding aliases
            such as ``"conv"``).
    """
    lists = []
    for key, value in (("custom_white_list", white), ("custom_black_list", black)):
        lists.append(_canonical_ops(owner, key, as_names(owner, key, value, "op names")))
    both = sorted(expand_op_names(lists[0]) & expand_op_names(lists[1]))
    if both:
        raise ValueError(
            f"{where(owner, 'custom_white_list')} and {where(owner, 'custom_black_list')} both contain "
            f"{both!r}; an op can be forced to only one precision. Remove it from one of the lists."
        )
    return lists[0], lists[1]


def validate_dtype(owner: str, key: str, value: Any) -> str:
    """``"float16"`` or ``"bfloat16"`` from a name or a torch dtype; anything else raises ValueError."""
    return as_choice(owner, key, value, ("float16", "bfloat16"), dtypes=True)
