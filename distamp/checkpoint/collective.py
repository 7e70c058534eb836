"""Ranks agree on a checkpoint through the process group's store, not its collectives.

While rank 0 writes or hashes a large checkpoint, the other ranks wait. A
collective would hold them for as long as the process group's timeout
allows (NCCL's default is 10 minutes) and then fail them, though nothing is
wrong. So the ranks exchange their small messages through the key-value
store (:class:`~distamp.distributed.store_exchange.StoreExchange`), whose
waits take a timeout of their own: :data:`DEFAULT_TIMEOUT` unless the
caller passes one. Keys are ``distamp.checkpoint/<call number>/...``: every
rank counts its calls to ``save_checkpoint`` / ``load_latest_checkpoint``
(both are collective, so the counts agree).
"""

from __future__ import annotations

import numbers
from datetime import timedelta
from typing import Any

from distamp.distributed.store_exchange import StoreExchange, rank_and_world

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "check_timeout", "rank_and_world"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits for the others inside one checkpoint call, by default."""

def check_timeout(timeout: Any) -> timedelta:
    """``timeout`` (seconds, a ``timedelta`` or None for the default) as a positive ``timedelta``."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(
            f"timeout must be a number of seconds, a datetime.timedelta or None, got {type(timeout).__name__}"
        )
    if not value > timedelta(0):
        raise ValueError(f"timeout={timeout!r} must be positive, e.g. timeout=timedelta(hours=1)")
    return value


class Coordinator(StoreExchange):
    """The message rounds of one collective checkpoint call (a :class:`StoreExchange`).

    Args:
        operation: a label for the keys and messages, e.g. ``"save step 200"``.
        timeout: how long one wait may take.
    """

    def __init__(self, operation: str, timeout: timedelta) -> None:
        super().__init__(
            "distamp.checkpoint",
            f"the checkpoint's {operation}",
            timeout,
            hint="If a rank died, see its log; if writing or reading the checkpoint is just slow, pass a larger "
            "timeout, e.g. timeout=datetime.timedelta(hours=1)",
        )
