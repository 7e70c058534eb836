"""How work is spread over ranks: process group, data parallel, comm hooks.

``fleet.init`` and ``fleet.distributed_model`` use these; they are usable
alone::

    from distamp.distributed import DataParallel, LowPrecisionAllReduce
"""

from distamp.distributed.comm_hooks import (
    CommStats,
    LowPrecisionAllReduce,
    low_precision_allreduce_hook,
)
from distamp.distributed.process_group import (
    WorldInfo,
    default_backend,
    default_device,
    init_process_group,
    world_info_from_env,
)
from distamp.model.data_parallel import DataParallel, strategy_fp32_parameters

__all__ = [
    "CommStats",
    "DataParallel",
    "LowPrecisionAllReduce",
    "WorldInfo",
    "default_backend",
    "default_device",
    "init_process_group",
    "low_precision_allreduce_hook",
    "strategy_fp32_parameters",
    "world_info_from_env",
]
