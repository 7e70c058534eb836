"""The AMP meta-optimizer and its parts: loss scalers and FP32 master weights.

``fleet.distributed_optimizer`` returns :class:`AmpOptimizer`; the parts are
usable alone::

    from distamp.optim import AmpOptimizer, MasterWeights, build_loss_scaler
"""

from distamp.core.master_weights import MasterWeights
from distamp.optim.optimizer import AmpOptimizer
from distamp.scaling.loss_scaler import (
    BackoffLossScaler,
    LogNormalLossScaler,
    LossScaler,
    StaticLossScaler,
    UnitLossScaler,
    build_loss_scaler,
)

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
