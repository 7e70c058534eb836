"""Moved to :mod:`distamp.distributed.data_parallel`; this name keeps old imports working."""

from distamp.distributed.data_parallel import DataParallel, strategy_fp32_parameters

__all__ = ["DataParallel", "strategy_fp32_parameters"]
