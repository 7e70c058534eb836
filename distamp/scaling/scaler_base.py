"""The loss-scaler interface and the fixed scales (static, and 1.0 for BF16).

A loss scaler is a small host-side state machine. The meta-optimizer asks it
for :attr:`LossScaler.scale` before backward, and calls
:meth:`LossScaler.update` exactly once per optimizer step with the verdict
of the (all-reduced) inf/NaN check. The scale is a Python ``float`` rounded
to float32 after every change, so it equals, bit for bit, the float32 scale
tensor torch keeps; the counters are Python ``int``. ``state_dict()`` holds
only plain numbers, loadable with ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import abc
import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from distamp.strategy.checks import finite_float, is_integer, is_real

__all__ = ["LossScaler", "StaticLossScaler", "UnitLossScaler"]


def _to_float32(x: float) -> float:
    """Round ``x`` to the nearest float32 (±inf beyond its range).

    Exists so that the host-side scale is bitwise the value a float32 tensor
    would hold after the same arithmetic (torch computes ``float * double``
    in double and rounds the result to float once, as this does).
    """
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _check_scale(name: str, value: Any) -> float:
    """A finite positive number that stays finite and non-zero in float32."""
    number = finite_float(value)
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    rounded = _to_float32(number)
    if rounded == 0.0 or math.isinf(rounded):
        raise ValueError(
            f"{name} must be representable in float32 (between about 1.4e-45 and "
            f"3.4e38) because the loss scale is a float32 tensor, got {value!r}."
        )
    return number


def _check_int(name: str, value: Any) -> int:
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def _check_open_interval(name: str, value: Any, low: float, high: float) -> float:
    number = finite_float(value)
    if number is None or not low < number < high:
        raise ValueError(f"{name} must be a number in ({low}, {high}), got {value!r}.")
    return number


def _check_bounds(min_scale: Any, max_scale: Any) -> tuple[float, float]:
    lo = _check_scale("min_scale", min_scale)
    # max_scale may exceed float32's range (e.g. 2**128): the scale then stops
    # at the last value that is finite in float32 instead of becoming inf.
    hi = finite_float(max_scale)
    if hi is None or hi < lo:
        raise ValueError(
            f"max_scale must be a finite number >= min_scale ({min_scale!r}), got {max_scale!r}."
        )
    return lo, hi


def _check_init_in_bounds(init_scale: float, lo: float, hi: float) -> None:
    if not lo <= init_scale <= hi:
        raise ValueError(
            f"init_scale must lie within [min_scale, max_scale] = [{lo!r}, {hi!r}], "
            f"got {init_scale!r}; widen the bounds or change the initial scale."
        )


def _as_number(name: str, value: Any) -> float:
    """Accept Python/NumPy numbers and one-element tensors (e.g. from a checkpoint)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not is_real(value):
        raise TypeError(
            f"{name} must be a real number or a one-element tensor, got {value!r}."
        )
    return value


