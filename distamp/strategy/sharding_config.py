"""`ShardingConfig`: the typed, validated form of ``strategy.sharding_configs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distamp.strategy.checks import as_bool, fail, is_integer
from distamp.strategy.config_base import Config

__all__ = ["ShardingConfig"]


@dataclass(frozen=True)
class ShardingConfig(Config):
    """Sharded optimizer state (ZeRO): the typed form of ``strategy.sharding_configs``.

    Each rank owns a balanced contiguous slice of the flat parameter space
    and keeps the FP32 masters, the FP32 gradients and the inner optimizer's
    state of that slice only (ZeRO, https://arxiv.org/abs/1910.02054).

    Example::

        cfg = ShardingConfig.from_dict({"stage": 2})
        cfg.stage                            # 2
    """

    _OWNER: ClassVar[str] = "sharding_configs"
    _STAGES: ClassVar[tuple[int, ...]] = (1, 2)

    stage: int = 1
    """1: optimizer state, FP32 masters and FP32 gradients sharded; DDP's buckets reduce-scattered (16-bit on
    the wire, summed in FP32); 2: the same without DDP, keeping no full-size gradient (``.grad`` freed)."""

    overlap_param_gather: bool = False
    """Leave the all-gather of updated parameters running when ``step()`` returns and finish it, round by
    round, in the next forward of the ``fleet.distributed_model`` (as Megatron-LM's ``overlap_param_gather``):
    before each module runs for its own parameters, and before any torch function that forward calls reads a
    parameter or an alias of it (see :mod:`distamp.distributed.param_gather_hooks`). Parameters read outside
    a forward of the ``fleet.distributed_model`` before then are stale; ``optimizer.finish_param_gather()``
    completes it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap_param_gather",
                           as_bool(self._OWNER, "overlap_param_gather", self.overlap_param_gather))
        value = self.stage
        if not is_integer(value) or int(value) not in self._STAGES:
            hint = " Stage 3 (sharded parameters) is not implemented; stage 2 saves the most memory." if (
                not isinstance(value, bool) and value == 3) else ""
            fail(self._OWNER, "stage", value, "one of " + ", ".join(str(s) for s in self._STAGES), hint)
        object.__setattr__(self, "stage", int(value))
