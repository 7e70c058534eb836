"""Paddle's dynamic loss scaling (``update_loss_scaling``): counters, growth and back-off."""

from __future__ import annotations

import math

from distamp.scaling.scaler_base import (
    LossScaler,
    _check_bounds,
    _check_init_in_bounds,
    _check_int,
    _check_open_interval,
    _check_scale,
    _load_count,
    _load_scale,
    _to_float32,
)

__all__ = ["BackoffLossScaler"]


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

    def decrease_now(self) -> bool:
        """Shrink the scale by ``decr_ratio`` now and restart both counters; False at ``min_scale``."""
        if not self.can_decrease:
            return False
        self._scale = self._decreased()
        self._good = self._bad = 0
        return True

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
