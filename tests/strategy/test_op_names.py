"""op_names: canonical names of torch ops, aliases, in-place names, and the callables a name stands for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distamp.strategy.op_names import (
    OP_ALIASES,
    canonical_op_name,
    expand_op_names,
    functions_named,
    is_inplace_op_name,
    is_known_op,
    known_op_names,
)


@pytest.mark.parametrize("spelling", ["matmul", "torch.matmul", "Tensor.__matmul__", " Tensor.matmul ",
                                      "__rmatmul__"])
def test_string_spellings_of_matmul(spelling):
    assert canonical_op_name(spelling) == "matmul"


@pytest.mark.parametrize(
    ("func", "name"),
    [
        (torch.matmul, "matmul"),
        (torch.Tensor.__matmul__, "matmul"),
        (torch.Tensor.__radd__, "add"),
        (torch.Tensor.__iadd__, "add_"),
        (torch.Tensor.__truediv__, "div"),
        (torch.Tensor.__getitem__, "getitem"),
        (F.softmax, "softmax"),
        (torch.linalg.vector_norm, "vector_norm"),
        (torch.special.expm1, "expm1"),
        (torch.Tensor.shape.__get__, "shape"),
    ],
)
def test_callables(func, name):
    assert canonical_op_name(func) == name


def test_unknown_dunder_keeps_its_core_and_unnamed_callable_raises():
    assert canonical_op_name("__foo__") == "foo"
    with pytest.raises(TypeError, match=r"canonical_op_name\(\) needs a string or a named callable, got 3 of type int"):
        canonical_op_name(3)


def test_inplace_names():
    assert is_inplace_op_name("add_")
    assert is_inplace_op_name("setitem")
    assert not is_inplace_op_name("add")
    assert not is_inplace_op_name("__add__")
    assert not is_inplace_op_name("getitem")


def test_known_names_come_from_torch_and_include_aliases():
    names = known_op_names()
    assert {"matmul", "softmax", "conv2d", "vector_norm", "expm1", "layer_norm", "conv", "conv_transpose"} <= names
    assert "__repr__" not in names
    assert "repr" not in names
    assert not any(n.startswith("_") for n in names)
    assert is_known_op("F.gelu")
    assert is_known_op("torch.special.expm1")
    assert not is_known_op("definitely_not_an_op")


def test_expand_aliases_and_canonicalise():
    assert expand_op_names(["conv"]) == OP_ALIASES["conv"]
    assert expand_op_names(["conv_transpose", "torch.mm"]) == {"conv_transpose1d", "conv_transpose2d",
                                                               "conv_transpose3d", "mm"}
    assert expand_op_names([]) == frozenset()
    assert expand_op_names(["nope"]) == {"nope"}  # not validated here


def test_functions_named_finds_every_form():
    funcs = functions_named(["matmul"])
    assert torch.matmul in funcs
    assert torch.Tensor.matmul in funcs
    assert torch.Tensor.__matmul__ in funcs
    assert torch.mm not in funcs
    conv = functions_named(["conv"])
    assert F.conv2d in conv
    assert F.conv_transpose1d in conv
    assert functions_named(["nope"]) == frozenset()
