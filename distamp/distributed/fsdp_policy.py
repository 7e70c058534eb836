"""Stage 3's ``MixedPrecisionPolicy`` for FSDP2, from ``amp_configs``.

=========  ======================  ============================  ==============
mode       ``param_dtype``         sharded parameter (master)    gradient sum
=========  ======================  ============================  ==============
O2         ``dtype`` (16-bit)      FP32                          FP32
O1         ``None`` (FP32)         FP32                          FP32
amp off    ``None`` (FP32)         FP32                          FP32
=========  ======================  ============================  ==============

``reduce_dtype`` is always FP32: it is the dtype of FSDP's reduce-scatter
buffers and of the sum, so gradients accumulate in FP32 as in stages 1 and 2
(across ranks and across gradient-merge micro-batches). What crosses the
wire is ``comm_dtype`` (``amp_configs["comm_dtype"]``, default ``dtype``;
FP32 with AMP off), sent by :class:`~distamp.distributed.fsdp_reduce.WireReduceScatter`.

In O2 the modules O2 keeps in FP32 (normalization layers with
``keep_norm_fp32``, ``custom_black_varnames``) are units of their own with
:attr:`UnitPolicies.fp32`: their parameters are all-gathered in FP32, and
16-bit inputs reach them as in unsharded O2 (black modules cast them up).
O1 computes under ``fleet.auto_cast()`` on FP32 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from distamp.strategy import DistributedStrategy

__all__ = ["UnitPolicies", "unit_policies", "wire_dtype"]


@dataclass(frozen=True)
class UnitPolicies:
    """The policy of ordinary units and of the units O2 keeps in FP32."""

    default: MixedPrecisionPolicy
    fp32: MixedPrecisionPolicy


def unit_policies(strategy: DistributedStrategy) -> UnitPolicies:
    """The policies ``strategy`` asks for (see the module docstring)."""
    pure = strategy.amp and strategy.amp_config.use_pure_fp16
    param_dtype = strategy.amp_config.torch_dtype if pure else None
    # cast_forward_inputs: in O2 floating inputs of a unit are cast to its 16-bit param_dtype, as unsharded
    # O2 casts inputs for its 16-bit weights; FP32 units take inputs as they come (as unsharded O2).
    default = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=pure)
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return UnitPolicies(default, fp32)


def wire_dtype(strategy: DistributedStrategy) -> torch.dtype:
    """The dtype of gradients on the wire: ``comm_dtype`` (default ``dtype``) with AMP, FP32 without."""
    return strategy.amp_config.comm_torch_dtype if strategy.amp else torch.float32
