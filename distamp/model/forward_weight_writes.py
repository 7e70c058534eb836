"""Modules that write their own parameters during forward, which data parallelism cannot keep in step.

``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag(max_norm=...)``
renormalise, in place and during forward, the rows of their weight that the
batch looks up. Under data parallelism each rank looks up other rows, so each
rank rewrites other rows of what should be one replica: with torch's DDP
(and distamp's stages 0-2) the replicas drift apart from the first such
forward. At stage 3 the forward runs on FSDP2's gathered copy of the weight,
which is freed after use, so the renormalisation is lost and ``max_norm``
does nothing at all.
"""

from __future__ import annotations

from torch import nn

from distamp.model_views import unwrap_model
from distamp.suggest import listed
from distamp.user_warning import warn_user

__all__ = ["check_forward_weight_writes"]

_FIX = ("renormalise once per step, the same on every rank, after optimizer.step() (e.g. "
        "`with torch.no_grad(): emb.weight.renorm_(2, 0, max_norm)`), or build the embedding without max_norm")


def _renormalising(model: nn.Module) -> list[str]:
    """Qualified names (in the user's model) of the embeddings that renormalise their weight in forward."""
    return [
        name or "<root>"
        for name, module in unwrap_model(model).named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None
    ]


def check_forward_weight_writes(model: nn.Module, world_size: int, fully_sharded: bool) -> None:
    """Refuse (stage 3) or warn about (several ranks) embeddings built with ``max_norm``.

    Args:
        model: the model given to ``fleet.distributed_model``.
        world_size: the data-parallel world size.
        fully_sharded: sharding stage 3 (FSDP2) is on.

    Raises:
        ValueError: at stage 3, naming the modules and the fix: there the
            in-place renormalisation writes a gathered copy that FSDP2
            frees, so ``max_norm`` would be ignored.
    """
    names = _renormalising(model)
    if not names:
        return
    shown = listed([f"model.{n}" for n in names], 3)
    if fully_sharded:
        raise ValueError(
            f"{shown}: an embedding with max_norm renormalises the rows it looks up in place during forward; at "
            "sharding stage 3 the forward runs on FSDP2's gathered copy of the weight, which is freed after use, "
            f"so the renormalisation would be lost and max_norm ignored. {_FIX[0].upper()}{_FIX[1:]}, or use "
            "sharding stage 1 or 2"
        )
    if world_size > 1:
        warn_user(
            f"{shown}: an embedding with max_norm renormalises, in place during forward, the rows this rank's "
            f"batch looks up, so the ranks rewrite different rows and their replicas drift apart (as under torch's "
            f"DDP; strategy.check_replicas_every catches it). To keep them identical, {_FIX}"
        )
