"""LaunchPlan and build_plan's public surface: defaults, derived properties, CPU count, errors are ValueErrors.

tests/launcher/test_cli.py checks build_plan flag by flag through the parser;
this file checks the plan object and the module-level names themselves.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from distamp.launcher.plan import (
    DEFAULT_MASTER_PORT,
    WORKERS_PER_CPU,
    LaunchPlan,
    UsageError,
    available_cpus,
    build_plan,
)
from distamp.torch_compat import grace_period_supported
from tests.launcher.test_cli import parse, script  # noqa: F401 - script is a fixture


def test_defaults_are_a_single_node_loopback_job():
    plan = LaunchPlan(command=("train.py",), nproc_per_node=3)
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port, plan.gpus) == (1, 0, None, None, None)
    assert (plan.log_dir, plan.tee, plan.max_restarts, plan.grace_period) == ("log", frozenset({0}), 0, 30)
    assert plan.world_size == 3
    assert plan.local_rendezvous


def test_world_size_and_rendezvous_of_a_multi_node_plan():
    """Nodes may run different numbers of workers (as with torchrun): only the rendezvous knows the world size."""
    plan = LaunchPlan(command=("-m", "pkg.train"), nproc_per_node=4, nnodes=3, node_rank=2,
                      master_addr="10.0.0.1", master_port=DEFAULT_MASTER_PORT)
    assert plan.world_size is None
    assert not plan.local_rendezvous


def test_tee_ranks_of_a_multi_node_plan_are_checked_after_the_rendezvous(script):  # noqa: F811
    plan = parse(["--nnodes", "2", "--node_rank", "1", "--master", "127.0.0.1:29501", "--tee", "0,5", "train.py"])
    assert plan.tee == frozenset({0, 5})
    assert parse(["--nnodes", "2", "--master", "127.0.0.1:29501", "--tee", "all", "train.py"]).tee is None


def test_plans_are_frozen():
    plan = LaunchPlan(command=("train.py",), nproc_per_node=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.nproc_per_node = 2


def test_constants():
    assert DEFAULT_MASTER_PORT == 29500  # torchrun's
    assert WORKERS_PER_CPU == 4


def test_available_cpus_is_the_affinity_mask():
    assert available_cpus() == len(os.sched_getaffinity(0))


def test_usage_errors_are_value_errors():
    assert issubclass(UsageError, ValueError)


def test_build_plan_maps_gpus_through_cuda_visible_devices(script):  # noqa: F811
    plan = parse(["--gpus", "1,2", "train.py"], environ={"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b,GPU-c"}, gpus=3)
    assert plan.gpus == ("GPU-b", "GPU-c")
    assert plan.nproc_per_node == 2
    assert parse(["--gpus", "0", "train.py"], gpus=1).gpus == ("0",)


def test_build_plan_result_for_a_plain_command(script):  # noqa: F811
    grace = 5 if grace_period_supported() else 30
    plan = parse(["--nproc_per_node", "2", "--max_restarts", "1", "--grace_period", str(grace),
                  "train.py", "--lr", "1"])
    assert plan == LaunchPlan(command=("train.py", "--lr", "1"), nproc_per_node=2, max_restarts=1,
                              grace_period=grace, log_dir=plan.log_dir)
    assert callable(build_plan)


def test_a_grace_period_torch_cannot_honour_is_refused_naming_the_torch(script, monkeypatch):  # noqa: F811
    monkeypatch.setattr("distamp.launcher.plan.grace_period_supported", lambda: False)  # torch 2.11's agent
    assert parse(["--grace_period", "30", "train.py"]).grace_period == 30
    with pytest.raises(UsageError, match=r"--grace_period 5: torch .* always gives the workers 30 seconds.*2\.12"):
        parse(["--grace_period", "5", "train.py"])
