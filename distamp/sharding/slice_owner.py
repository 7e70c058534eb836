"""What sharding's reducers read of a rank's sharded FP32 masters, as protocols.

Stage 1's reduce-scatter hook and stage 2's slice reducer sum each bucket into
the slice this rank owns; :class:`~distamp.sharding.sharded_masters.ShardedMasters`
satisfies :class:`SliceOwner`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from distamp.core.flat_layout import FlatLayout

__all__ = ["GradSlice", "SliceOwner"]


class GradSlice(Protocol):
    """A rank's gradient slice (FP32, or O2's 16-bit dtype): the buffer the reduce-scatter sums into."""

    reduced: bool
    arrived: set[int]  # indices (in the owner's model_params) of parameters whose gradient was summed here
    deliveries: int  # backward passes whose gradients the stage-2 reducer summed here, ever

    @property
    def buffer(self) -> torch.Tensor:
        """The slice's elements, in the owner's flat order from its ``lo``."""


class SliceOwner(Protocol):
    """Sharded FP32 masters: which part of the flat parameter space this rank owns."""

    model_params: list[nn.Parameter]
    layout: FlatLayout
    lo: int
    grads: GradSlice
