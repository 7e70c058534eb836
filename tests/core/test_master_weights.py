"""optim.master_weights: FP32 masters bitwise from the originals, model copies rounded from them, grads, state."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.core.master_weights import (
    MasterWeights,
    clear_grads,
)
from distamp.model_views import fp32_model_state_dict


def _params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(3, 4, generator=g)), nn.Parameter(torch.randn(5, generator=g)),
            nn.Parameter(torch.randn(2, dtype=torch.float64, generator=g))]


def test_o1_every_parameter_is_its_own_master():
    params = _params()
    mw = MasterWeights([*params, params[0]], None)  # a repeated parameter is managed once
    assert mw.model_params == params
    assert not mw.enabled
    assert all(m is p for m, p in zip(mw.masters, params, strict=True))
    assert mw.convert_model() == 0
    assert mw.state_dict()[0] is not params[0]
    assert torch.equal(mw.state_dict()[0], params[0])


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_o2_masters_are_the_fp32_originals_and_the_model_is_their_rounding(low):
    params = _params()
    originals = [p.detach().clone() for p in params]
    mw = MasterWeights(params, low)
    assert mw.enabled
    assert mw.convert_model() == 2  # the float64 parameter is left alone
    for master, original in zip(mw.masters[:2], originals[:2], strict=True):
        assert master.dtype == torch.float32
        assert torch.equal(master, original)
    for p, master in zip(params[:2], mw.masters[:2], strict=True):
        assert p.dtype == low
        assert torch.equal(p, master.detach().to(low))
    assert mw.masters[2] is params[2]
    assert params[2].dtype == torch.float64


def test_keep_fp32_gets_the_exact_value_back_later():
    params = _params()
    original = params[1].detach().clone()
    mw = MasterWeights(params, torch.bfloat16)
    mw.convert_model()
    assert params[1].dtype == torch.bfloat16
    assert mw.convert_model(keep_fp32=[params[1]]) == 1
    assert params[1].dtype == torch.float32
    assert torch.equal(params[1], original)
    assert mw.convert_model(keep_fp32=[params[1]]) == 0


def test_grads_round_trip_and_parameters_without_grad():
    params = _params()
    mw = MasterWeights(params, torch.bfloat16)
    mw.convert_model()
    params[0].grad = torch.randn(3, 4).to(torch.bfloat16)
    mw.copy_grads_to_masters()
    assert torch.equal(mw.masters[0].grad, params[0].grad.float())
    assert mw.masters[1].grad is None
    mw.add_to_master_grads({id(params[0]): torch.ones(12), id(params[1]): torch.ones(5)})
    assert torch.equal(mw.masters[0].grad, params[0].grad.float() + 1)
    assert mw.masters[1].grad is None  # no gradient: nothing to add to
    assert [(g is params[0].grad, m is mw.masters[0].grad) for g, m in mw.grad_pairs()] == [(True, True)]
    mw.zero_master_grads()
    assert mw.masters[0].grad is None


def test_copy_masters_to_model_rounds_updates():
    params = _params()
    mw = MasterWeights(params, torch.float16)
    mw.convert_model()
    with torch.no_grad():
        mw.masters[0].add_(1e-4)  # below FP16 spacing for some elements, kept by the master
    mw.copy_masters_to_model()
    assert torch.equal(params[0], mw.masters[0].detach().to(torch.float16))


def test_install_moves_state_to_masters_in_fp32():
    params = _params()[:2]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(3, 4)
    opt.step()
    buf = opt.state[params[0]]["momentum_buffer"].clone()
    mw = MasterWeights(params, torch.bfloat16)
    mw.install(opt)
    assert opt.param_groups[0]["params"] == mw.masters
    assert torch.equal(opt.state[mw.masters[0]]["momentum_buffer"], buf)
    assert params[0] not in opt.state


def test_master_for_unknown_parameter():
    mw = MasterWeights(_params(), torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("parameter of shape (7,) is not managed by this optimizer")):
        mw.master_for(nn.Parameter(torch.zeros(7)))


def test_add_converts_new_parameters():
    params = _params()
    mw = MasterWeights(params, torch.bfloat16)
    mw.convert_model()
    new = nn.Parameter(torch.randn(4))
    original = new.detach().clone()
    (master,) = mw.add([new, params[0]])  # params[0] is already managed
    assert torch.equal(master, original)
    assert new.dtype == torch.bfloat16
    assert mw.model_params[-1] is new
    assert mw.master_for(new) is master


def test_empty_params():
    mw = MasterWeights([], torch.bfloat16)
    assert not mw.enabled
    assert mw.masters == []
    mw.copy_grads_to_masters()
    mw.copy_masters_to_model()
    assert mw.state_dict() == []


def test_state_dict_load_and_errors():
    params = _params()
    mw = MasterWeights(params, torch.bfloat16)
    mw.convert_model()
    saved = [t.clone() + 1 for t in mw.state_dict()]
    mw.load_state_dict(saved)
    assert all(torch.equal(m, s) for m, s in zip(mw.masters, saved, strict=True))
    assert torch.equal(params[0], saved[0].to(torch.bfloat16))
    with pytest.raises(ValueError, match=re.escape(
        "checkpoint has 2 master weights but this optimizer manages 3 parameters; was it saved from the same model?"
    )):
        mw.load_state_dict(saved[:2])
    with pytest.raises(ValueError, match=re.escape(
        "master weight 1 has shape (6,) in the checkpoint but (5,) in the model"
    )):
        mw.load_state_dict([saved[0], torch.zeros(6), saved[2]])


def test_fp32_model_state_dict_uses_masters():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    originals = {k: v.clone() for k, v in model.state_dict().items()}
    mw = MasterWeights(model.parameters(), torch.bfloat16)
    mw.convert_model()
    state = fp32_model_state_dict(model, [mw])
    for name in ("0.weight", "0.bias", "1.weight", "1.bias"):
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], originals[name])
    assert torch.equal(state["1.num_batches_tracked"], originals["1.num_batches_tracked"])


def test_clear_grads():
    params = _params()[:2]
    params[0].grad = torch.ones(3, 4)
    w = torch.ones(5, requires_grad=True)
    params[1].grad = w * 2  # a gradient with a grad_fn
    clear_grads(params, set_to_none=False)
    grads = [p.grad for p in params]
    assert all(g is not None and not g.any() for g in grads)
    assert params[1].grad.grad_fn is None
    clear_grads(params)
    assert [p.grad for p in params] == [None, None]
