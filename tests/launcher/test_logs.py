"""The console tee of :class:`RankLogs`, without workers."""

from __future__ import annotations

import io

from distamp.launcher.logs import _Tee


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
