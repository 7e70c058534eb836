"""Ranks agree on a checkpoint through the process group's store, not its collectives.

While rank 0 writes or hashes a large checkpoint, the other ranks wait. A
collective would hold them for as long as the process group's timeout
allows (NCCL's default is 10 minutes) and then fail them, though nothing is
wrong. So the ranks exchange their small messages through the key-value
store (:class:`~distamp.distributed.store_exchange.StoreExchange`), whose
waits take a timeout of their own: :data:`DEFAULT_TIMEOUT` (30 minutes,
as for ``fleet.init``) unless the caller passes one. Keys are ``distamp.checkpoint/<call number>/...``: every
rank counts its calls to ``save_checkpoint`` / ``load_latest_checkpoint``
(both are collective, so the counts agree).
"""

from __future__ import annotations

from datetime import timedelta

from distamp.distributed.process_group import DEFAULT_TIMEOUT
from distamp.distributed.store_exchange import StoreExchange, rank_and_world

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "rank_and_world"]

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
