"""Loss scalers: how the FP16 loss scale moves from one optimizer step to the next.

A loss scaler is a small host-side state machine. The meta-optimizer asks it
for :attr:`LossScaler.scale` before backward, and calls
:meth:`LossScaler.update` exactly once per optimizer step with the verdict
of the (all-reduced) inf/NaN check. The scale is a Python ``float`` rounded
to float32 after every change, so it equals, bit for bit, the float32 scale
tensor torch keeps; the counters are Python ``int``. ``state_dict()`` holds
only plain numbers, loadable with ``torch.load(..., weights_only=True)``.

Algorithms (see DESIGN.md section 3):

* :class:`StaticLossScaler`: a constant scale.
* :class:`UnitLossScaler`: a constant 1.0, for BF16.
* :class:`BackoffLossScaler`: Paddle's ``update_loss_scaling``.
* :class:`LogNormalLossScaler`: OpenSeq2Seq's "LogMax".

:func:`build_loss_scaler` picks one from an ``AmpConfig``.
"""

from __future__ import annotations

import abc
import math
import numbers
import struct
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

__all__ = [
    "BackoffLossScaler",
    "LogNormalLossScaler",
    "LossScaler",
    "StaticLossScaler",
    "UnitLossScaler",
    "build_loss_scaler",
]

