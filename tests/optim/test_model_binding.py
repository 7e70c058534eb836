"""optim.model_binding.ModelBinding: names, FP32-kept parameters back from the masters, norm buffers, hooks."""

from __future__ import annotations

import torch
from torch import nn

from distamp.optim.master_weights import MasterWeights
from distamp.optim.model_binding import ModelBinding
from distamp.strategy import AmpConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))


def test_names_default_to_params_index_until_adopted():
    model = _model()
    binding = ModelBinding(MasterWeights(model.parameters(), None), AmpConfig(), False, lambda: 1)
    weight = model[0].weight
    assert binding.name_of(weight, 3) == "params[3]"
    binding.adopt(model, [])
    assert binding.adopted
    assert binding.name_of(weight, 3) == "0.weight"
    assert binding.name_of(model[1].bias, 0) == "1.bias"
    assert binding.checker is None


def test_shared_parameter_keeps_its_first_name():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight = model[0].weight
    binding = ModelBinding(MasterWeights(model.parameters(), None), AmpConfig(), False, lambda: 1)
    binding.adopt(model, [])
    assert binding.name_of(model[1].weight, 0) == "0.weight"


def test_o2_kept_parameters_get_exact_fp32_back():
    model = _model()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = MasterWeights(model.parameters(), torch.bfloat16)
    masters.convert_model()
    binding = ModelBinding(masters, AmpConfig.from_dict({"use_pure_fp16": True}), True, lambda: 1)
    keep = list(model[1].parameters())
    binding.adopt(model, keep)
    for name, p in model.named_parameters():
        if name.startswith("1."):
            assert p.dtype == torch.float32
            assert torch.equal(p, originals[name])
        else:
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, originals[name].to(torch.bfloat16))
    assert model[2].running_mean.dtype == torch.float32  # keep_norm_fp32 defaults to True
    binding.adopt(model, [model[0].weight])  # once only
    assert model[0].weight.dtype == torch.bfloat16


def test_keep_norm_fp32_false_stores_unkept_norm_buffers_low():
    model = _model()
    masters = MasterWeights(model.parameters(), torch.float16)
    masters.convert_model()
    config = AmpConfig.from_dict({"use_pure_fp16": True, "keep_norm_fp32": False})
    ModelBinding(masters, config, True, lambda: 1).adopt(model, [])
    assert model[2].running_mean.dtype == torch.float16
    assert model[2].running_var.dtype == torch.float16
    assert model[2].num_batches_tracked.dtype == torch.int64

    kept = _model()
    masters = MasterWeights(kept.parameters(), torch.float16)
    masters.convert_model()
    ModelBinding(masters, config, True, lambda: 1).adopt(kept, list(kept[2].parameters()))
    assert kept[2].running_mean.dtype == torch.float32  # its parameters stay FP32: so do its statistics


def test_check_nan_inf_installs_a_checker_only_with_amp():
    config = AmpConfig.from_dict({"check_nan_inf": True})
    model = _model()
    on = ModelBinding(MasterWeights(model.parameters(), None), config, True, lambda: 1)
    on.adopt(model, [])
    assert on.checker is not None
    off = ModelBinding(MasterWeights(model.parameters(), None), config, False, lambda: 1)
    off.adopt(_model(), [])
    assert off.checker is None
