"""strategy.views.ConfigView: the effective config as a read-only dict whose writes raise TypeError with advice."""

from __future__ import annotations

import copy
import pickle
import re

import pytest

from distamp.strategy import AmpConfig
from distamp.strategy.views import ConfigView


def _view():
    return ConfigView(AmpConfig.from_dict({"custom_black_list": ["matmul"], "init_loss_scaling": 1024.0}))


def test_view_equals_the_config_dict():
    config = AmpConfig.from_dict({"custom_black_list": ["matmul"], "init_loss_scaling": 1024.0})
    view = ConfigView(config)
    assert view == config.to_dict()
    assert view["custom_black_list"] == ["matmul"]
    assert view["init_loss_scaling"] == 1024.0


def _message(key):
    return re.escape(
        "strategy.amp_configs is a read-only view of the effective config; assign a whole dict instead, "
        f"e.g. strategy.amp_configs = {{**strategy.amp_configs, {key}: ...}}"
    )


@pytest.mark.parametrize(
    ("mutate", "key"),
    [
        (lambda v: v.__setitem__("dtype", "bfloat16"), "'dtype'"),
        (lambda v: v.__delitem__("dtype"), "'dtype'"),
        (lambda v: v.setdefault("extra", 1), "'extra'"),
        (lambda v: v.pop("dtype"), "'dtype'"),
        (lambda v: v.update(dtype="bfloat16"), "'key'"),
        (lambda v: v.clear(), "'key'"),
        (lambda v: v.popitem(), "'key'"),
        (lambda v: v.__ior__({"dtype": "bfloat16"}), "'key'"),
    ],
)
def test_every_dict_mutation_raises_and_changes_nothing(mutate, key):
    view = _view()
    before = dict(view)
    with pytest.raises(TypeError, match=_message(key)):
        mutate(view)
    assert dict(view) == before


@pytest.mark.parametrize(
    "mutate",
    [
        lambda x: x.append("a"),
        lambda x: x.extend(["a"]),
        lambda x: x.insert(0, "a"),
        lambda x: x.remove("matmul"),
        lambda x: x.pop(),
        lambda x: x.clear(),
        lambda x: x.sort(),
        lambda x: x.reverse(),
        lambda x: x.__setitem__(0, "a"),
        lambda x: x.__delitem__(0),
        lambda x: x.__iadd__(["a"]),
        lambda x: x.__imul__(2),
    ],
)
def test_list_values_are_read_only_and_name_their_key(mutate):
    view = _view()
    with pytest.raises(TypeError, match=_message("'custom_black_list'")):
        mutate(view["custom_black_list"])
    assert view["custom_black_list"] == ["matmul"]


def test_copies_are_ordinary_editable_dicts_and_lists():
    view = _view()
    for other in (view.copy(), copy.copy(view), copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert type(other) is dict
        assert other == dict(view)
        assert type(other["custom_black_list"]) is list
        other["custom_black_list"].append("conv2d")
        other["dtype"] = "bfloat16"
    assert view["custom_black_list"] == ["matmul"]
    assert view["dtype"] == "float16"
    assert type(pickle.loads(pickle.dumps(view["custom_black_list"]))) is list
