"""optim.sharded_masters.ShardedMasters: one rank's pieces (hand-computed views), masters, install, errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.core.flat_layout import Piece
from distamp.sharding.sharded_masters import ShardedMasters


def _params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(2, 3, generator=g)), nn.Parameter(torch.randn(4, generator=g))]


def test_o1_pieces_are_views_of_the_model_parameters():
    params = _params()
    sm = ShardedMasters(params, None, None, rank=1, world_size=2)  # 10 elements: rank 1 owns [5, 10)
    assert sm.pieces == [Piece(0, 5, 6, 5), Piece(1, 0, 4, 6)]
    assert not sm.enabled
    assert sm.state_dict() == []
    assert sm.masters[0].data_ptr() == params[0].view(-1)[5:].data_ptr()
    assert torch.equal(sm.masters[1], params[1].detach())
    assert sm.convert_model() == 0


def test_o2_masters_are_the_fp32_slice_and_the_model_is_rounded():
    params = _params()
    originals = [p.detach().clone() for p in params]
    sm = ShardedMasters(params, torch.bfloat16, None, rank=0, world_size=2)  # rank 0 owns [0, 5)
    assert sm.pieces == [Piece(0, 0, 5, 0)]
    assert torch.equal(sm.values, originals[0].view(-1)[:5])
    assert torch.equal(sm.masters[0], originals[0].view(-1)[:5])
    assert [p.dtype for p in params] == [torch.bfloat16, torch.bfloat16]
    assert torch.equal(params[1], originals[1].to(torch.bfloat16))
    exact = sm.exact_fp32()  # before the start-up broadcast: the kept originals
    assert torch.equal(exact[id(params[1])], originals[1])
    assert sm.convert_model(keep_fp32=[params[1]]) == 1
    assert torch.equal(params[1], originals[1])


def test_install_slices_groups_and_state():
    params = _params()
    opt = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "lr": 0.5}], lr=0.1, momentum=0.9)
    params[0].grad, params[1].grad = torch.ones(2, 3), torch.ones(4)
    opt.step()
    momentum = opt.state[params[0]]["momentum_buffer"].clone()
    sm = ShardedMasters(params, None, None, rank=1, world_size=2)
    sm.install(opt)
    assert opt.param_groups[0]["params"] == [sm.masters[0]]
    assert opt.param_groups[1]["params"] == [sm.masters[1]]
    assert opt.param_groups[1]["lr"] == 0.5
    assert torch.equal(opt.state[sm.masters[0]]["momentum_buffer"], momentum.view(-1)[5:])
    assert sm.layout_state()["groups"] == [[0], [1]]
    with pytest.raises(ValueError, match=re.escape("parameter of shape (3,) is not managed by this optimizer")):
        sm.install(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))


def test_refusals_and_bad_parameters():
    params = _params()
    sm = ShardedMasters(params, None, None, rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=r"a parameter's FP32 master is split across ranks"):
        sm.master_for(params[0])
    with pytest.raises(RuntimeError, match=re.escape("add_param_group() is not supported with strategy.sharding")):
        sm.add([nn.Parameter(torch.zeros(1))])
    with pytest.raises(TypeError, match=re.escape(
        "strategy.sharding: parameter 0 (shape (2,)) is torch.float64; sharded optimizer state needs "
        "torch.float32 or torch.bfloat16 parameters"
    )):
        ShardedMasters([nn.Parameter(torch.zeros(2, dtype=torch.float64))], torch.bfloat16, None, 0, 1)
    with pytest.raises(ValueError, match=re.escape("strategy.sharding: parameter 0 (shape (3, 2)) is not contiguous")):
        ShardedMasters([nn.Parameter(torch.zeros(2, 3).t())], None, None, 0, 1)


def test_load_state_dict_checks_the_slice_length():
    params = _params()
    sm = ShardedMasters(params, torch.bfloat16, None, rank=0, world_size=1)
    with pytest.raises(ValueError, match=re.escape(
        "checkpoint holds FP32 master slices of [9] elements but this rank's slice has 10"
    )):
        sm.load_state_dict([torch.zeros(9)])
    new = torch.arange(10, dtype=torch.float32)
    sm.load_state_dict([new])
    assert torch.equal(params[0], new[:6].view(2, 3).to(torch.bfloat16))


def test_empty_params():
    sm = ShardedMasters([], torch.bfloat16, None, rank=0, world_size=1)
    assert sm.pieces == []
    assert sm.masters == []
    assert sm.exact_fp32() == {}
