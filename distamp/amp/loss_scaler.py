"""Moved to :mod:`distamp.optim.loss_scaler`; this name keeps old imports working."""

from distamp.optim.loss_scaler import (
    BackoffLossScaler,
    LogNormalLossScaler,
    LossScaler,
    StaticLossScaler,
    UnitLossScaler,
    build_loss_scaler,
)

__all__ = [
    "BackoffLossScaler",
    "LogNormalLossScaler",
    "LossScaler",
    "StaticLossScaler",
    "UnitLossScaler",
    "build_loss_scaler",
]
