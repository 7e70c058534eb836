"""Names of torch ops, for the custom op lists of ``auto_cast``.

Ops are identified by a *canonical name*: torch's function name with the
dunders stripped and the method, function and namespace forms unified, so
``Tensor.__matmul__``, ``Tensor.matmul`` and ``torch.matmul`` are all
``"matmul"``; ``torch.linalg.vector_norm`` is ``"vector_norm"`` and
``torch.special.expm1`` is ``"expm1"``.

A name in ``custom_white_list`` / ``custom_black_list`` may be written in
any of those forms (``"torch.matmul"``, ``"F.softmax"``, ``"Tensor.__matmul__"``)
and must name a public op of ``torch``, ``torch.nn.functional``,
``torch.Tensor``, ``torch.linalg`` or ``torch.special`` (:func:`known_op_names`,
computed from torch itself, not kept here).

The alias ``"conv"`` in a user list stands for the whole convolution family
(:data:`OP_ALIASES`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "OP_ALIASES",
    "canonical_op_name",
    "expand_op_names",
    "functions_named",
    "is_inplace_op_name",
    "is_known_op",
    "known_op_names",
]

_CONV_OPS = frozenset(
    {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
     "convolution"}
)

OP_ALIASES: dict[str, frozenset[str]] = {
    "conv": _CONV_OPS,
    "conv_transpose": frozenset({"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}),
}
"""Names a user list may use for a whole family of ops."""

# Python operator dunders -> the torch op they run ("i" forms are in-place).
_DUNDER_OPS = {
    "add": "add", "radd": "add", "iadd": "add_",
    "sub": "sub", "rsub": "rsub", "isub": "sub_",
    "mul": "mul", "rmul": "mul", "imul": "mul_",
    "truediv": "div", "rtruediv": "div", "div": "div", "rdiv": "div",
    "itruediv": "div_", "idiv": "div_",
    "floordiv": "floor_divide", "rfloordiv": "floor_divide", "ifloordiv": "floor_divide_",
    "mod": "remainder", "rmod": "remainder", "imod": "remainder_",
    "pow": "pow", "rpow": "pow", "ipow": "pow_",
    "matmul": "matmul", "rmatmul": "matmul", "imatmul": "matmul_",
    "and": "bitwise_and", "rand": "bitwise_and", "iand": "bitwise_and_",
    "or": "bitwise_or", "ror": "bitwise_or", "ior": "bitwise_or_",
    "xor": "bitwise_xor", "rxor": "bitwise_xor", "ixor": "bitwise_xor_",
    "lshift": "bitwise_left_shift", "rlshift": "bitwise_left_shift",
    "ilshift": "bitwise_left_shift_",
    "rshift": "bitwise_right_shift", "rrshift": "bitwise_right_shift",
    "irshift": "bitwise_right_shift_",
    "invert": "bitwise_not", "neg": "neg", "abs": "abs",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "getitem": "getitem", "setitem": "setitem",
}
# Ops that write into their first argument without a trailing underscore.
_INPLACE_NAMES = frozenset({"setitem"})
# torch's C namespaces prefix their function names (torch.special.expm1 is
# the builtin "special_expm1"); the prefix is not part of the op's identity.
_NAMESPACE_PREFIXES = ("special_", "linalg_")


def canonical_op_name(name_or_callable: str | Callable[..., Any]) -> str:
    """Return the canonical op name of a torch callable or a user-written name.

    Args:
        name_or_callable: a torch function, ``Tensor`` method or dunder, or a
            string such as ``"matmul"``, ``"torch.matmul"``,
            ``"Tensor.__matmul__"`` or ``"F.softmax"``.

    Returns:
        The name the op lists use, e.g. ``"matmul"`` for all of the above.
        Property getters (``Tensor.shape.__get__``) map to the property name.
    """
    if isinstance(name_or_callable, str):
        name = name_or_callable.strip().rsplit(".", 1)[-1]
    else:
        name = _callable_name(name_or_callable)
    return _normalise(name)


def _callable_name(func: Any) -> str:
    """Name of a callable, looking through descriptor getters/setters."""
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        owner_name = getattr(owner, "__name__", None)
        if owner_name is None:  # a Python property: name its getter
            owner_name = getattr(getattr(owner, "fget", None), "__name__", None)
        if owner_name is not None:
            return owner_name
    if not isinstance(name, str):
        raise TypeError(
            f"canonical_op_name() needs a string or a named callable, got {func!r} "
            f"of type {type(func).__name__}"
        )
    return name


def _normalise(name: str) -> str:
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        return _DUNDER_OPS.get(core, core)
    for prefix in _NAMESPACE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def is_inplace_op_name(name: str) -> bool:
    """True for canonical names of ops that modify their first argument."""
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_NAMES


@functools.cache
def _functions_by_name() -> dict[str, tuple[Callable[..., Any], ...]]:
    """Canonical name -> the public torch callables with that name (built once from torch itself)."""
    import torch
    from torch.overrides import get_overridable_functions

    namespaces = {torch, torch.functional, torch.nn.functional, torch.Tensor, torch.linalg, torch.special}
    table: dict[str, list[Callable[..., Any]]] = {}
    for namespace, funcs in get_overridable_functions().items():
        if namespace not in namespaces:
            continue
        for func in funcs:
            raw = getattr(func, "__name__", None)
            if not isinstance(raw, str) or raw in ("__get__", "__set__"):
                continue  # property getters and setters are not ops
            if raw.startswith("__") and raw[2:-2] not in _DUNDER_OPS:
                continue  # __repr__, __len__, __reduce_ex__ ...
            if raw.startswith("_") and not raw.startswith("__"):
                continue  # private helpers
            table.setdefault(_normalise(raw), []).append(func)
    return {name: tuple(funcs) for name, funcs in table.items()}


def known_op_names() -> frozenset[str]:
    """Canonical names of every op a custom list may name, plus :data:`OP_ALIASES`.

    These are the public callables of ``torch``, ``torch.nn.functional``,
    ``torch.Tensor``, ``torch.linalg`` and ``torch.special`` that take part in
    ``__torch_function__`` dispatch.
    """
    return frozenset(_functions_by_name()) | frozenset(OP_ALIASES)


def functions_named(names: Iterable[str]) -> frozenset[Callable[..., Any]]:
    """Every torch callable whose canonical name is in ``names`` (aliases expanded).

    The op-list mode matches calls against these objects, not their names:
    a set lookup that ``torch.compile`` traces like any other.
    """
    table = _functions_by_name()
    return frozenset(func for name in expand_op_names(names) for func in table.get(name, ()))


def is_known_op(name: str) -> bool:
    """True when ``name`` (in any form :func:`canonical_op_name` accepts) is a known op."""
    return canonical_op_name(name) in known_op_names()


def expand_op_names(names: Iterable[str]) -> frozenset[str]:
    """Canonicalise user-written op names and expand aliases such as ``"conv"``.

    Names are not validated here; use :func:`is_known_op` first.
    """
    result: set[str] = set()
    for name in names:
        canonical = canonical_op_name(name)
        result |= OP_ALIASES.get(canonical, {canonical})
    return frozenset(result)
