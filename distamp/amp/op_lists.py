"""Op lists for auto_cast: which torch ops run in low precision and which in FP32.

Ops are identified by a *canonical name*: torch's function name with the
dunders stripped and the method, function and namespace forms unified, so
``Tensor.__matmul__``, ``Tensor.matmul`` and ``torch.matmul`` are all
``"matmul"``; ``torch.linalg.vector_norm`` is ``"vector_norm"`` and
``torch.special.expm1`` is ``"expm1"``.

* :data:`WHITE_OPS` run in the low-precision dtype (float16/bfloat16). They
  are the matmul-like ops whose throughput low precision exists for; the set
  follows ``torch.autocast``'s lower-precision list.
* :data:`BLACK_OPS` run in float32 (their outputs are float32). They are ops
  whose range or accuracy suffers in low precision: exponentials and
  logarithms, reductions and statistics (sums, means, norms, normalisation
  layers), softmax and every loss; the set follows ``torch.autocast``'s
  float32 lists plus the normalisation, variance and linear-algebra ops that
  torch keeps in float32 on CPU.
* Every other op is *gray*: it follows its inputs.

The alias ``"conv"`` in a user list stands for the whole convolution family
(:data:`OP_ALIASES`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "BLACK_OPS",
    "OP_ALIASES",
    "WHITE_OPS",
    "canonical_op_name",
    "expand_op_names",
    "is_inplace_op_name",
    "is_known_op",
    "known_op_names",
]

CONV_OPS = frozenset(
    {
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "conv_tbc",
        "convolution",
    }
)

WHITE_OPS: frozenset[str] = CONV_OPS | frozenset(
    {
        "matmul",
        "linear",
        "bmm",
        "mm",
        "mv",
        "addmm",
        "addmv",
        "addbmm",
        "addr",
        "baddbmm",
        "einsum",
        "chain_matmul",
        "multi_dot",
        "vecdot",
        "prelu",
        "scaled_dot_product_attention",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
    }
)
"""Ops run in the low-precision dtype."""

_BLACK_MATH = {
    "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "reciprocal",
    "rsqrt", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus",
}
_BLACK_REDUCTIONS = {
    "sum", "nansum", "mean", "nanmean", "prod", "cumsum", "cumprod",
    "logsumexp", "logcumsumexp", "var", "std", "var_mean", "std_mean",
    "softmax", "log_softmax", "softmin",
}
_BLACK_NORMS = {
    "norm", "vector_norm", "matrix_norm", "frobenius_norm", "nuclear_norm",
    "renorm", "normalize", "dist", "pdist", "cdist", "pairwise_distance",
    "cosine_similarity", "layer_norm", "batch_norm", "group_norm",
    "instance_norm", "rms_norm", "local_response_norm",
}
_BLACK_LOSSES = {
    "cross_entropy", "linear_cross_entropy", "nll_loss", "mse_loss",
    "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "gaussian_nll_loss",
    "ctc_loss", "cosine_embedding_loss", "hinge_embedding_loss",
    "margin_ranking_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
}
# Decompositions and solvers: most have no float16/bfloat16 kernels at all,
# and torch.autocast("cpu") runs them in float32 too.
_BLACK_LINALG = {
    "inverse", "inv", "pinverse", "pinv", "det", "slogdet", "logdet",
    "cholesky", "solve", "lstsq", "qr", "svd", "svdvals", "eigh", "eigvalsh",
    "matrix_exp", "trace",
}

BLACK_OPS: frozenset[str] = frozenset(
    _BLACK_MATH | _BLACK_REDUCTIONS | _BLACK_NORMS | _BLACK_LOSSES | _BLACK_LINALG
)
"""Ops run in float32."""

OP_ALIASES: dict[str, frozenset[str]] = {
    "conv": CONV_OPS,
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
def known_op_names() -> frozenset[str]:
    """Canonical names of every op auto_cast can see, plus :data:`OP_ALIASES`.

    These are the public callables of ``torch``, ``torch.nn.functional``,
    ``torch.Tensor``, ``torch.linalg`` and ``torch.special`` that take part in
    ``__torch_function__`` dispatch. Computed once.
    """
    import torch
    from torch.overrides import get_overridable_functions

    namespaces = {torch, torch.functional, torch.nn.functional, torch.Tensor,
                  torch.linalg, torch.special}
    names: set[str] = set(OP_ALIASES)
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
            names.add(_normalise(raw))
    return frozenset(names)


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
