"""Running a job script on two GPUs under ``distrun`` for the ``cuda`` tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_two_gpu_job(tmp_path: Path, source: str) -> None:
    """Write ``source`` (dedented) to ``tmp_path/job.py`` and run it with ``distrun --gpus 0,1 job.py tmp_path``.

    The job gets its output folder as ``sys.argv[1]``; a non-zero exit fails the test with both ranks' output.
    """
    (tmp_path / "job.py").write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-m", "distamp.launcher", "--gpus", "0,1", "job.py", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=270, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
