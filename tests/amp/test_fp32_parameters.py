"""fp32_parameters: which parameters O2 keeps in FP32 (black modules, norm layers), once each, in order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.amp.fp32_parameters import NORM_LAYER_TYPES, fp32_parameters


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.body = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.gn = nn.GroupNorm(2, 4)
        self.rms = nn.RMSNorm(4)
        self.inorm = nn.InstanceNorm1d(4, affine=True)
        self.head = nn.Linear(4, 2)


def _names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_norm_parameters_are_kept_by_default_in_parameter_order():
    model = Net()
    assert _names(model, fp32_parameters(model)) == [
        "bn.weight", "bn.bias", "ln.weight", "ln.bias", "gn.weight", "gn.bias", "rms.weight",
        "inorm.weight", "inorm.bias",
    ]


def test_keep_norm_fp32_false_keeps_nothing_without_patterns():
    assert fp32_parameters(Net(), keep_norm_fp32=False) == []


def test_black_patterns_add_the_whole_module_and_parameters_come_once():
    model = Net()
    names = _names(model, fp32_parameters(model, black_patterns=["head", "bn"], keep_norm_fp32=True))
    assert names == ["bn.weight", "bn.bias", "ln.weight", "ln.bias", "gn.weight", "gn.bias", "rms.weight",
                     "inorm.weight", "inorm.bias", "head.weight", "head.bias"]
    assert len(names) == len(set(names))


def test_black_pattern_covers_submodules_and_glob():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    assert _names(model, fp32_parameters(model, ["0"], keep_norm_fp32=False)) == [
        "0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias"]
    assert _names(model, fp32_parameters(model, ["0.*"], keep_norm_fp32=False)) == [
        "0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias"]


def test_shared_parameter_is_listed_once():
    model = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 3))
    model.extra = model[0]  # the same LayerNorm twice
    kept = fp32_parameters(model)
    assert [id(p) for p in kept] == [id(model[0].weight), id(model[0].bias)]


def test_a_pattern_that_matches_nothing_raises():
    with pytest.raises(ValueError, match=r"custom_black_varnames pattern 'haed' matches no submodule of Net\."):
        fp32_parameters(Net(), ["haed"])


def test_norm_layer_types_cover_batch_instance_layer_group_rms_norms():
    for module in (nn.BatchNorm1d(2), nn.SyncBatchNorm(2), nn.InstanceNorm2d(2), nn.LayerNorm(2),
                   nn.GroupNorm(1, 2), nn.RMSNorm(2)):
        assert isinstance(module, NORM_LAYER_TYPES)
    assert not isinstance(nn.Linear(2, 2), NORM_LAYER_TYPES)
    assert not isinstance(nn.Embedding(2, 2), NORM_LAYER_TYPES)


def test_frozen_and_non_affine_norms():
    model = nn.Sequential(nn.LayerNorm(3, elementwise_affine=False), nn.BatchNorm1d(3))
    model[1].weight.requires_grad_(False)
    kept = fp32_parameters(model)
    # frozen parameters are still parameters of the norm and stay FP32
    assert [id(p) for p in kept] == [id(model[1].weight), id(model[1].bias)]
    assert all(p.dtype == torch.float32 for p in kept)
