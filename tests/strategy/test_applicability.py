"""Settings the chosen path would accept and ignore are refused, naming the key, before any collective."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.strategy import DistributedStrategy
from distamp.strategy.applicability import check_applicable
from tests.multiprocess import run_workers


def _strategy(stage: int = 0, amp: bool = True, **attributes) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=amp, sharding=stage > 0, **attributes)
    if stage:
        strategy.sharding_configs = {"stage": stage}
    return strategy


def _predivide(factor: float, stage: int = 0, amp: bool = True) -> DistributedStrategy:
    strategy = _strategy(stage, amp)
    strategy.amp_configs = {"gradient_predivide_factor": factor}
    return strategy


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_predivide_factor_is_refused_with_sharding(stage):
    with pytest.raises(ValueError, match=re.escape(
        f"amp_configs['gradient_predivide_factor']=4.0 applies only without sharding (the all-reduce of plain "
        f"data parallelism and of PowerSGD); sharding stage {stage} reduce-scatters gradients with the sum taken "
        "in FP32")):
        check_applicable(_predivide(4.0, stage), 2)


def test_gradient_predivide_factor_is_bounded_by_the_world_size_without_sharding():
    with pytest.raises(ValueError, match=re.escape(
        "amp_configs['gradient_predivide_factor']=4.0 must be between 1 and the world size 2")):
        check_applicable(_predivide(4.0), 2)
    check_applicable(_predivide(2.0), 2)  # takes effect: tests/distributed/test_comm_hooks.py
    check_applicable(_predivide(4.0), 4)
    powersgd = _predivide(4.0)
    powersgd.powersgd = True
    with pytest.raises(ValueError, match="between 1 and the world size 2"):
        check_applicable(powersgd, 2)
    check_applicable(_predivide(4.0, stage=1, amp=False), 2)  # amp off: no amp_configs key applies


def test_stage3_refuses_ddps_find_unused_parameters():
    with pytest.raises(ValueError, match=re.escape(
        "strategy.find_unused_parameters=True has no effect with sharding stage 3: it is DDP's option")):
        check_applicable(_strategy(3, find_unused_parameters=True), 2)
    for stage in (0, 1, 2):  # DDP, stage 1's DDP and stage 2's reducer take it
        check_applicable(_strategy(stage, find_unused_parameters=True), 2)


def test_stage3_refuses_a_bucket_size():
    with pytest.raises(ValueError, match=re.escape(
        "strategy.fuse_grad_size_in_MB=50 has no effect with sharding stage 3: FSDP2 all-gathers and "
        "reduce-scatters one unit at a time")):
        check_applicable(_strategy(3, fuse_grad_size_in_MB=50), 2)
    check_applicable(_strategy(3, fuse_grad_size_in_MB=25), 2)
    for stage in (0, 1, 2):
        check_applicable(_strategy(stage, fuse_grad_size_in_MB=50), 2)


def _refused_alone(rank, world_size, case, call):
    """Only rank 0 calls: a collective before the refusal would hang it (the group times out)."""
    from distamp import fleet

    fleet.init()
    if rank != 0:
        return None
    strategies = {
        "predivide_stage1": lambda: _predivide(4.0, stage=1),
        "predivide_stage3": lambda: _predivide(4.0, stage=3),
        "predivide_unsharded": lambda: _predivide(4.0),
        "unused_stage3": lambda: _strategy(3, find_unused_parameters=True),
        "bucket_stage3": lambda: _strategy(3, fuse_grad_size_in_MB=1),
    }
    strategy = strategies[case]()
    model = nn.Linear(4, 2)
    try:
        if call == "optimizer":
            fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        else:
            fleet.distributed_model(model, strategy)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("call", ["optimizer", "model"])
@pytest.mark.parametrize(("case", "key"), [
    ("predivide_stage1", "gradient_predivide_factor"), ("predivide_stage3", "gradient_predivide_factor"),
    ("predivide_unsharded", "gradient_predivide_factor"), ("unused_stage3", "find_unused_parameters"),
    ("bucket_stage3", "fuse_grad_size_in_MB"),
])
def test_fleet_refuses_on_one_rank_before_any_collective(case, key, call):
    message, other = run_workers(_refused_alone, 2, case, call, timeout=60, pg_timeout=20)
    assert other is None
    assert message is not None
    assert key in message
