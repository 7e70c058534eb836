"""Stage 3's ``MixedPrecisionPolicy`` for FSDP2, from ``amp_configs``.

=========  ====================  ==========================  ====================  ==================
mode       ``param_dtype``       sharded parameter (master)  ``reduce_dtype``      sharded gradient
=========  ====================  ==========================  ====================  ==================
O2         ``dtype`` (16-bit)    FP32                        ``comm_dtype``        FP32
O1         ``None`` (FP32)       FP32                        ``comm_dtype``        FP32
amp off    ``None`` (FP32)       FP32                        ``None`` (FP32)       FP32
=========  ====================  ==========================  ====================  ==================

With AMP off ``reduce_dtype`` is ``None``: each unit reduces in its
parameters' dtype, FP32, or float64 for a float64 unit, which an FP32
``reduce_dtype`` would round.

``reduce_dtype`` is the wire dtype (``amp_configs["comm_dtype"]``, default
``dtype``): the dtype of FSDP's reduce-scatter buffers and of what crosses
the wire. :class:`~distamp.sharding.fsdp_comms.WireReduceScatter` adds
the ranks' chunks in FP32 and rounds the sum once; FSDP widens it into the
FP32 sharded gradient, where gradient-merge micro-batches accumulate.

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
    reduce_dtype = wire_dtype(strategy) if strategy.amp else None
    # No unit casts its inputs: as in unsharded O2, fleet.auto_cast() casts them op by op for the 16-bit
    # weights, and what the forward computes from FP32 inputs outside those ops (timestep embeddings,
    # indices, a loss inside forward) stays FP32.
    default = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    return UnitPolicies(default, fp32)


def wire_dtype(strategy: DistributedStrategy) -> torch.dtype:
    """The dtype of gradients on the wire: ``comm_dtype`` (default ``dtype``) with AMP, FP32 without."""
    return strategy.amp_config.comm_torch_dtype if strategy.amp else torch.float32
