"""strategy.sharding in one process: the same numbers as without it, and clear errors.

With one rank the slice is the whole flat space, so every mode must match
the unsharded optimizer bitwise (the same elementwise kernels on the same
values); clipping sums the squared norm of one flat buffer instead of
per-tensor norms, so it matches within FP32 rounding. Several ranks are
tested with real processes in tests/sharding/test_sharding.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp.auto_cast import auto_cast
from distamp.optim.optimizer import AmpOptimizer
from distamp.sharding.sharded_precision import ShardedPrecision
from distamp.strategy import DistributedStrategy


def _strategy(sharding: bool, amp: bool = True, k_steps: int = 1, **configs) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=amp, sharding=sharding)
    strategy.amp_configs = configs
    if k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": k_steps}
    return strategy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def _train(strategy: DistributedStrategy, steps: int = 6, clip: bool = False):
    model = _model()
    inner = torch.optim.AdamW([{"params": list(model.parameters())[:2]},
                               {"params": list(model.parameters())[2:], "lr": 3e-3}], lr=1e-2)
    opt = AmpOptimizer(inner, strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    dtype = strategy.amp_config.dtype
    g = torch.Generator().manual_seed(1)
    for _ in range(steps * opt.merge.k_steps):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        with auto_cast(enable=strategy.amp, dtype=dtype):
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        if clip and not opt.is_accumulating:
            opt.clip_grad_norm_(0.05)
        if opt.step():
            scheduler.step()
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]), opt


MODES = [
    pytest.param({"amp": False}, id="amp-off"),
    pytest.param({"dtype": "float16"}, id="O1-fp16"),
    pytest.param({"use_pure_fp16": True, "dtype": "float16", "init_loss_scaling": 2.0**20}, id="O2-fp16"),
    pytest.param({"use_pure_fp16": True, "dtype": "bfloat16"}, id="O2-bf16"),
    pytest.param({"use_pure_fp16": True, "dtype": "bfloat16", "k_steps": 3}, id="O2-bf16-merge"),
]


@pytest.mark.parametrize("mode", MODES)
def test_one_rank_matches_the_unsharded_optimizer_bitwise(mode):
    reference, unsharded = _train(_strategy(False, **mode))
    sharded_params, sharded = _train(_strategy(True, **mode))
    assert isinstance(sharded.precision, ShardedPrecision)
    assert torch.equal(sharded_params, reference)
    assert sharded.steps_skipped == unsharded.steps_skipped
    assert sharded.get_loss_scaling() == unsharded.get_loss_scaling()
    assert [g["lr"] for g in sharded.param_groups] == [g["lr"] for g in unsharded.param_groups]


@pytest.mark.parametrize("mode", [MODES[1], MODES[3]])
def test_clipping_matches_within_fp32_rounding(mode):
    reference, _ = _train(_strategy(False, **mode), clip=True)
    sharded, _ = _train(_strategy(True, **mode), clip=True)
    torch.testing.assert_close(sharded, reference, rtol=0, atol=1e-6)


def test_unscale_exposes_the_unscaled_gradient_and_takes_back_changes():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                       _strategy(True, use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0))
    with auto_cast(dtype="float16"):
        loss = model(torch.ones(2, 6)).float().sum()
    opt.backward(loss)
    opt.unscale_()
    weight = model[3].weight
    torch.testing.assert_close(weight.grad.float(), torch.relu(model[1](model[0](torch.ones(1, 6).half()).float()))
                               .half().float().expand(3, 8) * 2, rtol=1e-2, atol=1e-2)
    before = weight.detach().float().clone()
    weight.grad.zero_()  # the user's change is what the step applies
    assert opt.step()
    torch.testing.assert_close(weight.detach().float(), before, rtol=0, atol=0)


def test_sharding_errors_are_clear_and_raised_before_any_communication():
    double = nn.Linear(2, 2).double()
    with pytest.raises(TypeError, match=r"parameter 0 \(shape \(2, 2\)\) is torch.float64; sharded optimizer state "
                                        r"needs torch.float32 parameters"):
        AmpOptimizer(torch.optim.SGD(double.parameters(), lr=0.1), _strategy(True))
    opt = AmpOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), _strategy(True, use_pure_fp16=True))
    with pytest.raises(RuntimeError, match=r"add_param_group\(\) is not supported with strategy.sharding"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    with pytest.raises(RuntimeError, match=r"fp32_state_dict\(model\) \(collective\)"):
        opt.master_weights.master_for(next(iter(opt.master_weights.model_params)))
    unsharded = AmpOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), _strategy(False, use_pure_fp16=True))
    with pytest.raises(ValueError, match=r"another layout \(unsharded\) than this one \(world_size 1, rank 0\).*"
                                         r"load_latest_checkpoint, which re-slice"):
        opt.load_state_dict(unsharded.state_dict())


def _steps(model, opt, data):
    for x, y in data:
        with auto_cast(dtype="bfloat16"):
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()


def test_state_dict_resumes_bitwise_and_fp32_export_on_one_rank():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4)]
    strategy = _strategy(True, use_pure_fp16=True, dtype="bfloat16")
    model = _model()
    opt = AmpOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    _steps(model, opt, data[:2])
    state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())  # live tensors
    assert state["sharding"]["world_size"] == 1
    assert state["sharding"]["bounds"] == [0, 99]
    assert [t.numel() for t in state["master_weights"]] == [99]  # one flat FP32 slice
    _steps(model, opt, data[2:])

    resumed = _model()
    again = AmpOptimizer(torch.optim.AdamW(resumed.parameters(), lr=1e-2), strategy)
    again.adopt_model(resumed, [p for p in resumed[1].parameters()])  # LayerNorm in FP32, as at a first forward
    resumed.load_state_dict(weights)
    again.load_state_dict(state)
    _steps(resumed, again, data[2:])
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    exported = again.fp32_state_dict(resumed)
    assert all(v.dtype == torch.float32 for v in exported.values())
    assert torch.equal(exported["3.bias"], again.param_groups[0]["params"][-1].detach())  # one piece per parameter

    two_groups = AmpOptimizer(torch.optim.AdamW([{"params": list(_model().parameters())[:2]},
                                                 {"params": list(_model().parameters())[2:]}]), strategy)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        two_groups.load_state_dict(state)


def test_stuck_scale_still_raises_under_sharding():
    param = nn.Parameter(torch.ones(4))
    strategy = _strategy(True, use_pure_fp16=True, dtype="float16", init_loss_scaling=1.0,
                         min_loss_scaling=1.0, stuck_scale_patience=2)
    opt = AmpOptimizer(torch.optim.SGD([param], lr=0.1), strategy)
    opt.backward(param.float().sum() * float("inf"))
    assert opt.step() is False
    opt.zero_grad()
    opt.backward(param.float().sum() * float("inf"))
    with pytest.raises(RuntimeError, match=r"the loss scale is stuck at 1: 2 consecutive steps overflowed.*bfloat16"):
        opt.step()


def test_non_contiguous_parameter_is_refused():
    weight = nn.Parameter(torch.ones(3, 4).t())
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(4, 3\)\) is not contiguous"):
        AmpOptimizer(torch.optim.SGD([weight], lr=0.1), _strategy(True))
