"""Ranks that disagree fail at set-up with the differing key; stuck collectives name the absent rank."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distamp.distributed.fingerprint import _disagreements, fingerprint
from distamp.strategy import DistributedStrategy
from tests.multiprocess import run_workers


def _strategy(**amp_configs) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = amp_configs
    return strategy


def test_fingerprint_names_settings_as_users_write_them():
    values = fingerprint(_strategy(dtype="bfloat16"), nn.Linear(3, 2))
    assert values["amp"] == "True"
    assert values["amp_configs['dtype']"] == "'bfloat16'"
    assert values["gradient_merge_configs['k_steps']"] == "1"
    assert values["model: parameter tensors"] == "2"
    assert values["model: parameter elements"] == "8"
    assert values["model: parameter dtypes"] == "2 float32"


def test_disagreements_list_each_rank_value():
    lines = _disagreements([{"a": "1", "b": "'x'"}, {"a": "1", "b": "'y'"}, {"a": "2"}])
    assert lines == ["a: rank 0 1, rank 1 1, rank 2 2", "b: rank 0 'x', rank 1 'y', rank 2 <missing>"]


# Each scenario: (what differs, the strategy and model of a rank) -> one expected line.
SCENARIOS = {
    "dtype": (lambda rank: (_strategy(dtype=("float16", "bfloat16")[rank]), 4),
              "amp_configs['dtype']: rank 0 'float16', rank 1 'bfloat16'"),
    "o2": (lambda rank: (_strategy(use_pure_fp16=rank == 0, dtype="bfloat16"), 4),
           "amp_configs['use_pure_fp16']: rank 0 True, rank 1 False"),
    "merge": (lambda rank: (DistributedStrategy(amp=True, gradient_merge=True,
                                                gradient_merge_configs={"k_steps": (2, 4)[rank]}), 4),
              "gradient_merge_configs['k_steps']: rank 0 2, rank 1 4"),
    "shape": (lambda rank: (_strategy(dtype="bfloat16"), (4, 5)[rank]),
              "model: parameter elements: rank 0 10, rank 1 12"),
}


def _mismatches(rank, world_size):
    from distamp.model.data_parallel import DataParallel
    from distamp.optim import AmpOptimizer

    messages = {}
    for name, (make, _) in SCENARIOS.items():
        strategy, width = make(rank)
        model = nn.Linear(width, 2)
        opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        wrapped = DataParallel(model, strategy)
        try:
            wrapped.attach_optimizer(opt)   # the second of the two calls prepares: the check runs here
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


@pytest.mark.timeout(120)
def test_every_mismatch_raises_the_same_error_on_every_rank_naming_the_key():
    out = run_workers(_mismatches, 2, timeout=100)
    for name, (_, line) in SCENARIOS.items():
        assert out[0][name] == out[1][name], name
        assert line in out[0][name], out[0][name]
        assert "disagree on their set-up" in out[0][name]


_HANDSHAKE_DONE, _COLLECTIVE_DONE = "test/handshake-given-up", "test/collective-given-up"


def _signal(key):
    """Rank 0 tells the absent rank it may go (instead of the absent rank sleeping a fixed time)."""
    dist.distributed_c10d._get_default_store().set(key, b"1")


def _wait_for(key):
    dist.distributed_c10d._get_default_store().wait([key], timedelta(seconds=60))


def _one_rank_never_prepares(rank, world_size):
    from distamp.distributed.fingerprint import check_ranks_agree

    if rank == 1:  # absent from the handshake until rank 0 has given up on it
        _wait_for(_HANDSHAKE_DONE)
        return None
    try:
        check_ranks_agree(_strategy(), nn.Linear(2, 2), timeout=timedelta(seconds=1))
    except RuntimeError as exc:
        return str(exc)
    finally:
        _signal(_HANDSHAKE_DONE)
    return None


def _stuck_collective(rank, world_size):
    from distamp import fleet
    from distamp.distributed import timeouts

    timeouts._ROLL_CALL = timedelta(seconds=1)
    strategy = _strategy(dtype="bfloat16")
    model = nn.Linear(4, 2)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model)
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(torch.randn(3, 4)), torch.zeros(3, 2))
    if rank == 1:  # never joins the all-reduce: waits until rank 0's timeout (3 s) and roll call (1 s) are over
        _wait_for(_COLLECTIVE_DONE)
        return None
    try:
        opt.backward(loss)
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        _signal(_COLLECTIVE_DONE)
    return None


@pytest.mark.timeout(120)
def test_a_rank_missing_the_handshake_or_a_collective_is_named():
    handshake = run_workers(_one_rank_never_prepares, 2, timeout=100)[0]
    assert "the set-up handshake" in handshake
    assert "rank(s) [1] did not arrive" in handshake
    stuck = run_workers(_stuck_collective, 2, timeout=100, pg_timeout=3)[0]
    assert stuck.startswith("CollectiveTimeoutError: rank 0: the gradient all-reduce of step 1 (in backward)")
    assert "rank(s) [1] did not arrive" in stuck


MISMATCHED_JOB = """
import os, torch, torch.nn.functional as F
from distamp import fleet
fleet.init()
strategy = fleet.DistributedStrategy()
strategy.amp = True
strategy.amp_configs = {"dtype": os.environ["DTYPE_RANK" + os.environ["RANK"]]}  # a per-host setting gone wrong
model = torch.nn.Linear(4, 2)
optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
model = fleet.distributed_model(model)
for _ in range(15):
    with fleet.auto_cast():
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
    optimizer.zero_grad()
    optimizer.minimize(loss)
print("trained")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_mismatched_job_under_distrun_stops_with_the_key_on_the_console(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(MISMATCHED_JOB)
    env = {**os.environ, "DTYPE_RANK0": "float16", "DTYPE_RANK1": "bfloat16"}
    done = subprocess.run(
        [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"),
         str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    console = done.stdout + done.stderr
    assert done.returncode != 0
    assert "trained" not in console
    assert "amp_configs['dtype']: rank 0 'float16', rank 1 'bfloat16'" in console
