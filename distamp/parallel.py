"""Moved to :mod:`distamp.distributed.data_parallel`; this name keeps old imports working."""

from distamp.distributed.data_parallel import DataParallel, black_parameters

__all__ = ["DataParallel", "black_parameters"]
