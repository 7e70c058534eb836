"""Choosing the precision plugin a strategy asks for.

Apart from :mod:`distamp.core.precision` because the sharded plugin
(:mod:`distamp.sharding.sharded_precision`) builds on that module's classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from distamp.core.precision import FullPrecision, MixedPrecision, PureLowPrecision
from distamp.sharding.fully_sharded_precision import FullyShardedPrecision
from distamp.sharding.sharded_precision import ShardedPrecision
from distamp.strategy import DistributedStrategy

__all__ = ["precision_for"]


def precision_for(
    strategy: DistributedStrategy, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None = None
) -> FullPrecision:
    """The plugin ``strategy`` asks for: AMP off, O1 or O2, sharded over ``group`` with ``strategy.sharding``.

    Raises:
        TypeError: a complex parameter with ``strategy.amp`` or ``strategy.sharding``.
    """
    _refuse_complex(strategy, params)
    if strategy.sharding and strategy.sharding_config.stage == 3:
        return FullyShardedPrecision(params, strategy, group)
    if strategy.sharding:
        return ShardedPrecision(params, strategy, group)
    config = strategy.amp_config
    if not strategy.amp:
        return FullPrecision(params, config)
    return PureLowPrecision(params, config) if config.use_pure_fp16 else MixedPrecision(params, config)


def _refuse_complex(strategy: DistributedStrategy, params: Sequence[nn.Parameter]) -> None:
    if not (strategy.amp or strategy.sharding):
        return
    for i, p in enumerate(params):
        if p.is_complex():
            needs = "strategy.amp's fused unscale and inf/NaN check" if strategy.amp else "strategy.sharding's slices"
            raise TypeError(
                f"parameter {i} (shape {tuple(p.shape)}) is {p.dtype}, and {needs} take real floating-point "
                "parameters. Hold it as real numbers (a float parameter of torch.view_as_real's shape, viewed with "
                "torch.view_as_complex in the forward), or train without strategy.amp and strategy.sharding"
            )
