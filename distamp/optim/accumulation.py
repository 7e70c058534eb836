"""Gradient merge (Fleet's ``gradient_merge``): K micro-batches, one step.

:class:`GradientMerge` counts the ``backward`` calls of a window. The
meta-optimizer divides each micro-batch's loss by K (with ``avg=True``), as
torch's own accumulation recipe does (``loss = loss / K`` before scaling),
so the accumulated gradient is the mean in every mode and anything that
reads it before ``step()`` (``torch.nn.utils.clip_grad_norm_`` included)
sees the same values with AMP on or off. The data-parallel model
communicates only on the last micro-batch of a window.
"""

from __future__ import annotations

import weakref
from typing import Any

from distamp.strategy import DistributedStrategy

__all__ = ["GradientMerge"]


class GradientMerge:
    """Where the current micro-batch sits in its gradient-merge window.

    Args:
        k_steps: micro-batches per optimizer step (1: no merging).
        avg: True: the merged gradient is the mean of the micro-batch
            gradients; False: their sum.

    Example::

        merge = GradientMerge(k_steps=4)
        for i in range(4):
            merge.count_backward()
        merge.window_complete      # True: step() applies now
    """

    def __init__(self, k_steps: int = 1, avg: bool = True) -> None:
        self.k_steps = k_steps
        self.avg = avg
        self.micro_steps = 0
        self._listeners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_strategy(cls, strategy: DistributedStrategy) -> GradientMerge:
        """The window ``strategy.gradient_merge_configs`` asks for (K = 1 when merging is off)."""
        if not strategy.gradient_merge:
            return cls()
        config = strategy.gradient_merge_config
        return cls(config.k_steps, config.avg)

    @property
    def loss_divisor(self) -> int:
        """What each micro-batch's loss is divided by: K with ``avg``, else 1."""
        return self.k_steps if self.avg else 1

    @property
    def is_accumulating(self) -> bool:
        """True inside a window, before its last micro-batch's backward."""
        return self.k_steps > 1 and 0 < self.micro_steps < self.k_steps

    @property
    def window_complete(self) -> bool:
        """True when the next ``step()`` closes a window (always without merging)."""
        return not self.is_accumulating

    @property
    def sync_next_backward(self) -> bool:
        """Whether the next ``backward`` is the last of its window (the one that communicates)."""
        following = 1 if self.micro_steps >= self.k_steps else self.micro_steps + 1
        return following >= self.k_steps

    def count_backward(self) -> None:
        """Record one micro-batch's backward (a full window not stepped starts a new one)."""
        if self.micro_steps >= self.k_steps:
            self.micro_steps = 0
        self.micro_steps += 1

    def reset(self) -> None:
        """The window was stepped: the next backward starts a new one."""
        self.micro_steps = 0

    def add_listener(self, listener: Any, owner: Any) -> None:
        """Keep ``listener.set_grad_sync(owner, flag)`` told whether the next backward communicates.

        ``fleet.distributed_model`` registers its model, so DDP all-reduces
        only on the last micro-batch of a window.
        """
        self._listeners[listener] = owner
        listener.set_grad_sync(owner, self.sync_next_backward)

    def publish(self) -> None:
        """Tell every listener whether the next backward communicates."""
        flag = self.sync_next_backward
        for listener, owner in list(self._listeners.items()):
            listener.set_grad_sync(owner, flag)
