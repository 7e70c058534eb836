"""auto_cast: op-level mixed precision driven by white and black op lists.

Example::

    model = Net()                                  # FP32 parameters ("O1")
    for x, y in loader:
        with auto_cast(dtype="bfloat16"):
            loss = F.cross_entropy(model(x), y)    # linear in BF16, loss in FP32
        loss.backward()                            # parameter grads are FP32

White ops (:data:`~distamp.amp.op_lists.WHITE_OPS`) cast their floating-point
tensor inputs to the low-precision dtype; black ops
(:data:`~distamp.amp.op_lists.BLACK_OPS`) cast low-precision inputs to float32,
so their outputs are float32; every other ("gray") op follows its inputs and,
when those disagree, runs in the widest of them.

It is built on :class:`torch.overrides.TorchFunctionMode`, which sits above
autograd: every cast is an ordinary differentiable ``Tensor.to``, so gradients
flow back to each parameter in the parameter's own dtype. That also means it
sees each call at the level the user made it: a Python-level composite such
as ``F.multi_head_attention_forward`` is classified once, as a whole (it is
gray, so it runs in the widest dtype of its inputs), and the ops inside it
are not recast.

``nn.RNN``/``nn.LSTM``/``nn.GRU`` compare their input's dtype with their
weights' in Python before any op runs (torch skips that check only under
``torch.autocast``): give them FP32 inputs, or list them in
``custom_black_varnames``, whose hooks cast the inputs to FP32.

Float64 tensors, non-floating tensors, in-place ops (``add_``,
``x[i] = v``) and calls with ``out=`` are never cast, as in
``torch.autocast``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distamp.amp.op_lists import (
    BLACK_OPS,
    WHITE_OPS,
    canonical_op_name,
    expand_op_names,
    is_inplace_op_name,
    known_op_names,
)
from distamp.suggest import did_you_mean

if TYPE_CHECKING:
    from typing import Self

__all__ = [
    "auto_cast",
    "current_autocast_dtype",
    "enter_fp32_region",
    "exit_fp32_region",
    "is_autocast_active",
]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}

# Categories of a torch callable under a policy.
_PASS, _GRAY, _WHITE, _BLACK = range(4)

# Gray ops whose meaning depends on their inputs' dtypes (or that return
# views/aliases of them): widening their inputs would change what they do.
_NEVER_WIDEN = frozenset(
    {
        "to",
        "type_as",
        "result_type",
        "can_cast",
        "is_same_size",
        "is_set_to",
        "new_tensor",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
        "expand_as",
        "view_as",
        "reshape_as",
        "broadcast_tensors",
        "backward",
        "register_hook",
        "setstate",
    }
)
# Keyword arguments that an op writes into; they are never replaced by a cast
# copy, or the write would be lost.
_MUTATED_KWARGS = frozenset({"out", "running_mean", "running_var"})


@functools.cache
def _mutated_positions() -> dict[Callable[..., Any], tuple[int, ...]]:
    """Positional running statistics that batch/instance norm update in place."""
    return {
        F.batch_norm: (1, 2),
        F.instance_norm: (1, 2),
        torch.batch_norm: (3, 4),
        torch.instance_norm: (3, 4),
    }


class _Policy:
    """An immutable casting policy: the low dtype and the effective op sets."""

    __slots__ = ("black", "categories", "dtype", "white")

    def __init__(self, dtype: torch.dtype, white: frozenset[str], black: frozenset[str]):
        self.dtype = dtype
        self.white = white
        self.black = black
        # func -> category; filled lazily, one dict lookup per call afterwards.
        self.categories: dict[Any, int] = {}

    def classify(self, func: Any) -> int:
        try:
            name = canonical_op_name(func)
        except TypeError:
            category = _GRAY
        else:
            if getattr(func, "__name__", None) in ("__get__", "__set__", "__delete__"):
                category = _PASS  # property getters/setters (x.shape, x.grad = g)
            elif is_inplace_op_name(name) or name in _NEVER_WIDEN:
                category = _PASS
            elif name in self.white:
                category = _WHITE
            elif name in self.black:
                category = _BLACK
            else:
                category = _GRAY
        self.categories[func] = category
        return category

    def fp32(self) -> _Policy:
        """The same lists with float32 as the "low" dtype (a black module's region)."""
        return _policy(torch.float32, self.white, self.black)


@functools.lru_cache(maxsize=64)
def _policy(dtype: torch.dtype, white: frozenset[str], black: frozenset[str]) -> _Policy:
    # Shared per (dtype, lists) so a fresh auto_cast() every iteration keeps
    # the classification cache warm.
    return _Policy(dtype, white, black)


class _Frame:
    """One active auto_cast region: its policy and its weight-cast cache."""

    __slots__ = ("cache", "policy")

    def __init__(self, policy: _Policy):
        self.policy = policy
        # id(param) -> (param, param._version, cast copy). Like torch.autocast,
        # a leaf parameter used several times in a region is cast once, and its
        # low-precision gradient contributions are summed before the cast back.
        self.cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}


