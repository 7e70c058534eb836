"""Loss scalers: how the FP16 loss scale moves from one optimizer step to the next.

Algorithms:

* :class:`StaticLossScaler`: a constant scale.
* :class:`UnitLossScaler`: a constant 1.0, for BF16.
* :class:`BackoffLossScaler`: Paddle's ``update_loss_scaling``.
* :class:`LogNormalLossScaler`: OpenSeq2Seq's "LogMax".

:func:`build_loss_scaler` picks one from an ``AmpConfig``; the interface is
:class:`LossScaler` (:mod:`distamp.scaling.scaler_base`).
"""

from __future__ import annotations

from typing import Any

from distamp.scaling.backoff_scaler import BackoffLossScaler
from distamp.scaling.lognormal_scaler import LogNormalLossScaler
from distamp.scaling.scaler_base import LossScaler, StaticLossScaler, UnitLossScaler

__all__ = [
    "BackoffLossScaler",
    "LogNormalLossScaler",
    "LossScaler",
    "StaticLossScaler",
    "UnitLossScaler",
    "build_loss_scaler",
]


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
