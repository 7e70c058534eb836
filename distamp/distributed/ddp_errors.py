"""DDP's reducer errors in backward, re-raised with what a distamp user changes to fix them.

torch's message for a gradient hook that fires twice ("Expected to mark a
variable ready only once") suggests ``_set_static_graph()``, a private DDP
method a distamp user never calls. :func:`explain_ddp_errors` names the
distamp-level causes and fixes, and chains torch's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from distamp.torch_compat import is_ddp_ready_twice_error

__all__ = ["explain_ddp_errors"]

_READY_TWICE = (
    "DDP's reducer got a gradient for the same parameter twice in one backward (torch's message is below). "
    "The usual cause is reentrant activation checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) "
    "together with strategy.find_unused_parameters=True, or a parameter that a reentrant checkpoint region uses "
    "more than once. Fix one of: checkpoint with use_reentrant=False (torch's recommended mode); "
    "fleet.distributed_model(model, static_graph=True) if every step uses the same parameters (DDP's static "
    "graph, what torch's message calls _set_static_graph()); strategy.find_unused_parameters=False if every "
    "parameter gets a gradient in every step; or sharding stage 2 (strategy.sharding_configs = {'stage': 2}), "
    "whose reducer takes reentrant checkpointing with find_unused_parameters as long as no parameter is used both "
    "inside and outside the checkpointed region"
)


@contextlib.contextmanager
def explain_ddp_errors() -> Iterator[None]:
    """Re-raise DDP's "marked as ready twice" error inside the block with the distamp-level fixes."""
    try:
        yield
    except RuntimeError as exc:
        if not is_ddp_ready_twice_error(exc):
            raise
        raise RuntimeError(f"{_READY_TWICE}. torch: {exc}") from exc
