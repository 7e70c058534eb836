"""`DistributedStrategy` and the validated configs behind it.

Paddle Fleet users write ``strategy.amp_configs = {...}`` with plain dicts;
distamp keeps those names but stores each config in a frozen, typed
dataclass validated when it is built, so a typo or an out-of-range value
fails at the assignment line, not thousands of steps later::

    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 1024.0, "use_pure_fp16": True}
    strategy.amp_config.init_loss_scaling      # 1024.0, typed
    strategy.amp_configs = {"init_loss_scale": 1.0}
    # ValueError: amp_configs has no key 'init_loss_scale'. Did you mean
    # 'init_loss_scaling'? ...

Modules:

* :mod:`~distamp.strategy.distributed_strategy`: :class:`DistributedStrategy`.
* :mod:`~distamp.strategy.amp_config`, :mod:`~distamp.strategy.gradient_merge_config`,
  :mod:`~distamp.strategy.sharding_config`, :mod:`~distamp.strategy.powersgd_config`: the typed configs, on
  :mod:`~distamp.strategy.config_base` (dict round trip, typo hints).
* :mod:`~distamp.strategy.views`: the read-only dicts ``strategy.amp_configs`` and co. return.
* :mod:`~distamp.strategy.checks` and :mod:`~distamp.strategy.op_checks`: the value checks,
  shared with ``auto_cast()``, the loss scalers and the black-module patterns.
* :mod:`~distamp.strategy.applicability`: settings the chosen path would ignore, refused by
  ``fleet.distributed_optimizer`` and ``fleet.distributed_model``.
"""

from distamp.strategy.amp_config import AmpConfig
from distamp.strategy.distributed_strategy import DEFAULT_FUSE_GRAD_SIZE_IN_MB, DistributedStrategy

# Pickles made while this package was one module name distamp.strategy._restore_strategy.
from distamp.strategy.distributed_strategy import _restore_strategy as _restore_strategy
from distamp.strategy.gradient_merge_config import GradientMergeConfig
from distamp.strategy.op_checks import validate_dtype, validate_op_lists
from distamp.strategy.powersgd_config import PowerSGDConfig
from distamp.strategy.sharding_config import ShardingConfig

__all__ = [
    "DEFAULT_FUSE_GRAD_SIZE_IN_MB",
    "AmpConfig",
    "DistributedStrategy",
    "GradientMergeConfig",
    "PowerSGDConfig",
    "ShardingConfig",
    "validate_dtype",
    "validate_op_lists",
]
