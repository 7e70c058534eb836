"""The communication core every capability builds on: process groups, the
16-bit wire hook (with ``grad_layout``: a hook's gradient indexed as its
parameter whatever the memory format), flag sync, fingerprint, replica
check, timeouts.

Nothing here imports a capability (``amp``, ``scaling``, ``sharding``,
``compression``) or a composer (``optim``, ``model``); usable alone::

    from distamp.distributed import LowPrecisionAllReduce, init_process_group
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

__all__ = [
    "CommStats",
    "LowPrecisionAllReduce",
    "WorldInfo",
    "default_backend",
    "default_device",
    "init_process_group",
    "low_precision_allreduce_hook",
    "world_info_from_env",
]
