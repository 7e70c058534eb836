"""Choosing the precision plugin a strategy asks for.

Apart from :mod:`distamp.core.precision` because the sharded plugin
(:mod:`distamp.sharding.sharded_precision`) builds on that module's classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from distamp.core.precision import FullPrecision, MixedPrecision, PureLowPrecision
from distamp.sharding.fully_sharded_precision import FullyShardedPrecision
from distamp.sharding.sharded_precision import ShardedPrecision
from distamp.strategy import DistributedStrategy
from distamp.suggest import listed

__all__ = ["precision_for"]


def precision_for(
    strategy: DistributedStrategy, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None = None
) -> FullPrecision:
    """The plugin ``strategy`` asks for: AMP off, O1 or O2, sharded over ``group`` with ``strategy.sharding``.

    Raises:
        TypeError: a complex parameter with ``strategy.amp`` or ``strategy.sharding``.
    """
    _refuse_complex(strategy, params)
    _refuse_fp16_weights_in_o1(strategy, params)
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


def _refuse_fp16_weights_in_o1(strategy: DistributedStrategy, params: Sequence[nn.Parameter]) -> None:
    """O1 updates the parameters themselves: FP16 ones would be trained with no FP32 master (GradScaler refuses)."""
    if not strategy.amp or strategy.amp_config.use_pure_fp16:
        return
    fp16 = [i for i, p in enumerate(params) if p.requires_grad and p.dtype == torch.float16]
    if fp16:
        shown = listed([f"{i} (shape {tuple(params[i].shape)})" for i in fp16], 3)
        raise ValueError(
            f"parameter(s) {shown} are torch.float16, and O1 (amp_configs['use_pure_fp16'] = False) updates "
            "the parameters in their own dtype: they would be trained in FP16 with no FP32 master weights, and "
            "updates below FP16's resolution would be lost (torch's GradScaler refuses FP16 gradients for this "
            "reason). Keep the model in FP32 for O1 (autocast runs the ops in 16 bits), or set "
            "amp_configs['use_pure_fp16'] = True for FP16 weights with FP32 masters"
        )
