"""strategy.config_base.Config: from_dict (unknown keys, retired keys, non-dicts), to_dict and non_defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import pytest

from distamp.strategy.config_base import Config


@dataclass(frozen=True)
class _Toy(Config):
    _OWNER: ClassVar[str] = "toy_configs"
    _RETIRED: ClassVar[dict] = {"old_key": "toy has no old_key; use new_key."}

    new_key: int = 1
    names: tuple[str, ...] = ()
    ratio: float = 0.5


def test_from_dict_fills_defaults_and_returns_instances_as_is():
    toy = _Toy.from_dict({"new_key": 3})
    assert toy == _Toy(new_key=3, names=(), ratio=0.5)
    assert _Toy.from_dict(toy) is toy
    assert _Toy.from_dict({}) == _Toy()


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match=re.escape(
        "toy_configs has no key 'new_kee'. Did you mean 'new_key'? Valid keys: new_key, names, ratio."
    )):
        _Toy.from_dict({"new_kee": 2})


def test_retired_key_gets_its_advice_instead_of_a_suggestion():
    with pytest.raises(ValueError, match=re.escape(
        "toy_configs has no key 'old_key'. toy has no old_key; use new_key. Valid keys: new_key, names, ratio."
    )):
        _Toy.from_dict({"old_key": 1})


def test_non_string_key_gets_no_hint():
    with pytest.raises(ValueError, match=re.escape("toy_configs has no key 1. Valid keys: new_key, names, ratio.")):
        _Toy.from_dict({1: 2})


@pytest.mark.parametrize("mapping", [["new_key"], "new_key", None, 3])
def test_non_mapping_is_a_value_error_naming_the_type(mapping):
    with pytest.raises(ValueError, match=re.escape(
        f"toy_configs must be a dict of config keys; got {mapping!r} ({type(mapping).__name__}). "
        "Valid keys: new_key, names, ratio."
    )):
        _Toy.from_dict(mapping)


def test_to_dict_lists_tuples_and_non_defaults_keeps_changed_keys():
    toy = _Toy(new_key=1, names=("a", "b"), ratio=0.25)
    assert toy.to_dict() == {"new_key": 1, "names": ["a", "b"], "ratio": 0.25}
    assert type(toy.to_dict()["names"]) is list
    assert toy.non_defaults() == {"names": ["a", "b"], "ratio": 0.25}
    assert _Toy().non_defaults() == {}
    assert _Toy.from_dict(toy.to_dict() | {"names": ("a", "b")}) == toy
