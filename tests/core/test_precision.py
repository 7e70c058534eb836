"""optim.precision: the AMP-off, O1 and O2 plugins' unscale/check against torch's GradScaler, state and errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.core.precision import (
    FullPrecision,
    MixedPrecision,
    PureLowPrecision,
    _max_abs,
)
from distamp.optim.precision_choice import precision_for
from distamp.sharding.sharded_precision import ShardedPrecision
from distamp.strategy import AmpConfig, DistributedStrategy


def _params(n=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(4 + i, generator=g, dtype=dtype)) for i in range(n)]


def _grads(params, seed=2):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1000).to(p.dtype)


def _reference_unscale(grads, scale):
    """What torch.amp.GradScaler.unscale_ leaves in the gradients, and its found_inf."""
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    opt = torch.optim.SGD(params, lr=0.0)
    scaler.unscale_(opt)
    found = sum(v.item() for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    return [p.grad for p in params], found > 0


def test_full_precision_is_a_pass_through():
    params = _params()
    plugin = FullPrecision(params, AmpConfig())
    loss = torch.tensor(2.5)
    assert plugin.scale_loss(loss) is loss
    assert plugin.loss_scale == 1.0
    assert plugin.unscale_and_check(None) == (False, None)
    assert plugin.master_weights.masters == params
    assert plugin.lower_scale_now() is False
    assert plugin.state_dict() == {"loss_scaler_type": "", "loss_scaler": {}}
    plugin.load_state_dict(plugin.state_dict())
    with pytest.warns(UserWarning, match=re.escape(
        "saved with loss scaler 'BackoffLossScaler' and this optimizer uses 'none (amp off)' (amp or "
        "amp_configs['dtype'] changed): the weights and the inner optimizer's state load as saved; the loss "
        "scale is not used."
    )):
        plugin.load_state_dict({"loss_scaler_type": "BackoffLossScaler", "loss_scaler": {"scale": 8.0}})


@pytest.mark.parametrize("scale", [1024.0, 3.0])  # 1/3 is not exact in FP32: rounded once, as GradScaler does
def test_o1_unscale_is_bitwise_grad_scaler(scale):
    params = _params(3)
    _grads(params)
    expected, _ = _reference_unscale([p.grad for p in params], scale)
    plugin = MixedPrecision(params, AmpConfig.from_dict({"init_loss_scaling": scale}))
    assert plugin.scale_loss(torch.tensor(2.0, dtype=torch.float16)).dtype == torch.float32
    assert plugin.scale_loss(torch.tensor(2.0)).item() == 2.0 * scale
    assert plugin.unscale_and_check(None) == (False, None)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p.grad, e)


def test_o1_finds_inf_in_any_dtype_and_skips_params_without_grad():
    params = _params(2) + _params(1, torch.bfloat16) + _params(1)  # FP16 ones O1 refuses, as GradScaler does
    _grads(params[:3])
    params[2].grad[1] = float("inf")
    plugin = MixedPrecision(params, AmpConfig.from_dict({"init_loss_scaling": 8.0}))
    found, grad_max = plugin.unscale_and_check(None)
    assert found is True
    assert grad_max is None
    assert params[3].grad is None


def test_o1_grad_max_for_the_lognormal_scaler():
    params = _params(2)
    _grads(params)
    plugin = MixedPrecision(params, AmpConfig.from_dict({"loss_scaling_algorithm": "lognormal"}))
    scale = plugin.loss_scale
    expected, _ = _reference_unscale([p.grad for p in params], scale)
    found, grad_max = plugin.unscale_and_check(None)
    assert found is False
    assert grad_max == torch.cat(expected).abs().max().item()


def test_o1_no_gradients_and_sparse_gradients():
    params = _params(2)
    plugin = MixedPrecision(params, AmpConfig())
    assert plugin.unscale_and_check(None) == (False, None)
    params[0].grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match="sparse gradients are not supported by the AMP optimizer; use dense gradients"):
        plugin.unscale_and_check(None)


def test_max_abs_across_dtypes():
    grads = [torch.tensor([1.0, -7.5]), torch.tensor([-9.0], dtype=torch.bfloat16), torch.tensor([3.0])]
    assert _max_abs(grads).item() == 9.0


@pytest.mark.parametrize(
    ("dtype", "why", "hint"),
    [
        ("float16", "the scale could not go lower (min_loss_scaling=1)",
         "Use strategy.amp_configs = {..., 'dtype': 'bfloat16'}"),
        ("bfloat16", "the scale is fixed at 1.0 in BF16", "The model produces inf/NaN even in BF16"),
    ],
)
def test_stuck_scale_raises_after_patience(dtype, why, hint):
    scaling = {"init_loss_scaling": 1.0, "min_loss_scaling": 1.0} if dtype == "float16" else {}  # BF16: fixed at 1
    config = AmpConfig.from_dict({"dtype": dtype, "stuck_scale_patience": 2, **scaling})
    plugin = MixedPrecision(_params(), config)
    plugin.update(True, None)
    assert plugin.consecutive_stuck == 1
    plugin.update(False, None)
    assert plugin.consecutive_stuck == 0
    plugin.update(True, None)
    with pytest.raises(RuntimeError, match=re.escape(
        f"the loss scale is stuck at 1: 2 consecutive steps overflowed while {why}, so training is not making "
        f"progress. {hint}"
    )):
        plugin.update(True, None)


def test_a_stuck_static_scale_says_it_is_static_and_what_to_change():
    config = AmpConfig.from_dict({"dtype": "float16", "use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0,
                                  "stuck_scale_patience": 2})
    plugin = MixedPrecision(_params(), config)
    plugin.update(True, None)
    with pytest.raises(RuntimeError, match=re.escape(
        "the loss scale is stuck at 8: 2 consecutive steps overflowed while the scale is static "
        "(use_dynamic_loss_scaling=False), so training is not making progress. Use strategy.amp_configs = {..., "
        "'dtype': 'bfloat16'} (BF16 has FP32's range), or a lower init_loss_scaling, or use_dynamic_loss_scaling=True"
    )):
        plugin.update(True, None)


def test_lower_scale_now_and_state_round_trip():
    config = AmpConfig.from_dict({"init_loss_scaling": 4.0, "min_loss_scaling": 1.0})
    plugin = MixedPrecision(_params(), config)
    assert plugin.lower_scale_now() is True
    assert plugin.loss_scale == 2.0
    state = plugin.state_dict()
    assert state["loss_scaler_type"] == "BackoffLossScaler"
    other = MixedPrecision(_params(), config)
    other.load_state_dict(state)
    assert other.loss_scale == 2.0
    with pytest.warns(UserWarning, match=re.escape("the loss scale starts at 4 as configured")):
        MixedPrecision(_params(), config).load_state_dict({"loss_scaler_type": "", "loss_scaler": {}})
    with pytest.raises(ValueError, match=re.escape(
        "checkpoint was saved with loss scaler 'LogNormalLossScaler' but this optimizer uses 'BackoffLossScaler'"
    )):
        other.load_state_dict({"loss_scaler_type": "LogNormalLossScaler", "loss_scaler": {}})


def test_o2_unscales_fp32_copies_of_the_16_bit_grads_when_asked_to_show_them():
    params = _params(2)
    originals = [p.detach().clone() for p in params]
    plugin = PureLowPrecision(params, AmpConfig.from_dict({"use_pure_fp16": True, "init_loss_scaling": 3.0}))
    assert all(p.dtype == torch.float16 for p in params)
    assert all(torch.equal(m, o) for m, o in zip(plugin.master_weights.masters, originals, strict=True))
    _grads(params)
    model_grads = [p.grad.clone() for p in params]
    expected, _ = _reference_unscale([g.float() for g in model_grads], 3.0)
    assert plugin.unscale_and_check(None) == (False, None)
    assert all(m.grad is None for m in plugin.master_weights.masters)  # the check keeps no FP32 gradient
    for p, g in zip(params, model_grads, strict=True):
        assert torch.equal(p.grad, g)  # the 16-bit gradients are not touched by the check

    plugin.expose_unscaled_grads()  # unscale_(): whole FP32 master gradients, then shown in 16 bits
    for m, e in zip(plugin.master_weights.masters, expected, strict=True):
        assert torch.equal(m.grad, e)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p.grad, e.half())
    params[0].grad.mul_(0.5)  # the user clips one of them
    plugin.take_user_grad_changes()
    masters = plugin.master_weights.masters
    assert torch.equal(masters[0].grad, (expected[0].half() * 0.5).float())
    assert torch.equal(masters[1].grad, expected[1])  # unchanged: not rounded through FP16

    with torch.no_grad():
        masters[0].add_(1.0)
    plugin.after_applied_step()
    assert torch.equal(params[0], masters[0].detach().half())
    assert torch.equal(plugin.state_dict()["master_weights"][0], masters[0].detach())


def test_o2_finds_an_fp16_inf():
    params = _params(2)
    plugin = PureLowPrecision(params, AmpConfig.from_dict({"use_pure_fp16": True}))
    _grads(params)
    params[1].grad[0] = float("-inf")
    assert plugin.unscale_and_check(None)[0] is True


def test_precision_for_picks_the_plugin():
    def strategy(**kw):
        s = DistributedStrategy()
        for k, v in kw.items():
            setattr(s, k, v)
        return s

    assert type(precision_for(strategy(), _params())) is FullPrecision
    assert type(precision_for(strategy(amp=True), _params())) is MixedPrecision
    o2 = strategy(amp=True, amp_configs={"use_pure_fp16": True})
    assert type(precision_for(o2, _params())) is PureLowPrecision
    assert type(precision_for(strategy(sharding=True), _params())) is ShardedPrecision


def test_a_scale_held_by_a_decr_ratio_too_close_to_1_blames_decr_ratio_not_min_loss_scaling():
    # Was: "the scale could not go lower (min_loss_scaling=1)" with the scale at 1024, far above it.
    config = AmpConfig.from_dict({"dtype": "float16", "init_loss_scaling": 1024.0, "decr_ratio": 1 - 1e-9,
                                  "decr_every_n_nan_or_inf": 1, "stuck_scale_patience": 2})
    plugin = MixedPrecision(_params(), config)
    plugin.update(True, None)
    assert plugin.loss_scale == 1024.0
    with pytest.raises(RuntimeError, match=re.escape(
        "the loss scale is stuck at 1024: 2 consecutive steps overflowed while decr_ratio=0.999999999 is too close "
        "to 1 to lower it (the scale is kept in FP32, where 1024 * decr_ratio rounds back to 1024), so training is "
        "not making progress. Use a decr_ratio further from 1 (the default is 0.5)"
    )):
        plugin.update(True, None)
