"""OpenSeq2Seq's "LogMax" loss scaling: a log-normal model of the gradient maximum."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from distamp.scaling.scaler_base import (
    LossScaler,
    _check_bounds,
    _check_init_in_bounds,
    _check_scale,
    _load_count,
    _load_scale,
    _to_float32,
)
from distamp.strategy.checks import FLOAT32_MAX, finite_float

__all__ = ["LogNormalLossScaler"]


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
        std_dev = finite_float(overflow_std_dev)
        if std_dev is None or std_dev < 0:
            raise ValueError(
                f"overflow_std_dev must be a finite number >= 0, got {overflow_std_dev!r}."
            )
        self.overflow_std_dev = std_dev
        largest = finite_float(max_representable)
        if largest is None or largest <= 0:
            raise ValueError(
                f"max_representable must be a finite number > 0, got {max_representable!r}."
            )
        self.max_representable = largest
        self._scale = _to_float32(init)
        self._count = 0
        self._mean_ema = 0.0  # beta1-average of x
        self._slow_mean_ema = 0.0  # beta2-average of x
        self._sq_ema = 0.0  # beta2-average of x**2

    @staticmethod
    def _check_beta(name: str, value: Any) -> float:
        number = finite_float(value)
        if number is None or not 0 <= number < 1:
            raise ValueError(f"{name} must be a number in [0, 1), got {value!r}.")
        return number

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def can_decrease(self) -> bool:
        return self._scale > _to_float32(self.min_scale)

    def decrease_now(self) -> bool:
        """Halve the scale now (the statistics are kept); False at ``min_scale``."""
        if not self.can_decrease:
            return False
        self._scale = _to_float32(max(self._scale * 2.0**-self._OVERFLOW_MARGIN, self.min_scale))
        return True

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
            assert grad_max is not None  # update() checked it on finite steps (needs_grad_max)
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
        return rounded if math.isfinite(rounded) else FLOAT32_MAX

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
