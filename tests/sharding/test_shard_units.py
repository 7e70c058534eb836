"""Stage 3's units: the default (repeated blocks, else parameter-holding modules) and named patterns."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.sharding.shard_units import choose_units, shared_parameters


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))


class _Gpt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(4, 10)


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.inner = nn.Module()
        self.inner.fc2 = nn.Linear(4, 4)
        self.act = nn.ReLU()


def _names(units):
    return [name for name, _ in units]


def test_default_units_are_the_blocks_of_the_outermost_module_list():
    assert _names(choose_units(_Gpt(), ())) == ["blocks.0", "blocks.1"]


def test_default_units_of_a_sequential_mlp_are_its_parameter_holding_layers():
    mlp = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 10))
    assert _names(choose_units(mlp, ())) == ["0", "2", "3", "4"]


def test_without_containers_every_module_holding_parameters_of_its_own_is_a_unit():
    assert _names(choose_units(_Flat(), ())) == ["fc1", "inner.fc2"]


def test_without_containers_a_module_holding_parameters_keeps_its_children_in_its_unit():
    # nn.MultiheadAttention reads out_proj.weight itself: out_proj must not be a unit of its own.
    model = nn.Module()
    model.embed = nn.Embedding(10, 8)
    model.attn = nn.MultiheadAttention(8, 2)
    model.encoder = nn.TransformerEncoderLayer(8, 2, 16)
    assert _names(choose_units(model, ())) == [
        "embed", "attn", "encoder.self_attn", "encoder.linear1", "encoder.linear2", "encoder.norm1",
        "encoder.norm2"]


class _TiedFlat(nn.Module):
    """No containers; the output head's weight is the embedding's (a small GPT's tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_default_units_leave_modules_sharing_a_parameter_in_the_root():
    # FSDP2 refuses one parameter in two units: the tied embedding and head stay in the root.
    assert _names(choose_units(_TiedFlat(), ())) == ["norm"]
    embed, proj = nn.Embedding(10, 4), nn.Linear(4, 4)
    tied_sequential = nn.Sequential(embed, proj, nn.Linear(4, 10, bias=False))
    tied_sequential[2].weight = embed.weight
    assert _names(choose_units(tied_sequential, ())) == ["1"]
    shared = nn.Parameter(torch.ones(4, 4))
    gpt = _Gpt()
    gpt.blocks[0].mlp[0].weight = gpt.blocks[1].mlp[2].weight = shared  # one Parameter in two blocks
    assert _names(choose_units(gpt, ())) == []
    gpt = _Gpt()
    gpt.head.weight = gpt.blocks[1].mlp[0].weight  # a block's parameter also held by the root's head
    assert _names(choose_units(gpt, ())) == ["blocks.0"]


def test_shared_parameters_names_each_shared_parameter_and_its_holders():
    model = _TiedFlat()
    assert shared_parameters(model, [("embed", model.embed), ("head", model.head)]) == [
        ("embed.weight", ["embed", "head"])]
    assert shared_parameters(model, [("head", model.head)]) == [("embed.weight", ["", "head"])]
    assert shared_parameters(model, [("norm", model.norm)]) == []


def test_patterns_choose_the_matching_modules_that_hold_parameters():
    assert _names(choose_units(_Gpt(), ["blocks.*.mlp", "head"])) == ["blocks.0.mlp", "blocks.1.mlp", "head"]
    assert _names(choose_units(_Gpt(), ["blocks.0"])) == ["blocks.0"]


def test_a_pattern_matching_nothing_names_the_valid_modules():
    with pytest.raises(ValueError, match=re.escape(
            "sharding_configs['units'] pattern 'block.*' matches no submodule of _Gpt.")) as info:
        choose_units(_Gpt(), ["block.*"])
    assert "'embed', 'blocks', 'blocks.0'" in str(info.value)


@pytest.mark.parametrize("patterns", [(), ("blocks.*.mlp", "head"), ("_orig_mod.blocks.*.mlp", "head")])
def test_a_compiled_models_units_are_the_eager_models_by_the_same_names(patterns):
    """torch.compile(model) before fleet.distributed_model: the units and their names are model's; a pattern
    spelled with the compile wrapper's "_orig_mod." still names them."""
    model = _Gpt()
    compiled = torch.compile(model, backend="eager")  # nothing is compiled: only names are read
    eager = choose_units(model, [p.removeprefix("_orig_mod.") for p in patterns])
    units = choose_units(compiled, list(patterns))
    assert [(name, id(m)) for name, m in units] == [(name, id(m)) for name, m in eager]
    assert _names(units) == (["blocks.0.mlp", "blocks.1.mlp", "head"] if patterns else ["blocks.0", "blocks.1"])
    with pytest.raises(ValueError, match=re.escape("pattern 'block.*' matches no submodule of _Gpt.")):
        choose_units(compiled, ["block.*"])


def test_a_compiled_models_shared_parameters_are_named_as_in_the_model():
    model = _TiedFlat()
    compiled = torch.compile(model, backend="eager")
    assert shared_parameters(compiled, [("embed", model.embed), ("head", model.head)]) == [
        ("embed.weight", ["embed", "head"])]
