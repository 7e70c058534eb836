"""Moved to :mod:`distamp.distributed.process_group`; this name keeps old imports working."""

from distamp.distributed.process_group import (
    WorldInfo,
    default_backend,
    default_device,
    init_process_group,
    world_info_from_env,
)

__all__ = ["WorldInfo", "default_backend", "default_device", "init_process_group", "world_info_from_env"]
