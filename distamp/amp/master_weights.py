"""Moved to :mod:`distamp.optim.master_weights`; this name keeps old imports working."""

from distamp.optim.master_weights import MasterWeights

__all__ = ["MasterWeights"]
