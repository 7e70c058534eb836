"""unwrap_model: looks through DataParallel/DDP-style ``.module`` and torch.compile's ``._orig_mod`` only; the
names of the model inside (wrapper_prefix, user_name, known_name)."""

from __future__ import annotations

import torch
from torch import nn

from distamp.model_views import fp32_model_state_dict, known_name, unwrap_model, user_name, wrapper_prefix


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module, name: str = "module") -> None:
        super().__init__()
        self.add_module(name, inner)


def test_plain_model_is_itself():
    model = nn.Linear(2, 2)
    assert unwrap_model(model) is model


def test_nested_wrappers_are_peeled():
    model = nn.Linear(2, 2)
    assert unwrap_model(Wrapper(Wrapper(model, "_orig_mod"))) is model


def test_compiled_module_is_unwrapped_without_compiling():
    model = nn.Linear(2, 2)
    assert unwrap_model(torch.compile(model)) is model


def test_a_model_with_a_child_called_module_and_its_own_parameters_is_not_unwrapped():
    outer = Wrapper(nn.Linear(2, 2))
    outer.scale = nn.Parameter(torch.ones(1))
    assert unwrap_model(outer) is outer


def test_other_single_children_and_several_children_stop_the_search():
    inner = nn.Linear(2, 2)
    assert unwrap_model(Wrapper(inner, "body")).body is inner
    two = Wrapper(inner)
    two.other = nn.ReLU()
    assert unwrap_model(two) is two


def test_the_wrappers_prefix_and_the_models_names_inside_them():
    model = nn.Sequential(nn.Linear(2, 2))
    assert wrapper_prefix(model) == ""
    assert wrapper_prefix(torch.compile(model)) == "_orig_mod."
    wrapped = Wrapper(torch.compile(model))
    assert wrapper_prefix(wrapped) == "module._orig_mod."
    assert [user_name(wrapped, name) for name, _ in wrapped.named_modules()] == ["", "module", "", "0"]
    assert user_name(wrapped, "module._orig_mod.0.weight") == "0.weight"
    assert user_name(model, "0.weight") == "0.weight"


def test_a_name_spelled_inside_wrappers_is_known_by_the_models_name():
    known = {"0.weight", "module.x"}
    assert known_name("_orig_mod.0.weight", known) == "0.weight"
    assert known_name("module._orig_mod.0.weight", known) == "0.weight"
    assert known_name("module.x", known) == "module.x"  # a name the model has is kept
    assert known_name("_orig_mod.1.weight", known) == "_orig_mod.1.weight"  # neither: unchanged
    assert known_name("body.0.weight", known) == "body.0.weight"


class _NoMasters:
    """Masters of nothing: every parameter is its own (O1, AMP off, float64 in O2)."""

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        return {}


def test_the_export_widens_16_bit_parameters_and_keeps_float64_ones_whole():
    # Was: a float64 parameter was exported rounded to FP32 (all of them went through .float()).
    model = nn.Sequential(nn.Linear(2, 3).double(), nn.Linear(3, 2).bfloat16(), nn.Embedding(4, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = 1 + 2.0**-40  # not an FP32 number
    exported = fp32_model_state_dict(model, [_NoMasters()])
    assert exported["0.weight"].dtype == torch.float64
    assert torch.equal(exported["0.weight"], model[0].weight)
    assert exported["0.weight"].data_ptr() != model[0].weight.data_ptr()  # a copy
    assert exported["1.weight"].dtype == torch.float32
    assert torch.equal(exported["1.weight"], model[1].weight.float())
    assert exported["2.weight"].dtype == torch.float32
