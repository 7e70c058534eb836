"""Refusing modules that make sparse gradients where distamp needs dense ones, before any collective."""

from __future__ import annotations

from torch import nn

from distamp.model_views import unwrap_model
from distamp.strategy import DistributedStrategy

__all__ = ["refuse_sparse_gradients"]


def refuse_sparse_gradients(model: nn.Module, strategy: DistributedStrategy) -> None:
    """Raise for an ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` under AMP, sharding or PowerSGD.

    Loss scaling unscales and checks gradients with torch's fused dense
    kernel, sharding cuts the flat gradient space into slices (stages
    1-2) or FSDP2 shards (stage 3), and PowerSGD's hook factors dense
    gradient matrices; a sparse gradient fits none of them, and would
    otherwise fail at the first step (AMP), inside torch with no hint
    (sharding) or in the hook's first backward (PowerSGD). Plain data
    parallelism with AMP off keeps DDP's sparse all-reduce.

    Raises:
        ValueError: naming the first such module and the fix.
    """
    if strategy.amp:
        needs = "strategy.amp (loss scaling and the inf/NaN check)"
    elif strategy.sharding:
        needs = "strategy.sharding"
    elif strategy.powersgd:
        needs = "strategy.powersgd (low-rank compression of dense gradients)"
    else:
        return
    for name, module in unwrap_model(model).named_modules():  # the user's names, inside torch.compile's wrapper
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"model.{name or '<root>'} is {type(module).__name__}(..., sparse=True), whose sparse gradients "
                f"{needs} cannot handle; build it with sparse=False (dense gradients)"
            )
