"""Small messages between ranks through the process group's store, with a timeout of their own.

A collective holds every rank for as long as the process group's timeout
allows and then fails with a message that names neither the operation nor
the rank that never came. distamp's own coordination (the set-up handshake,
checkpoint decisions) sends its few small messages through the key-value
store the process group was built on (``TCPStore``) instead: each wait has
its own timeout, and a timeout names the ranks whose message is missing.

Keys are ``<namespace>/<call number>/<round>/...``. Every rank counts the
exchanges it opens in each namespace (they are collective, so the counts
agree), which keeps repeated exchanges apart. Keys are deleted once every
rank is known to have read them, so a long job does not fill the store.
"""

from __future__ import annotations

import contextlib
import io
import itertools
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distamp.torch_compat import default_store

__all__ = ["StoreExchange", "StoreTimeoutError", "rank_and_world"]

_calls: defaultdict[str, itertools.count] = defaultdict(lambda: itertools.count(1))
_FINISH_WAIT = timedelta(minutes=1)  # how long rank 0 waits for the others' note that they read its decision
_stale_keys: list[str] = []  # rank 0: broadcast keys every rank will have read by its next gather


class StoreTimeoutError(RuntimeError):
    """A rank waited for others through the store longer than its timeout allows."""


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _set(store: dist.Store, key: str, data: bytes) -> None:
    # torch's stub types the value as str; the binding takes bytes as well (and our values are bytes).
    store.set(key, data)  # type: ignore[arg-type]


def _decode(data: bytes) -> Any:
    # weights_only: the store is reachable over the network; never unpickle code from it.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class StoreExchange:
    """The message rounds of one collective operation, over the default group's store.

    Values are tensors and plain Python values (they travel through
    ``torch.save`` and come back through ``torch.load(weights_only=True)``).
    Without a process group, or with one rank, every method is local.

    Args:
        namespace: the first component of the keys, e.g. ``"distamp.checkpoint"``.
        operation: what the ranks are doing, for keys and messages, e.g. ``"save step 200"``.
        timeout: how long one wait may take.
        hint: appended to a timeout message: what the user can do about it.
    """

    def __init__(self, namespace: str, operation: str, timeout: timedelta, hint: str = "") -> None:
        self.rank, self.world_size = rank_and_world()
        self.operation = operation
        self.timeout = timeout
        self.hint = hint
        self._store: dist.Store | None = None
        if self.world_size > 1:
            self._store = default_store()
        self._prefix = f"{namespace}/{next(_calls[namespace])}/{operation.replace(' ', '-')}"
        self._rounds = itertools.count()

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0, ordered by rank; None on the other ranks."""
        if self._store is None:
            return [value]
        key = f"{self._prefix}/{next(self._rounds)}"
        if self.rank != 0:
            _set(self._store, f"{key}/{self.rank}", _encode(value))
            return None
        keys = {r: f"{key}/{r}" for r in range(1, self.world_size)}
        self._wait(self._store, keys)
        values = [value] + [_decode(self._store.get(k)) for k in keys.values()]
        # Every rank has reached this round, so all have read earlier broadcasts.
        self._delete(self._store, list(keys.values()) + _stale_keys)
        _stale_keys.clear()
        return values

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self._store is None:
            return value
        key = f"{self._prefix}/{next(self._rounds)}"
        if self.rank == 0:
            _set(self._store, key, _encode(value))
            _stale_keys.append(key)
            return value
        self._wait(self._store, {0: key})
        return _decode(self._store.get(key))

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` on every rank, ordered by rank."""
        values = self.gather(value)
        return self.broadcast(values)

    def finish(self) -> None:
        """The closing round: rank 0 returns only once every rank has read what it broadcast.

        Rank 0 hosts the store. A rank 0 that returned from the last
        broadcast and exited at once (a job resumed at its final step) would
        take the store away from a rank still reading the decision, which
        then fails with a broken connection instead of the decision. Every
        rank has arrived at that broadcast already, so the others' notes come
        at once; rank 0 waits for them at most :data:`_FINISH_WAIT` (a rank
        that gave up earlier, on its own timeout, will not come) and never
        fails here: its own work is done.
        """
        store = self._store
        if store is None:
            return
        key = f"{self._prefix}/{next(self._rounds)}"
        if self.rank != 0:
            _set(store, f"{key}/{self.rank}", b"1")
            return
        keys = [f"{key}/{r}" for r in range(1, self.world_size)]
        with contextlib.suppress(Exception):  # a missing rank has left: nobody is reading any more
            store.wait(keys, min(self.timeout, _FINISH_WAIT))
        self._delete(store, keys)

    def present_ranks(self) -> list[int]:
        """Ranks that reach this call within the timeout (every rank announces itself, then waits).

        Used after a collective failed, to name the ranks that never arrived.
        """
        store = self._store
        if store is None:
            return [self.rank]
        key = f"{self._prefix}/present"
        _set(store, f"{key}/{self.rank}", b"1")
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        # A timeout here is the expected answer when a rank is missing.
        with contextlib.suppress(Exception):
            store.wait(keys, self.timeout)
        return [r for r, k in enumerate(keys) if store.check([k])]

    def decide(self, value: Any, rule: Callable[[list[Any]], Any]) -> Any:
        """``rule(every rank's value)``, computed on rank 0, returned on every rank."""
        values = self.gather(value)
        return self.broadcast(rule(values) if values is not None else None)

    def _wait(self, store: dist.Store, keys: dict[int, str]) -> None:
        try:
            store.wait(list(keys.values()), self.timeout)
        except Exception as exc:  # the store's own exception types differ across torch versions
            missing = [r for r, k in keys.items() if not store.check([k])]
            whom = f"rank(s) {missing}" if missing else "the other ranks"
            raise StoreTimeoutError(
                f"rank {self.rank} waited {self.timeout} during {self.operation} and {whom} did not "
                f"arrive ({type(exc).__name__}: {exc}). {self.hint}".rstrip()
            ) from exc

    def _delete(self, store: dist.Store, keys: list[str]) -> None:
        for key in keys:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - some stores cannot delete; the keys are small
                return
