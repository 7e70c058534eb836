"""ForwardParamGather: which modules get hooks, what they ask each optimizer to finish, the read guard, removal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.optim.optimizer import AmpOptimizer
from distamp.sharding.param_gather_hooks import ForwardParamGather


class RecordingOptimizer:
    """What ForwardParamGather uses of an AmpOptimizer: defer_param_gather, finish_param_gather, the masters."""

    defer_param_gather = AmpOptimizer.defer_param_gather  # the real rule, on this object's precision
    master_weights = AmpOptimizer.master_weights  # the precision plugin's masters, as the optimizer exposes them

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
    # Forward pre- and post-hooks and state_dict and load_state_dict pre-hooks on the five modules with parameters
    # inside (the model among them, not ReLU), and the model's last forward hook.
    assert len(hooks.handles) == 21
    model(torch.randn(2, 3))
    assert opt.calls == [["0.weight", "0.bias"], ["2.0.weight", "2.0.bias"], ["2.1.weight", "2.1.bias"], None]
    opt.calls.clear()
    # Each module with parameters finishes everything before its own state_dict (model.module.encoder's is read
    # alone too): the first call does the work, the four nested ones find nothing running.
    state = model.state_dict()
    assert opt.calls == [None] * 5
    opt.calls.clear()
    model[2][1].state_dict()
    assert opt.calls == [None]
    opt.calls.clear()
    model.load_state_dict(state)
    assert opt.calls == [None] * 5
    opt.calls.clear()
    hooks.remove()
    assert opt.precision.gather_hooked is False
    assert opt.calls == [None]  # removal finishes what is running
    opt.calls.clear()
    model(torch.randn(2, 3))
    model.load_state_dict(model.state_dict())
    assert opt.calls == []


class ReadsAround(nn.Module):
    """``attn`` reads ``out_proj`` without calling it; the model reads ``late`` through a view made at build time."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.late = nn.Linear(4, 4)
        self.alias = [self.late.weight.t()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.attn(h, h, h, need_weights=False)[0] @ self.alias[0]


def _running(model: nn.Module) -> tuple[ForwardParamGather, RecordingOptimizer]:
    """Hooks for an optimizer whose gather is running (its finish_param_gather only records)."""
    hooks = ForwardParamGather(model)
    opt = RecordingOptimizer(list(model.parameters()), overlap=True)
    opt.names = {id(p): name for name, p in model.named_parameters()}
    hooks.attach(opt)
    opt.precision.master_weights._refreshing = object()  # as step() leaves it with overlap_param_gather
    return hooks, opt


def test_while_a_gather_runs_a_forward_finishes_each_parameter_before_any_torch_function_reads_it():
    model = ReadsAround()
    _, opt = _running(model)
    model(torch.randn(2, 3, 4))
    assert opt.calls == [
        ["inp.weight", "inp.bias"],  # inp's pre-hook: its own
        ["attn.in_proj_weight", "attn.in_proj_bias"],  # attn's pre-hook: its own
        ["attn.out_proj.weight", "attn.out_proj.bias"],  # the guard: multi_head_attention_forward reads them
        ["late.weight"],  # the guard: a view of it, made before the gather started
        None,  # the model's forward hook: all
    ]
    assert torch.overrides._get_current_function_mode_stack() == []  # the guard is off after the forward


def test_the_guard_is_off_after_a_forward_that_raised_and_absent_when_nothing_runs():
    model = ReadsAround()
    hooks, opt = _running(model)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3, 5))  # wrong width
    assert hooks._depth == 0
    assert torch.overrides._get_current_function_mode_stack() == []
    opt.precision.master_weights._refreshing = None
    opt.calls.clear()
    model(torch.randn(2, 3, 4))
    assert opt.calls == [["inp.weight", "inp.bias"], ["attn.in_proj_weight", "attn.in_proj_bias"], None]


def test_a_pre_hook_registered_before_reads_under_the_guard():
    model = ReadsAround()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(module.late.bias.sum()))
    _, opt = _running(model)
    model(torch.randn(2, 3, 4))
    assert opt.calls[0] == ["late.bias"]
