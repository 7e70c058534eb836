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


# --------------------------------------------------------------------------- norms torch.nn does not know
class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm: nn.LayerNorm with an optional bias, written out."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class LlamaRMSNorm(nn.Module):
    """Llama's RMSNorm, as Hugging Face writes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class PreNorm(nn.Module):
    """Named like a norm, but its only parameters are its children's (an nn.LayerNorm and a Linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = nn.Linear(dim, dim)


class MyLayerNorm(nn.LayerNorm):
    """A subclass of torch's: recognised by type."""


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(dim, bias=False)
        self.attn = nn.Linear(dim, dim)
        self.ln_2 = LlamaRMSNorm(dim)
        self.pre = PreNorm(dim)
        self.rms = nn.RMSNorm(dim)
        self.sub = MyLayerNorm(dim)


class Gpt(nn.Module):
    def __init__(self, dim: int = 4, blocks: int = 3) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.ln_f = LayerNorm(dim, bias=True)
        self.head = nn.Linear(dim, 2)


def test_norms_torch_does_not_know_are_found_by_their_class_name():
    from distamp.amp.fp32_parameters import unrecognised_norms

    found = unrecognised_norms(Gpt())
    assert found == [(f"h.{i}.{name}", cls) for i in range(3) for name, cls in
                     (("ln_1", "LayerNorm"), ("ln_2", "LlamaRMSNorm"))] + [("ln_f", "LayerNorm")]
    # By type, torch's norms (nn.RMSNorm included) and their subclasses are kept in FP32, never reported.
    model = Gpt()
    kept = _names(model, fp32_parameters(model))
    assert {"h.0.rms.weight", "h.0.sub.weight", "h.0.sub.bias", "h.0.pre.norm.weight"} <= set(kept)


def test_modules_a_black_pattern_already_keeps_are_not_reported():
    from distamp.amp.fp32_parameters import unrecognised_norms

    assert unrecognised_norms(Gpt(), ["h.*.ln_1", "h.1", "ln_f"]) == [("h.0.ln_2", "LlamaRMSNorm"),
                                                                      ("h.2.ln_2", "LlamaRMSNorm")]


@pytest.mark.parametrize(("name", "norm"), [("LayerNorm", True), ("LlamaRMSNorm", True), ("T5LayerNorm", True),
                                            ("LayerNorm2d", True), ("FusedRMSNorm", True), ("AdaGroupNorm", True),
                                            ("Normalize", False), ("Linear", False), ("Normal", False)])
def test_what_counts_as_a_norm_name(name, norm):
    from distamp.amp.fp32_parameters import looks_like_norm

    assert looks_like_norm(name) is norm


def test_the_message_names_the_modules_and_patterns_that_custom_black_varnames_accepts():
    from distamp.amp.black_modules import find_black_modules
    from distamp.amp.fp32_parameters import unrecognised_norms, unrecognised_norms_message

    model = Gpt()
    message = unrecognised_norms_message(unrecognised_norms(model), "bfloat16")
    assert message.startswith(
        "O2 (use_pure_fp16=True) stores the parameters of 'h.0.ln_1' (LayerNorm), 'h.0.ln_2' (LlamaRMSNorm), "
        "'h.1.ln_1' (LayerNorm), 'h.1.ln_2' (LlamaRMSNorm) and 3 more in bfloat16: "
    )
    patterns = ["h.*.ln_1", "h.*.ln_2", "ln_f"]
    assert f"'custom_black_varnames': {patterns!r}" in message
    assert "amp_configs['keep_norm_fp32'] = False" in message
    assert [name for name, _ in find_black_modules(model, patterns)] == [
        "h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "h.2.ln_1", "h.2.ln_2", "ln_f"]
    assert unrecognised_norms(model, patterns) == []


def test_a_compiled_model_reports_and_keeps_its_norms_by_the_names_of_the_model_inside():
    """The O2 warning's modules and patterns, and stage 3's FP32 modules, are named as for the eager model."""
    from distamp.amp.fp32_parameters import fp32_modules, unrecognised_norms, unrecognised_norms_message

    model = Gpt()
    compiled = torch.compile(model, backend="eager")  # nothing is compiled: only names are read
    assert unrecognised_norms(compiled) == unrecognised_norms(model)
    assert unrecognised_norms_message(unrecognised_norms(compiled), "bfloat16") == unrecognised_norms_message(
        unrecognised_norms(model), "bfloat16")
    assert unrecognised_norms(compiled, ["h.*.ln_1", "h.1", "ln_f"]) == [("h.0.ln_2", "LlamaRMSNorm"),
                                                                         ("h.2.ln_2", "LlamaRMSNorm")]
    assert [(name, id(m)) for name, m in fp32_modules(compiled, ["h.1"], keep_norm_fp32=True)] == [
        (name, id(m)) for name, m in fp32_modules(model, ["h.1"], keep_norm_fp32=True)]
    assert fp32_parameters(compiled, ["head"]) == fp32_parameters(model, ["head"])
