"""DDP's reducer errors in backward, re-raised with what a distamp user changes to fix them.

torch's message for a gradient hook that fires twice ("Expected to mark a
variable ready only once") suggests ``_set_static_graph()``, a private DDP
method a distamp user never calls; a static graph whose first backward does
not communicate gets an internal assert that asks for a bug report.
:func:`explain_ddp_errors` names the distamp-level causes and fixes, and
chains torch's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from distamp.torch_compat import is_ddp_ready_twice_error, is_ddp_static_graph_unsynced_error

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

_STATIC_GRAPH_UNSYNCED = (
    "fleet.distributed_model(..., static_graph=True): DDP records its static graph on the first backward, which "
    "must communicate, but this first backward ran inside model.no_sync() (or with "
    "model.require_backward_grad_sync = False), and torch's reducer asserted (torch's message is below). Run the "
    "first step's backward passes synced (no_sync() from the second step on), or remove static_graph=True (for "
    "reentrant activation checkpointing, checkpoint with use_reentrant=False instead)"
)


@contextlib.contextmanager
def explain_ddp_errors() -> Iterator[None]:
    """Re-raise DDP's "marked as ready twice" error and its static graph's assert inside the block with the
    distamp-level fixes."""
    try:
        yield
    except RuntimeError as exc:
        if is_ddp_ready_twice_error(exc):
            raise RuntimeError(f"{_READY_TWICE}. torch: {exc}") from exc
        if is_ddp_static_graph_unsynced_error(exc):
            raise RuntimeError(f"{_STATIC_GRAPH_UNSYNCED}. torch: {exc}") from exc
        raise
