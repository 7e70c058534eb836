"""strategy.checks: the type predicates, show(), where(), and the as_* config checks with their messages."""

from __future__ import annotations

import fractions
import re

import numpy as np
import pytest
import torch

from distamp.strategy.checks import (
    FLOAT32_MAX,
    INT64_MAX,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_names,
    finite_float,
    is_integer,
    is_name,
    is_real,
    show,
    where,
)


def test_constants():
    assert torch.iinfo(torch.int64).max == INT64_MAX
    assert float(torch.finfo(torch.float32).max) == FLOAT32_MAX


@pytest.mark.parametrize(
    ("value", "real", "integer"),
    [
        (1, True, True),
        (np.int64(3), True, True),
        (1.5, True, False),
        (np.float32(2.0), True, False),
        (fractions.Fraction(1, 3), True, False),
        (True, False, False),
        (False, False, False),
        ("1", False, False),
        (None, False, False),
        (1j, False, False),
    ],
)
def test_is_real_and_is_integer(value, real, integer):
    assert is_real(value) is real
    assert is_integer(value) is integer


def test_finite_float():
    assert finite_float(3) == 3.0
    assert finite_float(fractions.Fraction(1, 4)) == 0.25
    assert finite_float(10**400) is None  # float() overflows
    assert finite_float(float("inf")) is None
    assert finite_float(float("nan")) is None
    assert finite_float(True) is None
    assert finite_float("1.0") is None


def test_is_name():
    assert is_name("linear")
    assert not is_name("")
    assert not is_name("  \t")
    assert not is_name(None)
    assert not is_name(b"linear")


def test_show_truncates_and_survives_bad_reprs():
    assert show("abc") == "'abc'"
    assert show(list(range(100))) == repr(list(range(100)))[:200] + "..."
    huge = 10**5000  # repr raises ValueError from Python 3.11 (int max str digits)
    assert show(huge) == f"<int with {huge.bit_length()} bits>"

    class Bad:
        def __repr__(self):
            raise RuntimeError("no repr")

    bad = Bad()
    assert show(bad) == object.__repr__(bad)


def test_where_names_the_setting_three_ways():
    assert where("strategy", "amp") == "strategy.amp"
    assert where("auto_cast()", "dtype") == "auto_cast(dtype=...)"
    assert where("amp_configs", "dtype") == "amp_configs['dtype']"


def test_as_bool():
    assert as_bool("strategy", "amp", True) is True
    assert as_bool("strategy", "amp", False) is False
    with pytest.raises(ValueError, match=re.escape("strategy.amp must be a bool (True or False); got 1.")):
        as_bool("strategy", "amp", 1)


def test_as_int_bounds_and_types():
    assert as_int("c", "k", np.int32(5), 1) == 5
    assert as_int("c", "k", INT64_MAX, 0) == INT64_MAX
    msg = re.escape("c['k'] must be an int >= 1 (at most 2**63 - 1); got ")
    for bad in (0, INT64_MAX + 1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=msg):
            as_int("c", "k", bad, 1)
    with pytest.raises(ValueError, match=re.escape("got 0.")):
        as_int("c", "k", 0, 1)


def test_as_float_predicate_and_message():
    assert as_float("c", "s", 2, "> 0", lambda x: x > 0) == 2.0
    assert isinstance(as_float("c", "s", 2, "> 0", lambda x: x > 0), float)
    for bad in (0.0, float("nan"), float("inf"), True, None):
        with pytest.raises(ValueError, match=r"^c\['s'\] must be > 0; got "):
            as_float("c", "s", bad, "> 0", lambda x: x > 0)


def test_as_choice_accepts_names_and_dtypes():
    choices = ("float16", "bfloat16")
    assert as_choice("c", "dtype", "bfloat16", choices) == "bfloat16"
    assert as_choice("c", "dtype", torch.float16, choices, dtypes=True) == "float16"
    with pytest.raises(ValueError, match=r"got torch\.float16\.$"):
        as_choice("c", "dtype", torch.float16, choices)  # dtypes not allowed here
    with pytest.raises(ValueError, match=r"got torch\.float32\.$"):
        as_choice("c", "dtype", torch.float32, choices, dtypes=True)  # a dtype outside the choices


def test_as_choice_messages_with_alias_and_typo_hints():
    choices = ("float16", "bfloat16")
    with pytest.raises(ValueError, match=re.escape(
        "c['dtype'] must be one of 'float16', 'bfloat16' (or the matching torch dtype); got 'BF16'. "
        "Did you mean 'bfloat16'?"
    )):
        as_choice("c", "dtype", "BF16", choices, dtypes=True)
    with pytest.raises(ValueError, match=re.escape("got 'flaot16'. Did you mean 'float16'?")):
        as_choice("c", "dtype", "flaot16", choices)
    with pytest.raises(ValueError, match=re.escape("must be one of 'float16', 'bfloat16'; got 3.") + "$"):
        as_choice("c", "dtype", 3, choices)


def test_as_names():
    assert as_names("c", "k", ["a", "b"], "ops") == ("a", "b")
    assert as_names("c", "k", (), "ops") == ()
    with pytest.raises(ValueError, match=re.escape(
        "c['k'] must be a list of ops (non-empty strings); got 'a'. Wrap a single name in a list: ['a']."
    )):
        as_names("c", "k", "a", "ops")
    with pytest.raises(ValueError, match=re.escape("got {'a'}.")):
        as_names("c", "k", {"a"}, "ops")
    with pytest.raises(ValueError, match=re.escape("got ['a', ' '], whose item ' ' is not a non-empty string.")):
        as_names("c", "k", ["a", " "], "ops")
