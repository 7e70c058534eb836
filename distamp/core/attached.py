"""The interfaces between the meta-optimizer, the model side and a compressor, as protocols.

``distamp.model`` (DDP, comm hooks, the forward hooks of
``overlap_param_gather``) and stage 3's ``FullyShardedModel`` work with the
meta-optimizers attached to a model, but must not depend on
:mod:`distamp.optim` (the dependency runs the other way). These protocols
name exactly what they read; ``AmpOptimizer`` satisfies
:class:`AttachedOptimizer` and :class:`FullyShardedOptimizer`, and
``distamp.compression``'s PowerSGD hook satisfies :class:`GradCompressor`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["AttachedOptimizer", "FullyShardedOptimizer", "GradCompressor", "ModelPrecision"]


@runtime_checkable
class GradCompressor(Protocol):
    """What an optimizer needs from a gradient compressor whose state depends on the step verdict."""

    def bind(self, loss_scale: Callable[[], float]) -> None:
        """Where the hook reads the loss scale the gradients it gets are multiplied by."""

    def resolve(self, applied: bool) -> None:
        """The agreed verdict of the step whose gradients were communicated: keep or drop their state."""

    def discard_attempt(self) -> None:
        """The step's gradients are computed again (an overflow retry): drop their state, keep counting the step."""

    def gradients_replaced(self) -> None:
        """The gradients were cleared or replaced since this step's last communication (a new backward follows)."""

    def state_dict(self) -> dict:
        """This rank's compressor state (tensors and plain numbers)."""

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""

    def step_report(self) -> tuple[int | None, float | None]:
        """``(bytes this rank sent, compression rate)`` of the last step's gradient communication."""


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

    def grads_await_step(self) -> bool:
        """Whether the last backward's gradients wait for ``step()`` (outside a gradient-merge window)."""

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


class ModelPrecision(Protocol):
    """What a model wrapper needs of ``distamp.amp``: the forward precision of a model's modules."""

    def fp32_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """O2's modules whose parameters stay FP32 (``custom_black_varnames`` ones, norms)."""

    def keep_black_modules_in_fp32(self, model: nn.Module) -> Any:
        """Run ``custom_black_varnames`` modules in FP32 from now on; a handle with ``remove()``, or None."""
