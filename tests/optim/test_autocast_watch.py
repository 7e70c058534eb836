"""O1 with no autocast region warns once, at the first step; with one (fleet's, torch's, compiled) it does not."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
from torch import nn

from distamp import fleet


def _steps(use_region, compile_model=False, pure=False, steps=2) -> list[warnings.WarningMessage]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": pure}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    forward = torch.compile(model) if compile_model else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            with use_region():
                loss = forward(torch.ones(2, 4)).float().sum()
            optimizer.zero_grad()
            optimizer.backward(loss)
            optimizer.step()
    return [w for w in caught if "no autocast region" in str(w.message)]


def test_o1_without_a_region_warns_once_at_the_users_line():
    caught = _steps(contextlib.nullcontext)
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        "O1 (use_pure_fp16=False): the forward of this step ran with no autocast region, so the model computed "
        "in FP32, not bfloat16."
    )
    assert os.path.basename(caught[0].filename) == "test_autocast_watch.py"


@pytest.mark.parametrize("region", ["fleet", "torch"])
def test_o1_with_a_region_does_not_warn(region):
    use = fleet.auto_cast if region == "fleet" else (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert _steps(use) == []


def test_a_compiled_o1_model_under_auto_cast_does_not_warn():
    assert _steps(fleet.auto_cast, compile_model=True) == []


def test_a_forward_inside_a_fleet_auto_cast_that_did_nothing_is_not_called_regionless():
    """An AmpOptimizer built directly gives fleet no strategy: auto_cast() enters nothing, and the warning says so."""
    from distamp.optim import AmpOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16"}
    optimizer = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fleet.auto_cast():
            loss = model(torch.ones(2, 4)).float().sum()
        optimizer.backward(loss)
        optimizer.step()
    messages = [str(w.message) for w in caught if str(w.message).startswith("O1")]
    assert messages == [
        "O1 (use_pure_fp16=False): the forward of this step computed in FP32, not bfloat16: it ran inside "
        "fleet.auto_cast(), which did nothing because, when it was entered, no strategy had been given yet "
        "(fleet.init(strategy=...) or fleet.distributed_optimizer(..., strategy)). fleet.auto_cast() follows the "
        "latest strategy: give this optimizer's strategy to fleet.init(strategy=...) or build the optimizer with "
        "fleet.distributed_optimizer."
    ]


def test_fleet_auto_cast_built_before_the_optimizer_does_not_warn():
    ctx = fleet.auto_cast()  # nanoGPT's start-up `ctx`, built before the strategy exists
    assert _steps(lambda: ctx) == []


def _steps_with(amp_configs: dict, use_region) -> list[warnings.WarningMessage]:
    """Two O1 BF16 steps of a Linear-ReLU-Linear model under fleet.distributed_model with ``amp_configs``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16", **amp_configs}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with use_region():
                loss = wrapped(torch.ones(2, 4)).float().sum()
            optimizer.zero_grad()
            optimizer.backward(loss)
            optimizer.step()
    return [w for w in caught if "no autocast region" in str(w.message)]


@pytest.mark.parametrize("amp_configs", [
    {"custom_black_varnames": ["0", "2"]},
    {"custom_black_varnames": ["*"]},
    {"custom_black_list": ["linear"]},
], ids=["every-layer-black", "root-black", "linear-black-listed"])
def test_a_forward_in_fp32_by_configuration_inside_auto_cast_does_not_warn(amp_configs):
    """Every matmul in FP32 because the lists ask for it, inside fleet.auto_cast(): there was a region."""
    assert _steps_with(amp_configs, fleet.auto_cast) == []


def test_a_forward_under_a_nested_auto_cast_disable_does_not_warn():
    def disabled_inside_enabled():
        stack = contextlib.ExitStack()
        stack.enter_context(fleet.auto_cast())
        stack.enter_context(fleet.auto_cast(enable=False))
        return stack

    assert _steps_with({}, disabled_inside_enabled) == []


def test_black_modules_without_any_region_still_warn():
    """The black modules' FP32 forward is no region: without fleet.auto_cast() O1 still computed in FP32."""
    assert len(_steps_with({"custom_black_varnames": ["2"]}, contextlib.nullcontext)) == 1
