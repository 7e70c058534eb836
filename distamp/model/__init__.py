"""The model side of the meta-optimizer: ``fleet.distributed_model``'s DDP wrapper.

:class:`~distamp.model.data_parallel.DataParallel` composes the capabilities'
gradient reductions on torch's DDP reducer: the 16-bit wire hook, sharding
stage 1's reduce-scatter hook or stage 2's slice reducer, PowerSGD. It talks
to the optimizers attached to it only through the protocols of
:mod:`distamp.core.attached`. Stage 3's wrapper is
:class:`~distamp.sharding.fully_sharded.FullyShardedModel`.
"""

from distamp.model.data_parallel import DataParallel, strategy_fp32_parameters

__all__ = ["DataParallel", "strategy_fp32_parameters"]
