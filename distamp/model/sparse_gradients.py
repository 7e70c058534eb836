"""Refusing modules that make sparse gradients where distamp needs dense ones, before any collective."""

from __future__ import annotations

from torch import nn

from distamp.model_views import unwrap_model
from distamp.strategy import DistributedStrategy

__all__ = ["refuse_sparse_gradients"]


def refuse_sparse_gradients(model: nn.Module, strategy: DistributedStrategy) -> None:
    """Raise for an ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` under AMP or sharding.

    Loss scaling unscales and checks gradients with torch's fused dense
    kernel, and sharding cuts the flat gradient space into slices (stages
    1-2) or FSDP2 shards (stage 3); a sparse gradient fits neither, and
    would otherwise fail at the first step (AMP) or inside torch with no
    hint (sharding). Plain data parallelism with AMP off keeps DDP's sparse
    all-reduce.

    Raises:
        ValueError: naming the first such module and the fix.
    """
    if not (strategy.amp or strategy.sharding):
        return
    for name, module in unwrap_model(model).named_modules():  # the user's names, inside torch.compile's wrapper
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            needs = "strategy.amp (loss scaling and the inf/NaN check)" if strategy.amp else "strategy.sharding"
            raise ValueError(
                f"model.{name or '<root>'} is {type(module).__name__}(..., sparse=True), whose sparse gradients "
                f"{needs} cannot handle; build it with sparse=False (dense gradients)"
            )
