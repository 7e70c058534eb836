"""``examples/step_phases.py``: each mode's step split into forward, backward and update, the phases adding up to
the step, and a distamp mode's ratios to its torch-native counterpart."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import step_phases  # examples/ is not a package: imported from the path set above


@pytest.mark.timeout(240)
def test_a_run_times_every_phase_of_each_mode_and_the_phases_add_up_to_the_step(tmp_path):
    cmd = [sys.executable, step_phases.__file__, "--model", "tiny_gpt", "--threads", "1", "--steps", "3",
           "--warmup", "1", "--modes", "torch_fp16,distamp_o2_fp16", "--json", str(tmp_path / "p.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    medians = json.loads((tmp_path / "p.json").read_text())
    assert list(medians) == ["torch_fp16", "distamp_o2_fp16"]
    for row in medians.values():
        assert list(row) == ["forward", "backward", "update", "total"]
        assert all(ms > 0 for ms in row.values())
    rows = [line for line in done.stdout.splitlines() if line.startswith("| distamp_o2_fp16 |")]
    assert len(rows) == 1
    assert rows[0].count("|") == 9  # mode, three phases, total, three ratios


def test_the_phases_of_one_step_are_the_gaps_between_its_marks():
    class Clock(step_phases._Clock):
        def __init__(self) -> None:
            super().__init__(torch.device("cpu"))
            self.now = 0.0

        def mark(self) -> float:
            return self.now

    clock = Clock()

    def advance(ms: float):
        def phase(*_: object) -> None:
            clock.now += ms / 1e3
        return phase

    times = step_phases.time_phases((advance(2), advance(5), advance(1)), None, None, clock, steps=2, warmup=1)
    assert {k: [round(v, 6) for v in vs] for k, vs in times.items()} == {
        "forward": [2, 2], "backward": [5, 5], "update": [1, 1], "total": [8, 8]}


def test_the_report_gives_distamp_modes_their_ratio_to_the_torch_native_mode_per_phase():
    args = argparse.Namespace(model="mlp", batch=4, family=step_phases.benchmark.bench_modes.family("mlp"))
    medians = {"torch_bf16": {"forward": 2.0, "backward": 4.0, "update": 1.0, "total": 7.0},
               "distamp_o2_bf16": {"forward": 1.0, "backward": 4.0, "update": 3.0, "total": 8.0}}
    table = step_phases.report(medians, args, "CPU")
    assert "| torch_bf16 | 2.00 | 4.00 | 1.00 | 7.00 | - | - | - |" in table
    assert "| distamp_o2_bf16 | 1.00 | 4.00 | 3.00 | 8.00 | 0.50 | 1.00 | 3.00 |" in table


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--warmup", "-1"]])
def test_a_run_without_timed_steps_is_refused_naming_the_flags(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_phases.main([*flags, "--model", "mlp"])
    assert exit_info.value.code == 2
    assert "--steps must be >= 1 and --warmup >= 0" in capsys.readouterr().err
