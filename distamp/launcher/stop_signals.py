"""SIGTERM, SIGINT, SIGHUP and SIGQUIT to ``distrun`` while a launch runs.

The elastic agent stops its workers on these, but installs its handler only
once it starts them; :func:`stop_signals_raise` covers the launch from its
start, including the waits for the other nodes (the rendezvous, the exit
barrier), where the main thread may be blocked in C++ for minutes and Python
would not run a handler until that call returns.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch.distributed.elastic.multiprocessing import SignalException

__all__ = ["STOP_SIGNALS", "ignore_stop_signals", "stop_signals_raise"]

#: What the elastic agent stops its workers on.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

#: Seconds a signal may wait for its Python handler before the main thread
#: counts as blocked in C. A free main thread runs it within milliseconds.
BLOCKED_AFTER = 1.0


@contextmanager
def stop_signals_raise(when_blocked: Callable[[signal.Signals], None]) -> Iterator[None]:
    """Turn stop signals into ``SignalException`` in the main thread for the block.

    Python runs a signal handler in the main thread between bytecodes. A
    main thread blocked in C does not run it: torch's static rendezvous
    waits in ``TCPStore``'s constructor for the other nodes, up to its
    15-minute timeout, so Ctrl-C or SIGTERM would do nothing until then.
    The interpreter's C-level handler still writes each signal to the wakeup
    fd; a watcher thread reads it, and when the Python handler has not run
    within :data:`BLOCKED_AFTER` seconds it calls ``when_blocked(signal)``
    from that thread, which decides what can be done (exit when no worker
    runs). Once the agent installs its own handler, which does not report to
    this one, signals still reach the watcher: ``when_blocked`` must then
    leave running workers to the agent.

    Signal handlers can only be set from the main thread; elsewhere the
    block runs with the handlers as they are.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = threading.Event()

    def handler(signum: int, frame: object) -> None:
        handled.set()
        sigval = signal.Signals(signum)
        raise SignalException(f"distrun got {sigval.name}", sigval=sigval)

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    watcher = threading.Thread(
        target=_watch, args=(read_fd, handled, when_blocked), name="distrun-signals", daemon=True
    )
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, old in previous.items():
            signal.signal(sig, old)
        os.close(write_fd)  # the watcher reads end-of-file and returns
        watcher.join()
        os.close(read_fd)


def _watch(read_fd: int, handled: threading.Event, when_blocked: Callable[[signal.Signals], None]) -> None:
    """Read signal numbers from the wakeup pipe until it closes; see :func:`stop_signals_raise`."""
    stop_numbers = {int(sig) for sig in STOP_SIGNALS}
    while data := os.read(read_fd, 64):
        for number in data:
            if number in stop_numbers and not handled.wait(BLOCKED_AFTER):
                when_blocked(signal.Signals(number))


def ignore_stop_signals() -> None:
    """Ignore further stop signals: a second Ctrl-C must not cut the clean-up short."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
