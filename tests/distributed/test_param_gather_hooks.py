"""ForwardParamGather: which modules get pre-hooks, what they ask each optimizer to finish, and removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.distributed.param_gather_hooks import ForwardParamGather
from distamp.optim.optimizer import AmpOptimizer


class RecordingOptimizer:
    """What ForwardParamGather uses of an AmpOptimizer: ``defer_param_gather`` and ``finish_param_gather``."""

    defer_param_gather = AmpOptimizer.defer_param_gather  # the real rule, on this object's precision

    def __init__(self, params: list[nn.Parameter], overlap: bool, sharding: bool = True) -> None:
        from distamp import fleet
        from distamp.optim.precision_choice import precision_for

        strategy = fleet.DistributedStrategy(sharding=sharding)
        strategy.sharding_configs = {"overlap_param_gather": overlap}
        self.precision = precision_for(strategy, params, None)
        self.calls: list[list[str] | None] = []
        self.names: dict[int, str] = {}

    def finish_param_gather(self, params=None) -> None:
        self.calls.append(None if params is None else [self.names[id(p)] for p in params])


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))


@pytest.mark.parametrize(("overlap", "sharding"), [(False, True), (True, False)])
def test_an_optimizer_without_overlap_gets_no_hooks(overlap, sharding):
    model = _model()
    hooks = ForwardParamGather(model)
    hooks.attach(RecordingOptimizer(list(model.parameters()), overlap, sharding))
    assert hooks.handles == []
    assert hooks.optimizers == []


def test_each_module_with_parameters_finishes_its_own_before_running_and_the_model_all_after():
    model = _model()
    hooks = ForwardParamGather(model)
    opt = RecordingOptimizer(list(model.parameters()), overlap=True)
    assert opt.precision.gather_hooked is False
    opt.names = {id(p): name for name, p in model.named_parameters()}
    hooks.attach(opt)
    hooks.attach(opt)  # attaching twice changes nothing
    assert opt.precision.gather_hooked is True
    assert len(hooks.handles) == 5  # three Linear pre-hooks (not ReLU, not the containers), forward and state_dict
    model(torch.randn(2, 3))
    assert opt.calls == [["0.weight", "0.bias"], ["2.0.weight", "2.0.bias"], ["2.1.weight", "2.1.bias"], None]
    opt.calls.clear()
    model.state_dict()
    assert opt.calls == [None]
    opt.calls.clear()
    hooks.remove()
    assert opt.precision.gather_hooked is False
    assert opt.calls == [None]  # removal finishes what is running
    opt.calls.clear()
    model(torch.randn(2, 3))
    model.state_dict()
    assert opt.calls == []
