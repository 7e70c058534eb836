"""Moved to :mod:`distamp.optim.optimizer`; this name keeps old imports working."""

from distamp.optim.optimizer import AmpOptimizer

__all__ = ["AmpOptimizer"]
