"""The data-parallel group, asked for in one place.

distamp runs collectives only when ``torch.distributed`` is initialised and
the group has more than one rank; everything else (a script without a
launcher, a unit test) is a one-process world. Code asks these helpers
instead of calling ``dist.is_initialized()`` itself.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["data_parallel_group", "group_rank", "group_size", "is_distributed"]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default group exists."""
    return dist.is_available() and dist.is_initialized()


def data_parallel_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup | None:
    """``group`` if given, else the default group when one exists, else ``None``."""
    if group is not None:
        return group
    return dist.group.WORLD if is_distributed() else None


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in the data-parallel group (1 without one)."""
    group = data_parallel_group(group)
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in the data-parallel group (0 without one)."""
    group = data_parallel_group(group)
    return dist.get_rank(group) if group is not None else 0
