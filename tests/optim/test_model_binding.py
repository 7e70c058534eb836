"""optim.model_binding.ModelBinding: names, FP32-kept parameters back from the masters, norm buffers, hooks."""

from __future__ import annotations

import torch
from torch import nn

from distamp.core.master_weights import MasterWeights
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


class _Block(nn.Module):
    def __init__(self) -> None:
        from tests.amp.test_fp32_parameters import LayerNorm, LlamaRMSNorm

        super().__init__()
        self.ln_1 = LayerNorm(8, bias=False)
        self.mlp = nn.Linear(8, 8)
        self.ln_2 = LlamaRMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln_2(self.ln_1(x)))


class _NanoGpt(nn.Module):
    """nanoGPT's shape: its own LayerNorm class per block and at the end, and a torch RMSNorm."""

    def __init__(self) -> None:
        from tests.amp.test_fp32_parameters import LayerNorm

        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Linear(8, 8)  # 16-bit activations into the first norm, as nanoGPT's embedding gives
        self.h = nn.ModuleList(_Block() for _ in range(2))
        self.rms = nn.RMSNorm(8)
        self.ln_f = LayerNorm(8, bias=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.wte(x)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(self.rms(x)))


def _o2_norm_warnings(how: str, **amp_configs) -> tuple[list[str], _NanoGpt]:
    import warnings

    import torch.nn.functional as F

    from distamp import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", **amp_configs}
    if how == "stage3":
        strategy.sharding = True
        strategy.sharding_configs = {"stage": 3}
    model = _NanoGpt()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        run = model if how == "alone" else fleet.distributed_model(model)   # alone: adopted at the first forward
        with fleet.auto_cast():
            loss = F.cross_entropy(run(torch.randn(4, 8)), torch.tensor([0, 1, 2, 0]))
        optimizer.minimize(loss)
    return [str(w.message) for w in caught if "normalization layers" in str(w.message)], model


def test_o2_warns_once_about_norm_classes_torch_does_not_know_with_the_patterns_that_fix_it():
    messages, model = _o2_norm_warnings("wrapped")
    assert len(messages) == 1
    assert messages[0].startswith(
        "O2 (use_pure_fp16=True) stores the parameters of 'h.0.ln_1' (LayerNorm), 'h.0.ln_2' (LlamaRMSNorm), "
        "'h.1.ln_1' (LayerNorm), 'h.1.ln_2' (LlamaRMSNorm) and 1 more in bfloat16")
    assert "'custom_black_varnames': ['h.*.ln_1', 'h.*.ln_2', 'ln_f']}" in messages[0]
    assert model.h[0].ln_1.weight.dtype == torch.bfloat16  # as the warning says
    assert model.rms.weight.dtype == torch.float32  # torch's nn.RMSNorm: kept by type, not reported


def test_the_suggested_patterns_keep_those_norms_in_fp32_and_silence_the_warning():
    messages, model = _o2_norm_warnings("wrapped", custom_black_varnames=["h.*.ln_1", "h.*.ln_2", "ln_f"])
    assert messages == []
    assert {p.dtype for name, p in model.named_parameters() if "ln_" in name} == {torch.float32}


def test_keep_norm_fp32_false_asks_for_16_bit_norms_and_gets_no_warning():
    messages, model = _o2_norm_warnings("wrapped", keep_norm_fp32=False)
    assert messages == []
    assert model.rms.weight.dtype == torch.bfloat16


def test_the_norm_warning_also_comes_without_distributed_model_and_at_stage_3():
    for how in ("alone", "stage3"):
        messages, _ = _o2_norm_warnings(how)
        assert len(messages) == 1, how
        assert "'custom_black_varnames': ['h.*.ln_1', 'h.*.ln_2', 'ln_f']}" in messages[0]
