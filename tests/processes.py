"""Finding the processes a test started, read from /proc (Linux): the tree below a
pid, or every process carrying a marker in its environment."""

from __future__ import annotations

import os
from pathlib import Path


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, whichever thread started them."""
    children, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def with_environ(name: str, value: str) -> list[int]:
    """Live processes (zombies excluded) whose environment has ``name=value``.

    A test that starts a job with a unique value finds everything the job
    started this way, whoever its parent is now (orphans are re-parented).
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def grace_period_args(seconds: int) -> list[str]:
    """``--grace_period SECONDS`` where this torch can honour it; nothing on torch 2.11, whose
    elastic agent always waits 30 s and where distrun refuses any other value."""
    from distamp.torch_compat import grace_period_supported

    return ["--grace_period", str(seconds)] if grace_period_supported() else []
