"""``examples/peak_breakdown.py``: the replay finds the peak and what is alive then, and on a real O2 run the
groups add up to the peak and name distamp's FP32 masters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import peak_breakdown  # examples/ is not a package: imported from the path set above


def test_the_replay_returns_the_peak_the_tensors_alive_then_and_the_allocation_that_reached_it():
    events = [(0, 100, 1, "a"), (1, 50, 2, "b"), (2, -100, 1, "a"), (3, 30, 3, "c"), (4, 60, 4, "d"),
              (5, -8, 99, "allocated before the profile")]
    peak, alive, reached = peak_breakdown.live_at_peak(events)
    assert peak == 150
    assert sorted(alive) == [(50, "b"), (100, "a")]
    assert reached == "b"


@pytest.mark.timeout(240)
def test_an_o2_run_breaks_its_peak_down_into_groups_that_add_up_and_include_the_fp32_masters(tmp_path):
    cmd = [sys.executable, os.path.join(peak_breakdown.__file__), "--mode", "distamp_o2_bf16", "--steps", "2",
           "--model", "mlp", "--batch", "4", "--threads", "1", "--json", str(tmp_path / "b.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    assert "bytes/param" in done.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    assert sum(g["bytes"] for g in result["groups"]) == result["peak_bytes"] > 0
    masters = [g for g in result["groups"] if "master_weights.py" in g["frame"] and g["op"] == "aten::empty"]
    assert masters, result["groups"]
    # One flat FP32 buffer of every master: 4 bytes a parameter (the family's norms are masters too).
    assert masters[0]["bytes"] == 4 * result["params"]


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_fewer_than_one_step_is_refused_naming_the_flag_before_any_model_is_built(steps, capsys, monkeypatch):
    def never(*args: object) -> None:
        raise AssertionError("a run started for a refused --steps")

    monkeypatch.setattr(peak_breakdown, "breakdown", never)
    with pytest.raises(SystemExit) as exit_info:
        peak_breakdown.main(["--mode", "distamp_o2_bf16", "--steps", steps, "--model", "mlp"])
    assert exit_info.value.code == 2
    assert f"--steps must be >= 1, got {steps}" in capsys.readouterr().err
