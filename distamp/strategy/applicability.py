"""Strategy settings the chosen data-parallel path would ignore: refused before any collective.

Each key is validated on its own when assigned; whether it does anything
depends on the others (sharding stage, AMP) and on the world size, known
only when ``fleet.distributed_optimizer`` / ``fleet.distributed_model`` run.
:func:`check_applicable` refuses, there, a setting the path would accept and
silently ignore:

============================  =========================================================
setting                        applies to
============================  =========================================================
gradient_predivide_factor      the all-reduce without sharding (AMP, PowerSGD), 1..world
find_unused_parameters=True    DDP (no sharding, stage 1, PowerSGD) and stage 2's reducer
fuse_grad_size_in_MB           DDP's buckets, stages 1 and 2's buckets, PowerSGD
============================  =========================================================

Stage 3 (FSDP2) reduce-scatters unit by unit (``sharding_configs["units"]``),
with the sum taken in FP32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distamp.strategy.distributed_strategy import DistributedStrategy

__all__ = ["check_applicable"]



def check_applicable(strategy: DistributedStrategy, world_size: int) -> None:
    """``ValueError`` for a setting of ``strategy`` that a ``world_size``-rank job would ignore or refuse later.

    Raises:
        ValueError: naming the key, its value and why, for: ``amp_configs
            ['gradient_predivide_factor']`` with sharding (any stage) or
            above ``world_size``; ``find_unused_parameters=True`` or a
            ``fuse_grad_size_in_MB`` other than 25 with sharding stage 3.
    """
    from distamp.strategy.distributed_strategy import DEFAULT_FUSE_GRAD_SIZE_IN_MB as default_bucket_mb

    stage = strategy.sharding_config.stage if strategy.sharding else 0
    factor = strategy.amp_config.gradient_predivide_factor
    if strategy.amp and factor is not None:
        if stage:
            raise ValueError(
                f"amp_configs['gradient_predivide_factor']={factor!r} applies only without sharding (the "
                f"all-reduce of plain data parallelism and of PowerSGD); sharding stage {stage} reduce-scatters "
                "gradients with the sum taken in FP32, which cannot overflow, so nothing is pre-divided. Remove "
                "the key (or set it to None)"
            )
        if world_size > 1 and factor > world_size:
            raise ValueError(
                f"amp_configs['gradient_predivide_factor']={factor!r} must be between 1 and the world size "
                f"{world_size}: the gradients are divided by it before the all-reduce and by world_size / factor "
                "after. Lower it, or remove the key (None: the world size)"
            )
    if stage != 3:
        return
    if strategy.find_unused_parameters:
        raise ValueError(
            "strategy.find_unused_parameters=True has no effect with sharding stage 3: it is DDP's option, and "
            "stage 3 uses no DDP (torch's FSDP2 reduce-scatters each unit's gradients after its backward). "
            "Set it to False"
        )
    if strategy.fuse_grad_size_in_MB != default_bucket_mb:
        raise ValueError(
            f"strategy.fuse_grad_size_in_MB={strategy.fuse_grad_size_in_MB!r} has no effect with sharding stage "
            "3: FSDP2 all-gathers and reduce-scatters one unit at a time, so sharding_configs['units'] decides "
            f"what travels together. Leave it at its default {default_bucket_mb}, or choose the units instead"
        )
