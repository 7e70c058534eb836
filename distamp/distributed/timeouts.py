"""Collectives that end in an error naming the operation and the ranks that never came.

Every collective distamp issues is bounded by the process group's timeout
(``fleet.init(timeout=...)``). When one runs out, gloo says only "Timed out
waiting 1800000ms for recv operation". :func:`named_collective` turns that
into an error that names what distamp was doing (and at which step) and
which ranks did not arrive: the ranks still running announce themselves
through the store, and whoever is silent is named.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from distamp.distributed.store_exchange import StoreExchange

__all__ = ["CollectiveTimeoutError", "named_collective"]

_ROLL_CALL = timedelta(seconds=15)  # how long the survivors wait for each other before naming the absent


class CollectiveTimeoutError(RuntimeError):
    """A distamp collective ran past the process group's timeout."""


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


@contextlib.contextmanager
def named_collective(operation: str) -> Iterator[None]:
    """Re-raise a collective timeout inside the block as :class:`CollectiveTimeoutError`.

    Args:
        operation: what the ranks were doing, e.g. ``"the inf/NaN verdict all-reduce of step 12"``.
    """
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeoutError) or not _is_timeout(exc):
            raise
        exchange = StoreExchange("distamp.timeout", operation, _ROLL_CALL)
        try:
            present = exchange.present_ranks()
        except Exception:  # noqa: BLE001 - the store may be gone too; the timeout is the news
            present = []
        absent = [r for r in range(exchange.world_size) if r not in present] if present else []
        who = f"rank(s) {absent} did not arrive" if absent else "the ranks that did not arrive could not be named"
        raise CollectiveTimeoutError(
            f"rank {exchange.rank}: {operation} did not complete within the process group's timeout; {who}. "
            f"Check those ranks' logs (a crash, a hang in data loading, or a rank running other code); "
            f"raise the limit with fleet.init(timeout=...) if they are only slow. ({exc})"
        ) from exc
