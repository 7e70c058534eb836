"""`ShardingConfig`: the typed, validated form of ``strategy.sharding_configs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distamp.strategy.checks import as_bool, as_names, fail, is_integer
from distamp.strategy.config_base import Config

__all__ = ["ShardingConfig"]


@dataclass(frozen=True)
class ShardingConfig(Config):
    """Sharded optimizer state (ZeRO): the typed form of ``strategy.sharding_configs``.

    Stages 1 and 2: each rank owns a balanced contiguous slice of the flat
    parameter space and keeps the FP32 masters, the FP32 gradients and the
    inner optimizer's state of that slice only (ZeRO,
    https://arxiv.org/abs/1910.02054). Stage 3 shards the parameters too, on
    torch's FSDP2 (``fully_shard``), one unit of modules at a time.

    Example::

        cfg = ShardingConfig.from_dict({"stage": 2})
        cfg.stage                            # 2
    """

    _OWNER: ClassVar[str] = "sharding_configs"
    _STAGES: ClassVar[tuple[int, ...]] = (1, 2, 3)

    stage: int = 1
    """1: optimizer state, FP32 masters and FP32 gradients sharded; DDP's buckets reduce-scattered (16-bit on
    the wire, summed in FP32); 2: the same without DDP, keeping no full-size gradient (``.grad`` freed);
    3: parameters sharded too (torch's FSDP2 ``fully_shard``), all-gathered unit by unit for forward and
    backward."""

    overlap_param_gather: bool = False
    """Leave the all-gather of updated parameters running when ``step()`` returns and finish it, round by
    round, in the next forward of the ``fleet.distributed_model`` (as Megatron-LM's ``overlap_param_gather``):
    before each module runs for its own parameters, and before any torch function that forward calls reads a
    parameter or an alias of it (see :mod:`distamp.sharding.param_gather_hooks`). Parameters read outside
    a forward of the ``fleet.distributed_model`` before then are stale; ``optimizer.finish_param_gather()``
    completes it."""

    units: tuple[str, ...] = ()
    """Stage 3 only: module-name patterns (qualified names or fnmatch patterns, as ``custom_black_varnames``)
    of the modules sharded as one unit each (one all-gather before the unit runs, one reduce-scatter after its
    backward). Empty: every parameter-holding child of each ``nn.ModuleList`` / ``nn.Sequential`` (the model's
    repeated blocks), or, in a model without such containers, every submodule holding parameters of its own.
    A pattern that matches no module is an error naming the model's modules."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overlap_param_gather",
                           as_bool(self._OWNER, "overlap_param_gather", self.overlap_param_gather))
        object.__setattr__(self, "units", as_names(self._OWNER, "units", self.units, "module-name patterns"))
        value = self.stage
        if not is_integer(value) or int(value) not in self._STAGES:
            fail(self._OWNER, "stage", value, "one of " + ", ".join(str(s) for s in self._STAGES))
        object.__setattr__(self, "stage", int(value))
        if self.stage == 3 and self.overlap_param_gather:
            fail(self._OWNER, "overlap_param_gather", True, "False with stage 3",
                 " It overlaps the all-gather of stages 1 and 2 with the next forward; stage 3 all-gathers each "
                 "unit's parameters before it runs and prefetches the next unit's (FSDP2) already. Remove the key.")
        if self.stage != 3 and self.units:
            fail(self._OWNER, "units", list(self.units), "empty unless stage is 3",
                 f" Units are the modules stage 3 shards one by one; stage {self.stage} shards the flat parameter "
                 "space instead. Remove the key, or set 'stage': 3.")