class _State(threading.local):
    frame: _Frame | None = None
    mode: TorchFunctionMode | None = None


_STATE = _State()


def _cast_low(t: torch.Tensor, frame: _Frame) -> torch.Tensor:
    dtype = frame.policy.dtype
    if t.dtype is dtype or not t.dtype.is_floating_point or t.dtype is torch.float64:
        return t
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        hit = frame.cache.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        cast = t.to(dtype)
        frame.cache[id(t)] = (t, t._version, cast)
        return cast
    return t.to(dtype)


def _cast_fp32(t: torch.Tensor) -> torch.Tensor:
    dtype = t.dtype
    if dtype.is_floating_point and dtype.itemsize < 4:
        return t.to(torch.float32)
    return t


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in ``obj`` and in plain lists/tuples inside it."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is list or type(obj) is tuple:
        new = [_map(item, fn) for item in obj]
        if any(n is not o for n, o in zip(new, obj)):
            return type(obj)(new)
    return obj


def _cast_call(func: Any, args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
    protected = _mutated_positions().get(func, ())
    new_args = tuple(
        arg if i in protected else _map(arg, fn) for i, arg in enumerate(args)
    )
    new_kwargs = {
        k: v if k in _MUTATED_KWARGS else _map(v, fn) for k, v in kwargs.items()
    }
    return new_args, new_kwargs


def _collect_float_dtypes(obj: Any, dims: set, scalars: set) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.dtype.is_floating_point:
            (dims if obj.dim() else scalars).add(obj.dtype)
    elif type(obj) is list or type(obj) is tuple:
        for item in obj:
            _collect_float_dtypes(item, dims, scalars)


def _widen(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Cast mixed floating inputs of a gray op to the widest of their dtypes."""
    dims: set[torch.dtype] = set()
    scalars: set[torch.dtype] = set()
    protected = _mutated_positions().get(func, ())
    for i, arg in enumerate(args):
        if i not in protected:
            _collect_float_dtypes(arg, dims, scalars)
    for key, value in kwargs.items():
        if key not in _MUTATED_KWARGS:
            _collect_float_dtypes(value, dims, scalars)
    candidates = dims or scalars
    if len(candidates) < 2 or kwargs.get("inplace") is True:
        return args, kwargs
    target = functools.reduce(torch.promote_types, candidates)
    # With dimensioned inputs present, zero-dim tensors are left to torch's
    # type promotion, which lets them follow (as in torch without autocast).
    skip_scalars = bool(dims)

    def widen(t: torch.Tensor) -> torch.Tensor:
        if t.dtype is target or not t.dtype.is_floating_point or (skip_scalars and not t.dim()):
            return t
        return t.to(target)

    return _cast_call(func, args, kwargs, widen)


class _AutoCastMode(TorchFunctionMode):
    """Applies the current thread's auto_cast policy to every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        frame = _STATE.frame
        if frame is None:
            return func(*args, **kwargs)
        policy = frame.policy
        category = policy.categories.get(func)
        if category is None:
            category = policy.classify(func)
        if category == _PASS or (kwargs and kwargs.get("out") is not None):
            return func(*args, **kwargs)
        if category == _GRAY:
            if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
                return func(*args)
            args, kwargs = _widen(func, args, kwargs)
        elif category == _WHITE:
            args, kwargs = _cast_call(func, args, kwargs, lambda t: _cast_low(t, frame))
        else:
            args, kwargs = _cast_call(func, args, kwargs, _cast_fp32)
        return func(*args, **kwargs)


def _validate_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    hint = did_you_mean(dtype, _DTYPES) if isinstance(dtype, str) else ""
    raise ValueError(
        f"auto_cast(dtype=...) must be 'float16', 'bfloat16', torch.float16 or "
        f"torch.bfloat16, got {dtype!r}.{hint}"
    )


def _validate_op_list(arg_name: str, names: Any) -> frozenset[str]:
    if names is None:
        return frozenset()
    if isinstance(names, str):
        raise TypeError(
            f"auto_cast({arg_name}=...) must be a list of op names, got the string "
            f"{names!r}; write {arg_name}=[{names!r}]"
        )
    if not isinstance(names, Iterable):
        raise TypeError(f"auto_cast({arg_name}=...) must be a list of op names, got {names!r}")
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"auto_cast({arg_name}=...) must contain op names as strings, "
                f"got {name!r} in {names!r}"
            )
        if canonical_op_name(name) not in known_op_names():
            raise ValueError(
                f"auto_cast({arg_name}=...) contains {name!r}, which is not a torch op "
                f"auto_cast knows (ops of torch, torch.nn.functional, torch.Tensor, "
                f"torch.linalg, torch.special, or 'conv')."
                f"{did_you_mean(canonical_op_name(name), known_op_names())}"
            )
    return expand_op_names(names)


class auto_cast(contextlib.ContextDecorator):
    """Run white-listed ops in low precision and black-listed ops in FP32.

    Use as a context manager around the forward pass and the loss, not the
    backward pass or the optimizer step::

        with auto_cast(dtype="float16", custom_black_list=["gelu"]):
            loss = loss_fn(model(x), y)
        scaled_backward(loss)

    It also works as a decorator (``@auto_cast(dtype="bfloat16")``).

    Args:
        enable: ``False`` makes the context a no-op, and inside an enabled
            context it switches casting off until it exits. Default ``True``.
        dtype: the low-precision dtype, ``"float16"`` (default) or
            ``"bfloat16"`` (or the torch dtypes).
        custom_white_list: op names (see
            :func:`~distamp.amp.op_lists.canonical_op_name`; ``"conv"`` means
            every convolution) to run in low precision, including ops on the
            default black list.
        custom_black_list: op names to run in float32, including ops on the
            default white list. An op may not be on both custom lists.

    Nested contexts replace the outer one's dtype and lists until they exit
    (also on an exception); the outer state then comes back.

    Costs: one Python-level ``__torch_function__`` call per torch call in the
    region (a dictionary lookup for ops that need no cast), plus one cast per
    white/black input that is not already in the target dtype; each FP32
    parameter is cast once per region.
    """

    def __init__(
        self,
        enable: bool = True,
        dtype: str | torch.dtype = "float16",
        custom_white_list: Iterable[str] | None = None,
        custom_black_list: Iterable[str] | None = None,
    ):
        if not isinstance(enable, bool):
            raise TypeError(f"auto_cast(enable=...) must be True or False, got {enable!r}")
        low = _validate_dtype(dtype)
        white = _validate_op_list("custom_white_list", custom_white_list)
        black = _validate_op_list("custom_black_list", custom_black_list)
        both = white & black
        if both:
            raise ValueError(
                f"auto_cast(): ops {sorted(both)!r} are on both custom_white_list and "
                f"custom_black_list; keep each op on one list"
            )
        self.enable = enable
        self.dtype = low
        self._policy = (
            _policy(low, (WHITE_OPS - black) | white, (BLACK_OPS - white) | black)
            if enable
            else None
        )
        self._saved: list[tuple[_Frame | None, TorchFunctionMode | None]] = []

    def __enter__(self) -> Self:
        pushed = None
        if self._policy is not None and _STATE.mode is None:
            pushed = _AutoCastMode()
            pushed.__enter__()
            _STATE.mode = pushed
        self._saved.append((_STATE.frame, pushed))
        _STATE.frame = _Frame(self._policy) if self._policy is not None else None
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        frame, pushed = self._saved.pop()
        _STATE.frame = frame
        if pushed is not None:
            _STATE.mode = None
            pushed.__exit__(exc_type, exc_value, traceback)

    def _recreate_cm(self) -> Self:
        # A fresh copy per decorated call keeps recursion and threads apart.
        clone = copy.copy(self)
        clone._saved = []
        return clone

    def __repr__(self) -> str:
        return f"auto_cast(enable={self.enable}, dtype={self.dtype})"


def is_autocast_active() -> bool:
    """True when low-precision casting is in effect on this thread."""
    frame = _STATE.frame
    return frame is not None and frame.policy.dtype is not torch.float32


def current_autocast_dtype() -> torch.dtype | None:
    """The low-precision dtype in effect on this thread, or ``None``."""
    return _STATE.frame.policy.dtype if is_autocast_active() else None


def enter_fp32_region() -> object:
    """Suspend low-precision casting (white ops run in FP32) until :func:`exit_fp32_region`.

    Returns a token to pass to :func:`exit_fp32_region`. A no-op outside
    auto_cast. Used by black-listed modules.
    """
    previous = _STATE.frame
    if previous is not None:
        _STATE.frame = _Frame(previous.policy.fp32())
    return previous


def exit_fp32_region(token: object) -> None:
    """Restore the casting state saved by :func:`enter_fp32_region`."""
    _STATE.frame = token  # type: ignore[assignment]
