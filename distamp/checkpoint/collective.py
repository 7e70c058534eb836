"""Ranks agree on a checkpoint through the process group's store, not its collectives.

While rank 0 writes or hashes a large checkpoint, the other ranks wait. A
collective would hold them for as long as the process group's timeout
allows (NCCL's default is 10 minutes) and then fail them, though nothing is
wrong. So the ranks exchange their small messages through the key-value
store the process group was built on (``TCPStore``), whose waits take a
timeout of their own: :data:`DEFAULT_TIMEOUT` unless the caller passes one.

Keys are ``distamp.checkpoint/<call number>/<operation>/<round>/...``.
Every rank counts its calls to ``save_checkpoint`` / ``load_latest_checkpoint``
(both are collective, so the counts agree), which keeps the keys of
repeated saves of one job apart. Rank 0 deletes keys once every rank is
known to have read them, so a long job does not fill the store.
"""

from __future__ import annotations

import io
import itertools
import numbers
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "Coordinator", "check_timeout", "rank_and_world"]

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits for the others inside one checkpoint call, by default."""

_calls = itertools.count(1)
_stale_keys: list[str] = []  # rank 0: broadcast keys every rank will have read by the next gather


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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


def _encode(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(data: bytes) -> Any:
    # weights_only: the store is reachable over the network; never unpickle code from it.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class Coordinator:
    """The message rounds of one collective checkpoint call.

    Values are tensors and plain Python values (they travel through
    ``torch.save``). Without a process group, or with one rank, every
    method is a local no-op.

    Args:
        operation: a label for the keys and messages, e.g. ``"save step 200"``.
        timeout: how long one wait may take.
    """

    def __init__(self, operation: str, timeout: timedelta) -> None:
        self.rank, self.world_size = rank_and_world()
        self.operation = operation
        self.timeout = timeout
        self._store = None
        if self.world_size > 1:
            # Private, but the only way to the store init_process_group built (or was given).
            self._store = dist.distributed_c10d._get_default_store()
        self._prefix = f"distamp.checkpoint/{next(_calls)}/{operation.replace(' ', '-')}"
        self._rounds = itertools.count()

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0, ordered by rank; None on the other ranks."""
        if self._store is None:
            return [value]
        key = f"{self._prefix}/{next(self._rounds)}"
        if self.rank != 0:
            self._store.set(f"{key}/{self.rank}", _encode(value))
            return None
        keys = [f"{key}/{r}" for r in range(1, self.world_size)]
        self._wait(keys, "every rank")
        values = [value] + [_decode(self._store.get(k)) for k in keys]
        # Every rank has reached this round, so all have read earlier broadcasts.
        self._delete(keys + _stale_keys)
        _stale_keys.clear()
        return values

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self._store is None:
            return value
        key = f"{self._prefix}/{next(self._rounds)}"
        if self.rank == 0:
            self._store.set(key, _encode(value))
            _stale_keys.append(key)
            return value
        self._wait([key], "rank 0")
        return _decode(self._store.get(key))

    def decide(self, value: Any, rule: Callable[[list[Any]], Any]) -> Any:
        """``rule(every rank's value)``, computed on rank 0, returned on every rank."""
        values = self.gather(value)
        return self.broadcast(rule(values) if values is not None else None)

    def _wait(self, keys: list[str], whom: str) -> None:
        try:
            self._store.wait(keys, self.timeout)
        except Exception as exc:  # the store's own types differ across torch versions
            raise RuntimeError(
                f"rank {self.rank} waited {self.timeout} for {whom} during the checkpoint's "
                f"{self.operation} and gave up ({type(exc).__name__}: {exc}). If a rank died, see its "
                "log; if writing or reading the checkpoint is just slow, pass a larger timeout, "
                "e.g. timeout=datetime.timedelta(hours=1)"
            ) from exc

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._store.delete_key(key)
            except Exception:  # noqa: BLE001 - some stores cannot delete; the keys are small
                return
