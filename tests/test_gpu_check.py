"""``examples/gpu_check.sh``: valid bash, and on a machine without a GPU (or with ``--dry-run``) a plan
that lists every step, into at most eight files, and exits 0 having written nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu_check.sh"
STEPS = [
    "env", "cuda_tests",
    *(f"digits_{n}" for n in ("fp32", "fp16_o1", "fp16_o2", "bf16_o2", "bf16_o2_stage2", "bf16_stage3",
                              "fp16_o2_powersgd")),
    "bench_eager", "step_phases", "bench_compiled", "peak_breakdown",
    *(f"nccl_2rank_{n}" for n in ("lockstep_bf16_o2", "stage2", "stage3", "powersgd")),
]

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@needs_bash
def test_the_script_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@needs_bash
@pytest.mark.parametrize("args", [["--dry-run"], ["--dry-run", "OUT"]])
def test_the_dry_run_plans_every_step_into_at_most_eight_files_within_eight_minutes(args, tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, check=False,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    planned = re.findall(r"^  step (\w+): (\d+) s", proc.stdout, re.MULTILINE)
    assert [name for name, _ in planned] == STEPS, proc.stdout
    files = set(re.findall(r"-> (\w+\.txt)", proc.stdout))
    assert files == {"env.txt", "cuda_tests.txt", "digits.txt", "bench_eager.txt", "bench_compiled.txt",
                     "peak_breakdown.txt", "nccl_2rank.txt", "summary.txt"}
    assert len(files) <= 8
    budget = int(re.search(r"step budgets add up to (\d+) s", proc.stdout).group(1))
    assert budget <= 480
    for needle in ("pytest -m cuda tests/cuda -rA", "--d_model 1024 --layers 12 --heads 16 --vocab 32768",
                   "--seq_len 1024 --batch 8", "--compile", "--probe_steps 2", "distrun --gpus 0,1",
                   "examples/peak_breakdown.py", "examples/step_phases.py"):
        assert needle in proc.stdout
    assert list(tmp_path.iterdir()) == []  # a plan writes nothing
