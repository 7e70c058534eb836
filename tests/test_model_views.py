"""unwrap_model: looks through DataParallel/DDP-style ``.module`` and torch.compile's ``._orig_mod`` only."""

from __future__ import annotations

import torch
from torch import nn

from distamp.model_views import unwrap_model


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
