"""``fleet.auto_cast()``: the autocast region the latest strategy asks for, decided when it is entered.

A training script often builds its precision context once, at start-up, and
enters it every step (nanoGPT: ``ctx = torch.autocast(...)`` before the model
and the optimizer exist, then ``with ctx:`` in the loop). With distamp the
strategy arrives later (``fleet.distributed_optimizer``), so the context must
not freeze what it found when it was built. :class:`DeferredAutocast` asks for
the region each time it is entered::

    ctx = DeferredAutocast(lambda: torch.autocast("cpu", dtype=torch.bfloat16) if amp_on() else None)
    for x, y in loader:
        with ctx:                    # the latest decision, every time
            loss = loss_fn(model(x), y)

Entries that found nothing to enter (no strategy, or ``amp`` off) are counted
in :data:`INACTIVE_ENTRIES`, so the optimizer's check for an FP32 forward can
say that ``fleet.auto_cast()`` was entered but did nothing, instead of saying
that there was no region.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from distamp.amp.black_modules import autocast_device_types
from distamp.amp.fp32_requests import FP32_REQUESTS

if TYPE_CHECKING:
    # typing.Self is Python 3.11+; mypy checks for 3.10 (setup.cfg).
    import typing_extensions

__all__ = ["INACTIVE_ENTRIES", "DeferredAutocast", "InactiveEntries"]


class InactiveEntries:
    """How many times a :class:`DeferredAutocast` was entered with nothing to enter, and the last reason."""

    def __init__(self) -> None:
        self.count = 0
        self.reason = ""

    def record(self, reason: str) -> None:
        """One entry found no region to enter, because of ``reason``."""
        self.count += 1
        self.reason = reason


INACTIVE_ENTRIES = InactiveEntries()
"""Every :class:`DeferredAutocast` entry that did nothing, in this process."""


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device_type) for device_type in autocast_device_types())


class DeferredAutocast(contextlib.ContextDecorator):
    """A context manager (or decorator) whose region is chosen each time it is entered.

    Re-entrant and reusable: every entry asks ``resolve`` anew and keeps
    what it entered on a stack, so nested and repeated ``with`` blocks unwind
    in order.

    Args:
        resolve: returns the context to enter (``torch.autocast`` or
            :class:`~distamp.amp.auto_cast.AutocastWithOpLists`), or ``None``
            for no region.
        inactive_reason: returns why ``resolve`` gave ``None`` (recorded in
            :data:`INACTIVE_ENTRIES`).
    """

    def __init__(
        self,
        resolve: Callable[[], contextlib.AbstractContextManager | None],
        inactive_reason: Callable[[], str],
    ) -> None:
        self._resolve = resolve
        self._inactive_reason = inactive_reason
        self._entered: list[contextlib.AbstractContextManager | None] = []

    def __enter__(self) -> typing_extensions.Self:
        region = self._resolve()
        if region is None:
            INACTIVE_ENTRIES.record(self._inactive_reason())
        else:
            was_on = _autocast_on()
            region.__enter__()
            if was_on and not _autocast_on():  # a nested auto_cast(enable=False)
                FP32_REQUESTS.record()
        self._entered.append(region)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        region = self._entered.pop()
        if region is not None:
            region.__exit__(exc_type, exc, traceback)

    def __repr__(self) -> str:
        return f"DeferredAutocast(entered={len(self._entered)})"
