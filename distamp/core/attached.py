"""What the data-parallel side needs of an optimizer, as protocols.

``distamp.distributed`` builds DDP, comm hooks and the forward hooks of
``overlap_param_gather`` for the meta-optimizers attached to a model, but it
must not depend on :mod:`distamp.optim` (the dependency runs the other way:
the optimizer uses the process group, the flag sync and the flat layouts).
These protocols name exactly what it reads; ``AmpOptimizer`` and
``ShardedMasters`` satisfy them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from distamp.compression.powersgd import GradCompressor
from distamp.sharding.flat_layout import FlatLayout

__all__ = ["AttachedOptimizer", "FullyShardedOptimizer", "GradSlice", "SliceOwner"]


class GradSlice(Protocol):
    """A rank's FP32 gradient slice: the buffer the reduce-scatter sums into."""

    buffer: torch.Tensor
    reduced: bool
    arrived: set[int]  # indices (in the owner's model_params) of parameters whose gradient was summed here
    deliveries: int  # backward passes whose gradients the stage-2 reducer summed here, ever


class SliceOwner(Protocol):
    """Sharded FP32 masters: which part of the flat parameter space this rank owns."""

    model_params: list[nn.Parameter]
    layout: FlatLayout
    lo: int
    grads: GradSlice


class AttachedOptimizer(Protocol):
    """A meta-optimizer attached to a data-parallel model (``fleet.distributed_model``)."""

    master_weights: Any  # MasterWeights or ShardedMasters: enabled, model_params, broadcast(), exact_fp32()
    precision: Any  # the precision plugin: stage, grad_accumulator

    def adopt_model(self, model: nn.Module, keep_fp32: list[nn.Parameter]) -> None:
        """The model is known: names for attribution, FP32-kept parameters restored."""

    def add_sync_listener(self, listener: Any) -> None:
        """Tell ``listener.set_grad_sync(optimizer, flag)`` whether the next backward communicates."""

    def finish_param_gather(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Complete the all-gather ``overlap_param_gather`` left running (for ``params``, or all)."""

    def bind_compressor(self, compressor: GradCompressor) -> None:
        """Report each step's agreed verdict to ``compressor`` (PowerSGD keeps or drops its state)."""

    def grads_reseated(self) -> None:
        """The model's ``.grad`` tensors were replaced by equal ones (DDP rebuilt its buckets)."""

    def defer_param_gather(self, deferred: bool) -> bool:
        """Whether ``step()`` may leave its all-gather to the model's forward hooks; True when it overlaps."""


class FullyShardedOptimizer(Protocol):
    """A meta-optimizer attached to a stage-3 model (``fleet.distributed_model`` on FSDP2)."""

    master_weights: Any  # ShardedParameters: model_params
    precision: Any  # the precision plugin: stage

    def adopt_model(self, model: nn.Module, keep_fp32: list[nn.Parameter]) -> None:
        """The model is known: names for attribution, ``check_nan_inf`` hooks."""

    def adopt_sharded_parameters(self, new_of: dict[int, nn.Parameter]) -> None:
        """``fully_shard`` replaced each parameter ``old`` by the DTensor ``new_of[id(old)]``."""

    def watch_local_grads(self, named_params: list[tuple[str, torch.Tensor]]) -> None:
        """``check_nan_inf``: also check these unsharded parameters' local gradients."""

    def add_sync_listener(self, listener: Any) -> None:
        """Tell ``listener.set_grad_sync(optimizer, flag)`` whether the next backward closes a merge window."""
