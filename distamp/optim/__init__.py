"""The AMP meta-optimizer and its parts: loss scalers and FP32 master weights.

``fleet.distributed_optimizer`` returns :class:`AmpOptimizer`; the parts are
usable alone::

    from distamp.optim import AmpOptimizer, MasterWeights, build_loss_scaler
"""

from distamp.optim.loss_scaler import (
    BackoffLossScaler,
    LogNormalLossScaler,
    LossScaler,
    StaticLossScaler,
    UnitLossScaler,
    build_loss_scaler,
)
from distamp.optim.master_weights import MasterWeights
from distamp.optim.optimizer import AmpOptimizer

__all__ = [
    "AmpOptimizer",
    "BackoffLossScaler",
    "LogNormalLossScaler",
    "LossScaler",
    "MasterWeights",
    "StaticLossScaler",
    "UnitLossScaler",
    "build_loss_scaler",
]
