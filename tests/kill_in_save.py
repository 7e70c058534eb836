"""examples/train_digits.py with rank 1 SIGKILLed inside a stage-3 save, for tests/test_kill_restart.py.

Run by ``distrun`` in place of the example, with the example's arguments.
Rank 1 kills itself with SIGKILL in the save of step ``KILL_IN_SAVE_STEP``,
either on entering the DCP write (``KILL_IN_SAVE_POINT=before``: rank 0 is
then inside ``dcp.save``) or once its DCP files are written and before the
manifest commits them (``after``), in the first attempt only (the file
``KILL_IN_SAVE_MARKER`` records the kill). Every rank prints the step it
resumed from. Without ``KILL_IN_SAVE_STEP`` nothing is killed.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from distamp import checkpoint
from distamp.checkpoint import dcp_tensors

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


def _kill_in_save(step: int, point: str, marker: Path) -> None:
    write = dcp_tensors.write

    def killing_write(tensors, directory):
        due = os.environ.get("RANK") == "1" and os.path.basename(directory).startswith(f"step-{step:08d}.") \
            and not marker.exists()
        if due and point == "before":
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        write(tensors, directory)
        if due and point == "after":
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    dcp_tensors.write = killing_write


def _report_resume() -> None:
    load = checkpoint.load_latest_checkpoint

    def reporting_load(*args, **kwargs):
        info = load(*args, **kwargs)
        print(f"rank {os.environ.get('RANK')} resumed from step {info.step if info is not None else 0}", flush=True)
        return info

    checkpoint.load_latest_checkpoint = reporting_load  # the example imports it by name when it runs


if __name__ == "__main__":
    if "KILL_IN_SAVE_STEP" in os.environ:
        _kill_in_save(int(os.environ["KILL_IN_SAVE_STEP"]), os.environ["KILL_IN_SAVE_POINT"],
                      Path(os.environ["KILL_IN_SAVE_MARKER"]))
    _report_resume()
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
