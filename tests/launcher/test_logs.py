"""The console tee and the per-attempt files of :class:`RankLogs`, without workers."""

from __future__ import annotations

import io
import os

from distamp.launcher import _bootstrap
from distamp.launcher.logs import RankLogs, _Tee, say


def test_tee_prefixes_each_line_once(tmp_path):
    log = tmp_path / "workerlog.0"
    # What a worker writes after init_process_group: torch's excepthook and
    # C++ warnings already carry the rank.
    log.write_text(
        "plain line\n"
        "[rank0]: Traceback (most recent call last):\n"
        "[rank0]:   File \"job.py\", line 3, in <module>\n"
        "[rank0]:[W1123 09:00:00.000 init.cpp:1] Warning: something\n"
        "[rank1]: a line about another rank\n"
        "[rank0]:\n"
        "last line without newline"
    )
    out = io.StringIO()
    _Tee({str(log): ("[rank0]: ", 0)}, out, interval=60).stop()
    assert out.getvalue().splitlines() == [
        "[rank0]: plain line",
        "[rank0]: Traceback (most recent call last):",
        "[rank0]:   File \"job.py\", line 3, in <module>",
        "[rank0]: [W1123 09:00:00.000 init.cpp:1] Warning: something",
        "[rank0]: [rank1]: a line about another rank",
        "[rank0]: ",
        "[rank0]: last line without newline",
    ]


def test_each_attempt_gets_exit_stamp_files_and_a_start_time(tmp_path):
    calls = []
    logs = RankLogs(str(tmp_path), frozenset(), before_start=lambda: calls.append(len(calls)))
    try:
        envs = {0: {"RANK": "4", "WORLD_SIZE": "6"}, 1: {"RANK": "5", "WORLD_SIZE": "6"}}
        logs.reify(envs)
        assert calls == [0]
        assert logs.attempts == 1
        assert (logs.ranks, logs.world_size) == ((4, 5), 6)
        assert logs.started_at > 0
        stamp = envs[1][_bootstrap.EXIT_FILE_VAR]
        with open(stamp, "w") as f:
            f.write("123.5")
        assert logs.exit_times(timeout=0) == {5: 123.5}
        assert logs.exit_times(wait_for={4, 5}, timeout=0.1) == {5: 123.5}
        logs.reify({0: {"RANK": "4", "WORLD_SIZE": "6"}, 1: {"RANK": "5", "WORLD_SIZE": "6"}})  # fresh stamps
        assert calls == [0, 1]
        assert logs.attempts == 2
        assert logs.exit_times(timeout=0) == {}
    finally:
        logs.close()


def test_tee_stops_quietly_when_the_console_reader_is_gone(tmp_path):
    log = tmp_path / "workerlog.0"
    log.write_text("first\nsecond\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left, as `distrun ... | head` does
    console = os.fdopen(write_end, "w")
    try:
        tee = _Tee({str(log): ("[rank0]: ", 0)}, console, interval=60)
        tee.stop()  # raised BrokenPipeError
        say(console, "distrun: a report line")  # so did distrun's report
        console.write("text a later flush must not fail on\n")
        console.flush()  # goes to /dev/null now
    finally:
        console.close()
