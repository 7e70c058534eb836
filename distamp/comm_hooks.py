"""Moved to :mod:`distamp.distributed.comm_hooks`; this name keeps old imports working."""

from distamp.distributed.comm_hooks import (
    CommStats,
    LowPrecisionAllReduce,
    low_precision_allreduce_hook,
)

__all__ = ["CommStats", "LowPrecisionAllReduce", "low_precision_allreduce_hook"]