def _as_flag(value: Any) -> bool:
    """A bool from a bool, a number, a NumPy scalar or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                "found_inf must be a bool or a one-element tensor, got a tensor of "
                f"shape {tuple(value.shape)}."
            )
        return bool(value.item())
    # NumPy scalars (np.bool_ is not a numbers.Real) have an empty shape.
    if isinstance(value, numbers.Real) or getattr(value, "shape", None) == ():
        return bool(value)
    raise TypeError(f"found_inf must be a bool or a one-element tensor, got {value!r}.")


class LossScaler(abc.ABC):
    """Base class of the loss-scaling algorithms.

    Subclasses implement :attr:`scale`, :attr:`can_decrease`, ``_update``,
    :meth:`state_dict` and ``_load_state``; the base class validates the
    arguments of :meth:`update` and the keys given to :meth:`load_state_dict`.

    Example::

        scaler = build_loss_scaler(strategy.amp_config)
        for x, y in loader:
            loss = model(x, y)
            (loss * scaler.scale).backward()
            found_inf = ...          # inf/NaN check, all-reduced across ranks
            if not found_inf:
                ...                  # unscale by 1 / scaler.scale and step
            scaler.update(found_inf)

    Attributes:
        needs_grad_max: ``True`` when :meth:`update` needs ``grad_max`` on
            finite steps (costs the optimizer a max-reduction and a host sync).
    """

    needs_grad_max: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def scale(self) -> float:
        """The loss scale for the next backward (a float32 value)."""

    @property
    @abc.abstractmethod
    def can_decrease(self) -> bool:
        """``False`` when an overflow could not lower the scale any further."""

    def decrease_now(self) -> bool:
        """Lower the scale at once, outside :meth:`update` (an overflow retry); False if it cannot.

        Fixed scales cannot; the dynamic scalers override this.
        """
        return False

    def update(
        self, found_inf: bool | torch.Tensor, grad_max: float | None = None
    ) -> None:
        """Advance by one optimizer step.

        Args:
            found_inf: whether any gradient of this step was inf or NaN (on
                any rank); a bool or a one-element tensor.
            grad_max: max |unscaled gradient| over all gradients; required on
                finite steps when :attr:`needs_grad_max`, ignored otherwise.

        Raises:
            ValueError: ``grad_max`` is missing, negative or non-finite on a
                finite step of a scaler that needs it.
            TypeError: ``found_inf`` or ``grad_max`` is not a number.
        """
        found_inf = _as_flag(found_inf)
        if self.needs_grad_max and not found_inf:
            grad_max = self._check_grad_max(grad_max)
        self._update(found_inf, grad_max)

    @staticmethod
    def _check_grad_max(grad_max: Any) -> float:
        if grad_max is None:
            raise ValueError(
                "grad_max is required on finite steps by this loss scaler "
                "(needs_grad_max is True); pass max |unscaled gradient|."
            )
        value = float(_as_number("grad_max", grad_max))
        if not math.isfinite(value) or value < 0:
            raise ValueError(
                f"grad_max must be a finite number >= 0 on a step with found_inf=False, "
                f"got {grad_max!r}; a non-finite gradient means found_inf=True."
            )
        return value

    @abc.abstractmethod
    def _update(self, found_inf: bool, grad_max: float | None) -> None:
        """Algorithm-specific step, with validated arguments."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, float | int]:
        """The mutable state as plain numbers (the configuration is not included)."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` of the same scaler type.

        Raises:
            ValueError: on a missing or unknown key, or an invalid value.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a mapping, got {type(state_dict).__name__}."
            )
        expected = set(self.state_dict())
        missing = sorted(expected - set(state_dict))
        unknown = sorted(set(state_dict) - expected)
        if missing or unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: missing keys {missing}, unknown keys "
                f"{unknown} (expected {sorted(expected)}); was the checkpoint saved with a "
                f"different loss scaler (dtype or loss_scaling_algorithm)?"
            )
        self._load_state({k: _as_number(k, v) for k, v in state_dict.items()})

    @abc.abstractmethod
    def _load_state(self, state: dict[str, float | int]) -> None:
        """Set the state from validated keys."""


def _load_scale(value: float) -> float:
    return _to_float32(_check_scale("state_dict['scale']", value))


def _load_count(name: str, value: float) -> int:
    if not is_integer(value) or value < 0:
        raise ValueError(f"state_dict[{name!r}] must be an int >= 0, got {value!r}.")
    return int(value)


class StaticLossScaler(LossScaler):
    """A constant loss scale (``use_dynamic_loss_scaling=False``).

    Steps with non-finite gradients are still skipped by the optimizer; the
    scale never changes.

    Args:
        scale: the loss scale, a finite number > 0 (rounded to float32).

    Example::

        scaler = StaticLossScaler(1024.0)
        scaler.update(found_inf=True)
        assert scaler.scale == 1024.0
    """

    def __init__(self, scale: float) -> None:
        self._scale = _to_float32(_check_scale("scale", scale))

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def can_decrease(self) -> bool:
        return False

    def _update(self, found_inf: bool, grad_max: float | None) -> None:
        pass  # constant by definition

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self._scale}

    def _load_state(self, state: dict[str, float | int]) -> None:
        self._scale = _load_scale(state["scale"])

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._scale!r})"


class UnitLossScaler(StaticLossScaler):
    """The fixed scale 1.0 of BF16 training, which has FP32's exponent range.

    Non-finite steps are still skipped by the optimizer; the scale never
    changes, and there is no state to save.

    Example::

        scaler = UnitLossScaler()
        scaler.update(found_inf=True)
        assert scaler.scale == 1.0 and scaler.state_dict() == {}
    """

    def __init__(self) -> None:
        super().__init__(1.0)

    def state_dict(self) -> dict[str, float | int]:
        return {}

    def _load_state(self, state: dict[str, float | int]) -> None:
        pass  # no state

    def __repr__(self) -> str:
        return "UnitLossScaler()"
