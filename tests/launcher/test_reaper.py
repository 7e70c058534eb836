"""Reaper: orphans of what distrun starts become its children and are killed and listed; its own children are kept."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from distamp.launcher.reaper import Reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    assert ctypes.CDLL(None).prctl(37, ctypes.byref(value), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return bool(value.value)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_an_orphan_is_killed_and_named_and_earlier_children_are_kept():
    assert not _is_subreaper()
    kept = subprocess.Popen(["sleep", "30"])
    try:
        with Reaper() as reaper:
            assert _is_subreaper()
            # sh starts a background sleep and exits: the sleep is orphaned and re-parented to us.
            orphan = int(subprocess.run(["sh", "-c", "sleep 31 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                        text=True, check=True).stdout)
            with open(f"/proc/{orphan}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()
            left = reaper.kill_leftovers()
            assert left == [f"{orphan} (sleep 31)"]
            assert not _alive(orphan)
            assert not os.path.exists(f"/proc/{orphan}")  # reaped, not left a zombie
            assert _alive(kept.pid)
            assert reaper.kill_leftovers() == []
        assert not _is_subreaper()  # restored on exit
    finally:
        kept.kill()
        kept.wait()


def test_long_commands_are_shortened():
    with Reaper() as reaper:
        proc = subprocess.Popen(["sleep", "32", *(["0000000001"] * 10)], stderr=subprocess.DEVNULL)
        left = reaper.kill_leftovers()
        proc.wait()
    assert len(left) == 1
    pid, _, command = left[0].partition(" ")
    assert int(pid) == proc.pid
    assert command == "(" + ("sleep 32 " + " ".join(["0000000001"] * 10))[:77] + "...)"