_FLOAT32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


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


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_scale(name: str, value: Any) -> float:
    """A finite positive number that stays finite and non-zero in float32."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    rounded = _to_float32(float(value))
    if rounded == 0.0 or math.isinf(rounded):
        raise ValueError(
            f"{name} must be representable in float32 (between about 1.4e-45 and "
            f"3.4e38) because the loss scale is a float32 tensor, got {value!r}."
        )
    return float(value)


def _check_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}.")
    return int(value)


def _check_open_interval(name: str, value: Any, low: float, high: float) -> float:
    if not _is_real(value) or not low < value < high:
        raise ValueError(f"{name} must be a number in ({low}, {high}), got {value!r}.")
    return float(value)


def _check_bounds(min_scale: Any, max_scale: Any) -> tuple[float, float]:
    lo = _check_scale("min_scale", min_scale)
    # max_scale may exceed float32's range (e.g. 2**128): the scale then stops
    # at the last value that is finite in float32 instead of becoming inf.
    if not _is_real(max_scale) or not math.isfinite(max_scale) or max_scale < lo:
        raise ValueError(
            f"max_scale must be a finite number >= min_scale ({min_scale!r}), got {max_scale!r}."
        )
    return lo, float(max_scale)


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
    if not _is_real(value):
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
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
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


class BackoffLossScaler(LossScaler):
    """Paddle's dynamic loss scaling (``update_loss_scaling``).

    On a non-finite step ``num_good_steps`` becomes 0 and ``num_bad_steps``
    grows by one; when it reaches ``decr_every_n_nan_or_inf`` the scale
    becomes ``max(scale * decr_ratio, min_scale)`` and ``num_bad_steps`` 0.
    On a finite step ``num_bad_steps`` becomes 0 and ``num_good_steps``
    grows by one; when it reaches ``incr_every_n_steps`` the scale becomes
    ``min(scale * incr_ratio, max_scale)`` and ``num_good_steps`` 0. Both
    counters count *consecutive* steps. A grown scale that would be inf in
    float32 is not taken (the old scale stays), as in Paddle and torch; with
    ``decr_every_n_nan_or_inf=1`` and bounds that do not bind this is
    exactly ``torch.amp.GradScaler``'s update.

    Args:
        init_scale: the first scale, within ``[min_scale, max_scale]``.
        incr_every_n_steps: consecutive finite steps before growing (>= 1).
        decr_every_n_nan_or_inf: consecutive non-finite steps before
            shrinking (>= 1).
        incr_ratio: growth factor (> 1).
        decr_ratio: shrink factor, in (0, 1).
        min_scale: lower bound (> 0).
        max_scale: upper bound (>= min_scale; may exceed float32's range).

    Example::

        scaler = BackoffLossScaler(32768.0, incr_every_n_steps=1000,
                                   decr_every_n_nan_or_inf=2, incr_ratio=2.0,
                                   decr_ratio=0.5, min_scale=1.0, max_scale=2.0**24)
        scaler.update(found_inf=True)    # num_bad_steps == 1, scale 32768
        scaler.update(found_inf=True)    # scale 16384, num_bad_steps == 0
    """

    def __init__(
        self,
        init_scale: float,
        incr_every_n_steps: int,
        decr_every_n_nan_or_inf: int,
        incr_ratio: float,
        decr_ratio: float,
        min_scale: float,
        max_scale: float,
    ) -> None:
        init = _check_scale("init_scale", init_scale)
        self.incr_every_n_steps = _check_int("incr_every_n_steps", incr_every_n_steps)
        self.decr_every_n_nan_or_inf = _check_int(
            "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf
        )
        self.incr_ratio = _check_open_interval("incr_ratio", incr_ratio, 1.0, math.inf)
        self.decr_ratio = _check_open_interval("decr_ratio", decr_ratio, 0.0, 1.0)
        self.min_scale, self.max_scale = _check_bounds(min_scale, max_scale)
        _check_init_in_bounds(init, self.min_scale, self.max_scale)
        self._scale = _to_float32(init)
        self._good = 0
        self._bad = 0

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def num_good_steps(self) -> int:
        """Consecutive finite steps since the last growth or non-finite step."""
        return self._good

    @property
    def num_bad_steps(self) -> int:
        """Consecutive non-finite steps since the last shrink or finite step."""
        return self._bad

    @property
    def can_decrease(self) -> bool:
        return self._decreased() < self._scale

    def _decreased(self) -> float:
        # Rounding is monotonic, so this equals max(f32(scale*decr), f32(min)).
        return _to_float32(max(self._scale * self.decr_ratio, self.min_scale))

    def _increased(self) -> float:
        grown = _to_float32(min(self._scale * self.incr_ratio, self.max_scale))
        return grown if math.isfinite(grown) else self._scale

    def _update(self, found_inf: bool, grad_max: float | None) -> None:
        # ">=" rather than Paddle's "==": identical for states this class
        # produces, and still grows/shrinks after loading counters saved
        # under a larger interval.
        if found_inf:
            self._good = 0
            self._bad += 1
            if self._bad >= self.decr_every_n_nan_or_inf:
                self._scale = self._decreased()
                self._bad = 0
        else:
            self._bad = 0
            self._good += 1
            if self._good >= self.incr_every_n_steps:
                self._scale = self._increased()
                self._good = 0

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self._scale,
            "num_good_steps": self._good,
            "num_bad_steps": self._bad,
        }

    def _load_state(self, state: dict[str, float | int]) -> None:
        scale = _load_scale(state["scale"])
        good = _load_count("num_good_steps", state["num_good_steps"])
        bad = _load_count("num_bad_steps", state["num_bad_steps"])
        self._scale, self._good, self._bad = scale, good, bad

    def __repr__(self) -> str:
        return (
            f"BackoffLossScaler(scale={self._scale!r}, num_good_steps={self._good}, "
            f"num_bad_steps={self._bad}, incr_every_n_steps={self.incr_every_n_steps}, "
            f"decr_every_n_nan_or_inf={self.decr_every_n_nan_or_inf}, "
            f"incr_ratio={self.incr_ratio!r}, decr_ratio={self.decr_ratio!r}, "
            f"min_scale={self.min_scale!r}, max_scale={self.max_scale!r})"
        )


class LogNormalLossScaler(LossScaler):
    """OpenSeq2Seq's "LogMax" scaling: model log2 of the gradient maximum.

    Each step contributes ``x = log2(grad_max)`` (``grad_max`` = max
    |unscaled gradient|) to bias-corrected exponential moving averages: the
    mean ``mu`` with ``beta1``, and the variance ``sigma**2 = E[x**2] -
    E[x]**2`` from two averages with ``beta2``. The next scale is
    ``2 ** (log2(max_representable) - (mu + overflow_std_dev * sigma))``
    clipped to ``[min_scale, max_scale]``: if ``x`` is normal, the scaled
    maximum then overflows with probability ~0.001 for 3.09 sigma. The
    scale is not rounded to a power of two (as in OpenSeq2Seq).

    A non-finite step is a censored observation: it only says the maximum
    was at least ``c = log2(max_representable / scale)``. It contributes
    ``max(c, mu + overflow_std_dev * sigma) + 1`` (``c + 1`` before the first
    observation): one binade above the overflow threshold, as if the maximum
    had overflowed by 2x, the amount backoff assumes when it halves the
    scale. Consistently with that assumption the new scale is also at most
    half the one that overflowed, so every non-finite step lowers the scale
    until it reaches ``min_scale`` (the averages alone react slowly when the
    scale sat clamped at ``max_scale``). Feeding the bare bound ``c`` could
    leave the averages unchanged (with ``sigma == 0``, e.g. an overflow on the
    very first step, ``c`` equals ``mu``), and taking the model's own cutoff
    when it is larger (the scale was clamped at ``min_scale``) keeps an
    overflow from lowering the estimate. OpenSeq2Seq feeds ``2**16`` (not
    ``16``) as the *log* value, which pins the scale at its minimum for about
    11,000 steps after a single overflow (computed for stationary gradients).

    Like OpenSeq2Seq's, the variance forgets slowly (``beta2=0.999``): after
    the gradient maximum shifts by many binades, sigma stays inflated and the
    scale stays low for thousands of steps.

    A finite step with ``grad_max == 0`` (all gradients zero) carries no
    information about the magnitude and leaves everything unchanged.

    Args:
        init_scale: the scale before the first observation.
        min_scale, max_scale: bounds of the scale (``max_scale`` beyond
            float32's range is capped at float32's largest value).
        beta1: decay of the mean, in [0, 1).
        beta2: decay of the variance, in [0, 1).
        overflow_std_dev: how many sigmas of headroom (3.09 = the 0.999
            quantile of a normal), >= 0.
        max_representable: largest finite value of the low-precision type.

    Example::

        scaler = LogNormalLossScaler(32768.0, min_scale=1.0, max_scale=2.0**24)
        scaler.update(found_inf=False, grad_max=0.01)  # needs_grad_max is True
        scaler.scale   # ~65504 / 0.01: sigma is 0 after a single observation
    """

    needs_grad_max: ClassVar[bool] = True
    # Binades above the overflow threshold assumed for a non-finite step.
    _OVERFLOW_MARGIN: ClassVar[float] = 1.0

    def __init__(
        self,
        init_scale: float,
        min_scale: float,
        max_scale: float,
        beta1: float = 0.99,
        beta2: float = 0.999,
        overflow_std_dev: float = 3.09,
        max_representable: float = 65504.0,
    ) -> None:
        init = _check_scale("init_scale", init_scale)
        self.min_scale, self.max_scale = _check_bounds(min_scale, max_scale)
        _check_init_in_bounds(init, self.min_scale, self.max_scale)
        self.beta1 = self._check_beta("beta1", beta1)
        self.beta2 = self._check_beta("beta2", beta2)
        if not _is_real(overflow_std_dev) or not 0 <= overflow_std_dev < math.inf:
            raise ValueError(
                f"overflow_std_dev must be a finite number >= 0, got {overflow_std_dev!r}."
            )
        self.overflow_std_dev = float(overflow_std_dev)
        if not _is_real(max_representable) or not 0 < max_representable < math.inf:
            raise ValueError(
                f"max_representable must be a finite number > 0, got {max_representable!r}."
            )
        self.max_representable = float(max_representable)
        self._scale = _to_float32(init)
        self._count = 0
        self._mean_ema = 0.0  # beta1-average of x
        self._slow_mean_ema = 0.0  # beta2-average of x
        self._sq_ema = 0.0  # beta2-average of x**2

    @staticmethod
    def _check_beta(name: str, value: Any) -> float:
        if not _is_real(value) or not 0 <= value < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {value!r}.")
        return float(value)

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def can_decrease(self) -> bool:
        return self._scale > _to_float32(self.min_scale)

    @property
    def num_observations(self) -> int:
        """How many steps have contributed to the averages."""
        return self._count

    def log2_stats(self) -> tuple[float, float]:
        """Bias-corrected ``(mu, sigma)`` of log2(max |unscaled grad|).

        Raises:
            RuntimeError: before the first observation.
        """
        if self._count == 0:
            raise RuntimeError(
                "log2_stats() needs at least one update() with an observation."
            )
        mu = self._mean_ema / (1.0 - self.beta1**self._count)
        b2_corr = 1.0 - self.beta2**self._count
        slow_mu = self._slow_mean_ema / b2_corr
        variance = self._sq_ema / b2_corr - slow_mu * slow_mu
        return mu, math.sqrt(max(variance, 0.0))

    def _cutoff(self) -> float:
        mu, sigma = self.log2_stats()
        return mu + self.overflow_std_dev * sigma

    def _update(self, found_inf: bool, grad_max: float | None) -> None:
        if found_inf:
            # Censored observation: the max was at least `bound`. Feed one
            # binade more (never the bare bound, a fixed point when sigma is
            # 0; never below the model's own cutoff); see the class docstring.
            bound = math.log2(self.max_representable / self._scale)
            if self._count:
                bound = max(bound, self._cutoff())
            x = bound + self._OVERFLOW_MARGIN
        elif grad_max == 0.0:
            return
        else:
            x = math.log2(grad_max)
        self._count += 1
        self._mean_ema = self.beta1 * self._mean_ema + (1.0 - self.beta1) * x
        self._slow_mean_ema = self.beta2 * self._slow_mean_ema + (1.0 - self.beta2) * x
        self._sq_ema = self.beta2 * self._sq_ema + (1.0 - self.beta2) * (x * x)
        scale = self._scale_for(math.log2(self.max_representable) - self._cutoff())
        if found_inf:
            halved = self._scale * 2.0**-self._OVERFLOW_MARGIN
            scale = min(scale, _to_float32(max(halved, self.min_scale)))
        self._scale = scale

    def _scale_for(self, log2_scale: float) -> float:
        # Clamp in log space first: 2.0 ** 2000 raises OverflowError.
        if log2_scale >= math.log2(self.max_scale):
            scale = self.max_scale
        elif log2_scale <= math.log2(self.min_scale):
            scale = self.min_scale
        else:
            scale = min(max(2.0**log2_scale, self.min_scale), self.max_scale)
        rounded = _to_float32(scale)
        return rounded if math.isfinite(rounded) else _FLOAT32_MAX

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self._scale,
            "num_observations": self._count,
            "mean_ema": self._mean_ema,
            "slow_mean_ema": self._slow_mean_ema,
            "sq_ema": self._sq_ema,
        }

    def _load_state(self, state: dict[str, float | int]) -> None:
        scale = _load_scale(state["scale"])
        count = _load_count("num_observations", state["num_observations"])
        emas = []
        for key in ("mean_ema", "slow_mean_ema", "sq_ema"):
            value = float(state[key])
            if not math.isfinite(value):
                raise ValueError(
                    f"state_dict[{key!r}] must be finite, got {state[key]!r}."
                )
            emas.append(value)
        self._scale, self._count = scale, count
        self._mean_ema, self._slow_mean_ema, self._sq_ema = emas

    def __repr__(self) -> str:
        return (
            f"LogNormalLossScaler(scale={self._scale!r}, num_observations={self._count}, "
            f"min_scale={self.min_scale!r}, max_scale={self.max_scale!r}, "
            f"beta1={self.beta1!r}, beta2={self.beta2!r}, "
            f"overflow_std_dev={self.overflow_std_dev!r}, "
            f"max_representable={self.max_representable!r})"
        )


_CONFIG_ATTRS = (
    "dtype",
    "use_dynamic_loss_scaling",
    "init_loss_scaling",
    "loss_scaling_algorithm",
    "incr_every_n_steps",
    "decr_every_n_nan_or_inf",
    "incr_ratio",
    "decr_ratio",
    "min_loss_scaling",
    "max_loss_scaling",
)


def build_loss_scaler(cfg: Any) -> LossScaler:
    """The loss scaler an ``AmpConfig`` (or any object with its attribute names) asks for.

    ``dtype="bfloat16"`` gives :class:`UnitLossScaler`; otherwise
    ``use_dynamic_loss_scaling=False`` gives
    ``StaticLossScaler(init_loss_scaling)``, and ``loss_scaling_algorithm``
    picks :class:`BackoffLossScaler` or :class:`LogNormalLossScaler`.

    Example::

        scaler = build_loss_scaler(strategy.amp_config)

    Raises:
        TypeError: ``cfg`` lacks one of AmpConfig's attributes.
        ValueError: an unknown dtype or algorithm, or an invalid value.
    """
    missing = [name for name in _CONFIG_ATTRS if not hasattr(cfg, name)]
    if missing:
        raise TypeError(
            f"build_loss_scaler needs an AmpConfig-like object; {type(cfg).__name__} "
            f"has no attribute(s) {missing}."
        )
    if cfg.dtype == "bfloat16":
        return UnitLossScaler()
    if cfg.dtype != "float16":
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {cfg.dtype!r}.")
    if not cfg.use_dynamic_loss_scaling:
        return StaticLossScaler(cfg.init_loss_scaling)
    if cfg.loss_scaling_algorithm == "backoff":
        return BackoffLossScaler(
            init_scale=cfg.init_loss_scaling,
            incr_every_n_steps=cfg.incr_every_n_steps,
            decr_every_n_nan_or_inf=cfg.decr_every_n_nan_or_inf,
            incr_ratio=cfg.incr_ratio,
            decr_ratio=cfg.decr_ratio,
            min_scale=cfg.min_loss_scaling,
            max_scale=cfg.max_loss_scaling,
        )
    if cfg.loss_scaling_algorithm == "lognormal":
        return LogNormalLossScaler(
            init_scale=cfg.init_loss_scaling,
            min_scale=cfg.min_loss_scaling,
            max_scale=cfg.max_loss_scaling,
        )
    raise ValueError(
        f"loss_scaling_algorithm must be 'backoff' or 'lognormal', got "
        f"{cfg.loss_scaling_algorithm!r}."
    )
