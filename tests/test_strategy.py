"""DistributedStrategy, AmpConfig, GradientMergeConfig and ShardingConfig: defaults, validation, views, round trips."""

from __future__ import annotations

import copy
import dataclasses
import fractions
import json
import math
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distamp.strategy import (
    AmpConfig,
    DistributedStrategy,
    GradientMergeConfig,
    ShardingConfig,
)
from distamp.strategy.op_names import known_op_names
from distamp.suggest import did_you_mean

# The contract's defaults (README's amp_configs table), copied by hand so a changed default fails here.
CONTRACT_DEFAULTS = {
    "init_loss_scaling": 32768.0,
    "use_dynamic_loss_scaling": True,
    "incr_every_n_steps": 1000,
    "decr_every_n_nan_or_inf": 2,
    "incr_ratio": 2.0,
    "decr_ratio": 0.5,
    "custom_white_list": [],
    "custom_black_list": [],
    "custom_black_varnames": [],
    "use_pure_fp16": False,
    "dtype": "float16",
    "loss_scaling_algorithm": "backoff",
    "min_loss_scaling": 1.0,
    "max_loss_scaling": 2.0**24,
    # distamp's own keys (team brief, "Interfaces").
    "comm_dtype": None,
    "gradient_predivide_factor": None,
    "stuck_scale_patience": 20,
    "keep_norm_fp32": True,
    "check_nan_inf": False,
    "overflow_retries": 0,
}
WHITE_OP, BLACK_OP = "matmul", "softmax"


def names(key: str, value) -> str:
    """Regex matching a message that names ``amp_configs[key]`` and shows ``value!r``."""
    return re.escape(f"amp_configs[{key!r}]") + ".*" + re.escape(repr(value))


# --------------------------------------------------------------------------- suggest


def test_did_you_mean_suggests_closest_and_nothing_for_strangers():
    assert did_you_mean("init_loss_scale", ["init_loss_scaling", "incr_ratio"]) == " Did you mean 'init_loss_scaling'?"
    assert did_you_mean("INIT_LOSS_SCALING", ["init_loss_scaling"]) == " Did you mean 'init_loss_scaling'?"
    assert did_you_mean("qqqqqq", ["init_loss_scaling"]) == ""
    assert did_you_mean(None, ["init_loss_scaling"]) == ""
    assert did_you_mean("amp", []) == ""


# --------------------------------------------------------------------------- defaults


def test_defaults_match_design_table():
    assert AmpConfig().to_dict() == CONTRACT_DEFAULTS
    assert DistributedStrategy().amp_configs == CONTRACT_DEFAULTS
    assert list(DistributedStrategy().amp_configs) == list(CONTRACT_DEFAULTS)


def test_strategy_defaults():
    s = DistributedStrategy()
    assert s.amp is False
    assert s.gradient_merge is False
    assert s.find_unused_parameters is False
    assert s.fuse_grad_size_in_MB == 25
    assert s.gradient_merge_configs == {"k_steps": 1, "avg": True}
    assert s.amp_config == AmpConfig()
    assert s.gradient_merge_config == GradientMergeConfig()
    assert s.amp_config.torch_dtype is torch.float16
    assert s.amp_config.comm_torch_dtype is torch.float16


def test_issue_done_when_command():
    code = "from distamp.strategy import DistributedStrategy as D; s = D(); s.amp_configs = {'init_loss_scale': 1.0}"
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError:")
    assert "'init_loss_scale'" in last
    assert "Did you mean 'init_loss_scaling'?" in last


# --------------------------------------------------------------------------- one bad value per branch

BAD_VALUES = [
    ("init_loss_scaling", 0, "> 0"),
    ("init_loss_scaling", -1.0, "> 0"),
    ("init_loss_scaling", math.nan, "finite"),
    ("init_loss_scaling", math.inf, "finite"),
    ("init_loss_scaling", 1e39, "float32"),
    ("init_loss_scaling", True, "float"),
    ("init_loss_scaling", "1024", "float"),
    ("init_loss_scaling", None, "float"),
    ("init_loss_scaling", [1.0], "float"),
    ("use_dynamic_loss_scaling", 1, "bool"),
    ("use_dynamic_loss_scaling", "True", "bool"),
    ("use_dynamic_loss_scaling", None, "bool"),
    ("incr_every_n_steps", 0, ">= 1"),
    ("incr_every_n_steps", 2.0, "int"),
    ("incr_every_n_steps", True, "int"),
    ("incr_every_n_steps", 2**63, "2\\*\\*63"),
    ("incr_every_n_steps", "10", "int"),
    ("decr_every_n_nan_or_inf", -3, ">= 1"),
    ("decr_every_n_nan_or_inf", 1.5, "int"),
    ("incr_ratio", 1.0, "> 1"),
    ("incr_ratio", 0.5, "> 1"),
    ("incr_ratio", math.inf, "finite"),
    ("incr_ratio", False, "float"),
    ("decr_ratio", 0, "\\(0, 1\\)"),
    ("decr_ratio", 1, "\\(0, 1\\)"),
    ("decr_ratio", 1.5, "\\(0, 1\\)"),
    ("decr_ratio", math.nan, "\\(0, 1\\)"),
    ("custom_white_list", WHITE_OP, "Wrap a single name in a list"),
    ("custom_white_list", b"matmul", "list of op names"),
    ("custom_white_list", {WHITE_OP}, "list of op names"),
    ("custom_white_list", [WHITE_OP, 3], "item 3 is not a non-empty string"),
    ("custom_white_list", [[WHITE_OP]], "is not a non-empty string"),
    ("custom_black_list", None, "list of op names"),
    ("custom_black_varnames", ["", "head"], "item '' is not a non-empty string"),
    ("custom_black_varnames", ["  "], "is not a non-empty string"),
    ("custom_black_varnames", "head", "Wrap a single name in a list"),
    ("custom_black_varnames", [None], "item None is not"),
    ("use_pure_fp16", "O2", "bool"),
    ("use_pure_fp16", 0, "bool"),
    ("dtype", "fp16", "Did you mean 'float16'"),
    ("dtype", "bfloat61", "Did you mean 'bfloat16'"),
    ("dtype", "float32", "'float16', 'bfloat16'"),
    ("dtype", torch.float32, "'float16', 'bfloat16'"),
    ("dtype", None, "'float16', 'bfloat16'"),
    ("dtype", 16, "'float16', 'bfloat16'"),
    ("loss_scaling_algorithm", "lognormall", "Did you mean 'lognormal'"),
    ("loss_scaling_algorithm", None, "'backoff', 'lognormal'"),
    ("min_loss_scaling", 0.0, "> 0"),
    ("min_loss_scaling", -1, "> 0"),
    ("max_loss_scaling", math.inf, "finite"),
    ("max_loss_scaling", 1e39, "float32"),
    ("comm_dtype", "float64", "'float16', 'bfloat16', 'float32'"),
    ("comm_dtype", torch.float64, "'float16', 'bfloat16', 'float32'"),
    ("comm_dtype", 1, "'float16', 'bfloat16', 'float32'"),
    ("gradient_predivide_factor", 0, ">= 1"),
    ("gradient_predivide_factor", 0.5, ">= 1"),
    ("gradient_predivide_factor", -2.0, ">= 1"),
    ("gradient_predivide_factor", math.nan, ">= 1"),
    ("gradient_predivide_factor", True, "float"),
    ("gradient_predivide_factor", "2", "float"),
    ("stuck_scale_patience", 0, ">= 1"),
    ("stuck_scale_patience", 1.5, "int"),
    ("stuck_scale_patience", True, "int"),
]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_bad_value_names_key_value_and_what_is_allowed(key, value, allowed):
    s = DistributedStrategy()
    with pytest.raises(ValueError, match=names(key, value)) as info:
        s.amp_configs = {key: value}
    assert re.search(allowed, str(info.value)), str(info.value)
    assert s.amp_config == AmpConfig()  # a failed assignment changes nothing
    with pytest.raises(ValueError, match=names(key, value)):
        AmpConfig(**{key: value})


def test_huge_int_is_a_value_error_with_a_short_message():
    for key in ("init_loss_scaling", "incr_ratio", "incr_every_n_steps"):
        with pytest.raises(ValueError, match=re.escape(f"amp_configs[{key!r}]")) as info:
            DistributedStrategy().amp_configs = {key: 10**5000}
        assert len(str(info.value)) < 400


def test_accepted_values_are_normalised():
    s = DistributedStrategy()
    s.amp_configs = {
        "init_loss_scaling": 1024,
        "incr_every_n_steps": np.int64(7),
        "decr_ratio": fractions.Fraction(1, 4),
        "incr_ratio": np.float32(3.0),
        "custom_white_list": (WHITE_OP,),
        "custom_black_list": [BLACK_OP],
        "custom_black_varnames": ["head", "encoder.*.norm"],
        "dtype": torch.float16,
        "comm_dtype": torch.float32,
        "gradient_predivide_factor": 2,
    }
    cfg = s.amp_config
    assert type(cfg.init_loss_scaling) is float
    assert cfg.init_loss_scaling == 1024.0
    assert type(cfg.incr_every_n_steps) is int
    assert cfg.incr_every_n_steps == 7
    assert type(cfg.decr_ratio) is float
    assert cfg.decr_ratio == 0.25
    assert type(cfg.incr_ratio) is float
    assert cfg.incr_ratio == 3.0
    assert cfg.custom_white_list == (WHITE_OP,)
    assert cfg.custom_black_list == (BLACK_OP,)
    assert cfg.custom_black_varnames == ("head", "encoder.*.norm")
    assert cfg.dtype == "float16"
    assert cfg.comm_dtype == "float32"
    assert cfg.comm_torch_dtype is torch.float32
    assert type(cfg.gradient_predivide_factor) is float
    assert cfg.gradient_predivide_factor == 2.0
    assert s.amp_configs["custom_white_list"] == [WHITE_OP]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.amp_configs = {"dtype": torch.bfloat16}
    assert s.amp_config.dtype == "bfloat16"
    assert s.amp_config.torch_dtype is torch.bfloat16


def test_amp_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AmpConfig().dtype = "bfloat16"


# --------------------------------------------------------------------------- cross-key rules


def test_min_above_max_names_both_bounds():
    with pytest.raises(ValueError, match=r"min_loss_scaling'\] = 8\.0 is greater than .*max_loss_scaling'\] = 4\.0"):
        DistributedStrategy().amp_configs = {"min_loss_scaling": 8.0, "max_loss_scaling": 4.0, "init_loss_scaling": 4}


@pytest.mark.parametrize("init", [0.5, 2.0**25])
def test_dynamic_init_outside_bounds(init):
    with pytest.raises(ValueError, match=re.escape(f"amp_configs['init_loss_scaling'] = {init!r} is outside")):
        DistributedStrategy().amp_configs = {"init_loss_scaling": init}


def test_bounds_are_inclusive_and_static_scale_ignores_them():
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 2.0**24}
    s.amp_configs = {"init_loss_scaling": 4.0, "min_loss_scaling": 4.0, "max_loss_scaling": 4.0}
    s.amp_configs = {"init_loss_scaling": 0.5, "use_dynamic_loss_scaling": False}
    assert s.amp_config.init_loss_scaling == 0.5


def test_white_black_overlap_names_the_ops():
    with pytest.raises(ValueError, match=re.escape("both contain ['exp', 'matmul']; an op can be forced to only one")):
        DistributedStrategy().amp_configs = {
            "custom_white_list": [WHITE_OP, "exp", "linear"],
            "custom_black_list": ["exp", BLACK_OP, WHITE_OP],
        }


def test_op_names_are_canonical_and_aliases_count_in_overlaps():
    s = DistributedStrategy()
    s.amp_configs = {
        "custom_white_list": ["torch.matmul", "Tensor.__matmul__", "conv"],
        "custom_black_list": ["F.softmax"],
    }
    assert s.amp_config.custom_white_list == ("matmul", "matmul", "conv")
    assert s.amp_config.custom_black_list == ("softmax",)
    with pytest.raises(ValueError, match=re.escape("both contain ['conv2d']")):
        s.amp_configs = {"custom_white_list": ["conv"], "custom_black_list": ["conv2d"]}


@pytest.mark.parametrize("key", ["custom_white_list", "custom_black_list"])
def test_unknown_op_suggests_closest(key):
    with pytest.raises(ValueError, match=names(key, "matmull") + r".*Did you mean 'matmul'\?"):
        DistributedStrategy().amp_configs = {key: ["matmull"]}
    with pytest.raises(ValueError, match=names(key, "no_such_op_at_all") + r".*known_op_names\(\)"):
        DistributedStrategy().amp_configs = {key: ["no_such_op_at_all"]}


@pytest.mark.parametrize("typo", ["relu_x", "add__", "not_equal_x"])
def test_unknown_op_is_never_answered_with_an_in_place_name(typo):
    """The closest name must be one the list accepts: in-place ops ('not_equal_', 'relu_') are refused."""
    with pytest.raises(ValueError, match="not an op distamp knows") as caught:
        DistributedStrategy().amp_configs = {"custom_black_list": [typo]}
    suggested = re.search(r"Did you mean '([^']+)'\?", str(caught.value))
    assert suggested is not None
    DistributedStrategy().amp_configs = {"custom_black_list": [suggested.group(1)]}


def test_varnames_are_patterns_not_ops():
    s = DistributedStrategy()
    s.amp_configs = {"custom_black_varnames": ["matmull", "decoder.layers.0"]}
    assert s.amp_config.custom_black_varnames == ("matmull", "decoder.layers.0")


# --------------------------------------------------------------------------- keys and containers


def test_unknown_keys():
    s = DistributedStrategy()
    with pytest.raises(ValueError, match=r"no key 'incr_every_n_step'\. Did you mean 'incr_every_n_steps'\?"):
        s.amp_configs = {"incr_every_n_step": 10}
    with pytest.raises(ValueError, match=r"no key 'use_pure_bf16'\. distamp spells it dtype='bfloat16'"):
        s.amp_configs = {"use_pure_bf16": True}
    for key in (b"dtype", None, 1, ("dtype",)):
        with pytest.raises(ValueError, match=re.escape(f"amp_configs has no key {key!r}.")):
            s.amp_configs = {key: "float16"}
    with pytest.raises(ValueError, match=r"gradient_merge_configs has no key 'k_step'\. Did you mean 'k_steps'\?"):
        s.gradient_merge_configs = {"k_step": 2}


@pytest.mark.parametrize("value", [None, 5, 1.5, "k_steps", [("k_steps", 2)]])
def test_gradient_merge_configs_must_be_a_dict(value):
    with pytest.raises(
        ValueError, match=re.escape(f"gradient_merge_configs must be a dict of config keys; got {value!r}")
    ):
        DistributedStrategy().gradient_merge_configs = value


@pytest.mark.parametrize("value", [None, 5, "dtype", [("dtype", "float16")], GradientMergeConfig()])
def test_amp_configs_must_be_a_dict(value):
    with pytest.raises(ValueError, match=re.escape(f"amp_configs must be a dict of config keys; got {value!r}")):
        DistributedStrategy().amp_configs = value


def test_typed_config_can_be_assigned():
    s = DistributedStrategy()
    s.amp_configs = AmpConfig(incr_ratio=4.0)
    s.gradient_merge_configs = GradientMergeConfig(k_steps=3)
    assert s.amp_config.incr_ratio == 4.0
    assert s.gradient_merge_config.k_steps == 3


def test_assignment_replaces_never_merges_or_appends():
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024.0, "custom_black_list": [BLACK_OP], "custom_black_varnames": ["a"]}
    s.amp_configs = {"incr_ratio": 4.0, "custom_black_varnames": ["b"]}
    assert s.amp_configs["init_loss_scaling"] == 32768.0
    assert s.amp_configs["custom_black_list"] == []
    assert s.amp_configs["custom_black_varnames"] == ["b"]
    assert s.amp_configs["incr_ratio"] == 4.0
    s.gradient_merge_configs = {"k_steps": 4, "avg": False}
    s.gradient_merge_configs = {"k_steps": 2}
    assert s.gradient_merge_configs == {"k_steps": 2, "avg": True}


# --------------------------------------------------------------------------- read-only views


@pytest.mark.parametrize(
    "mutate",
    [
        lambda v: v.__setitem__("init_loss_scaling", 1.0),
        lambda v: v.__delitem__("init_loss_scaling"),
        lambda v: v.update(init_loss_scaling=1.0),
        lambda v: v.update({"init_loss_scaling": 1.0}),
        lambda v: v.pop("init_loss_scaling"),
        lambda v: v.popitem(),
        lambda v: v.setdefault("x", 1),
        lambda v: v.clear(),
        lambda v: v.__ior__({"init_loss_scaling": 1.0}),
        lambda v: v["custom_white_list"].append("matmul"),
        lambda v: v["custom_white_list"].extend(["matmul"]),
        lambda v: v["custom_white_list"].__iadd__(["matmul"]),
        lambda v: v["custom_black_varnames"].insert(0, "x"),
    ],
)
def test_amp_configs_view_refuses_mutation(mutate):
    s = DistributedStrategy()
    with pytest.raises(
        TypeError, match=r"read-only view .* assign a whole dict instead, e\.g\. strategy\.amp_configs = "
    ):
        mutate(s.amp_configs)
    assert s.amp_config == AmpConfig()


def test_gradient_merge_configs_view_refuses_mutation():
    s = DistributedStrategy()
    with pytest.raises(
        TypeError, match=r"strategy\.gradient_merge_configs = \{\*\*strategy\.gradient_merge_configs, 'k_steps'"
    ):
        s.gradient_merge_configs["k_steps"] = 4


def test_view_copies_are_editable_and_assignable():
    s = DistributedStrategy()
    s.amp_configs = {**s.amp_configs, "incr_ratio": 4.0}
    assert s.amp_config == AmpConfig(incr_ratio=4.0)
    edited = s.amp_configs.copy()
    edited["custom_black_list"].append(BLACK_OP)
    edited["decr_ratio"] = 0.25
    s.amp_configs = edited
    assert s.amp_config == AmpConfig(incr_ratio=4.0, decr_ratio=0.25, custom_black_list=(BLACK_OP,))
    for clone in (copy.deepcopy(s.amp_configs), copy.copy(s.amp_configs), pickle.loads(pickle.dumps(s.amp_configs))):
        assert type(clone) is dict
        assert clone == s.amp_configs
        clone["custom_black_list"].append(WHITE_OP)


# --------------------------------------------------------------------------- strategy attributes


@pytest.mark.parametrize("attr", ["amp", "gradient_merge", "find_unused_parameters"])
@pytest.mark.parametrize("value", [1, 0, "True", None, np.bool_(True)])
def test_bool_flags_reject_non_bools(attr, value):
    s = DistributedStrategy()
    with pytest.raises(ValueError, match=re.escape(f"strategy.{attr} must be a bool (True or False); got {value!r}")):
        setattr(s, attr, value)
    setattr(s, attr, True)
    assert getattr(s, attr) is True


@pytest.mark.parametrize("value", [0, -1, 0.0, math.nan, math.inf, True, "25", None, 2**20 + 1])
def test_fuse_grad_size_rejects(value):
    with pytest.raises(
        ValueError, match=re.escape(f"strategy.fuse_grad_size_in_MB must be a number in (0, 1048576]; got {value!r}")
    ):
        DistributedStrategy().fuse_grad_size_in_MB = value


def test_fuse_grad_size_accepts_numbers():
    s = DistributedStrategy()
    s.fuse_grad_size_in_MB = 0.5
    assert s.fuse_grad_size_in_MB == 0.5
    s.fuse_grad_size_in_MB = np.int32(100)
    assert s.fuse_grad_size_in_MB == 100
    assert type(s.fuse_grad_size_in_MB) is int


def test_unknown_attribute_lists_supported_ones():
    s = DistributedStrategy()
    with pytest.raises(ValueError, match=r"no attribute 'amp_config_s'\. Did you mean 'amp_configs'\?"):
        s.amp_config_s = {}
    with pytest.raises(
        ValueError, match=r"'recompute'.*supports only: amp, amp_configs, .*fuse_grad_size_in_MB\. Paddle Fleet"
    ):
        s.recompute = True
    with pytest.raises(ValueError, match=r"no attribute '_amp'"):
        s._amp = 3
    for name in ("amp_config", "gradient_merge_config"):
        with pytest.raises(ValueError, match=rf"{name} is read-only; assign a dict to {name}s"):
            setattr(s, name, {})
    assert s == DistributedStrategy()


def test_gradient_merge_config_validation():
    assert GradientMergeConfig() == GradientMergeConfig(k_steps=1, avg=True)
    for value in (0, -1, 1.5, True, "4", None, 2**63):
        with pytest.raises(ValueError, match=re.escape("gradient_merge_configs['k_steps'] must be an int >= 1")):
            DistributedStrategy().gradient_merge_configs = {"k_steps": value}
    for value in (1, "yes", None):
        with pytest.raises(
            ValueError, match=re.escape(f"gradient_merge_configs['avg'] must be a bool (True or False); got {value!r}")
        ):
            DistributedStrategy().gradient_merge_configs = {"avg": value}


# --------------------------------------------------------------------------- repr, dicts, equality


def test_repr_shows_only_what_differs():
    s = DistributedStrategy()
    assert repr(s) == "DistributedStrategy()"
    s.amp = True
    s.amp_configs = {"init_loss_scaling": 1024, "use_pure_fp16": True, "custom_black_list": [BLACK_OP]}
    s.gradient_merge_configs = {"k_steps": 4}
    s.fuse_grad_size_in_MB = 50
    assert repr(s) == (
        "DistributedStrategy(amp=True, amp_configs={'init_loss_scaling': 1024.0, "
        f"'custom_black_list': [{BLACK_OP!r}], 'use_pure_fp16': True}}, "
        "gradient_merge_configs={'k_steps': 4}, fuse_grad_size_in_MB=50)"
    )


def test_to_dict_from_dict_round_trip_through_json():
    s = DistributedStrategy(amp=True, gradient_merge=True, find_unused_parameters=True, fuse_grad_size_in_MB=12.5)
    s.amp_configs = {
        "init_loss_scaling": 256.0,
        "custom_white_list": [WHITE_OP],
        "custom_black_varnames": ["head"],
        "loss_scaling_algorithm": "lognormal",
        "comm_dtype": "float32",
        "gradient_predivide_factor": 2.0,
        "stuck_scale_patience": 5,
    }
    s.gradient_merge_configs = {"k_steps": 8, "avg": False}
    text = json.dumps(s.to_dict())
    back = DistributedStrategy.from_dict(json.loads(text))
    assert back == s
    assert back.to_dict() == s.to_dict()
    assert repr(back) == repr(s)
    assert back != DistributedStrategy()
    assert DistributedStrategy.from_dict({}) == DistributedStrategy()
    assert DistributedStrategy.from_dict({"amp": True}) == DistributedStrategy(amp=True)
    assert copy.deepcopy(s) == s
    assert pickle.loads(pickle.dumps(s)) == s
    assert s.__eq__(s.to_dict()) is NotImplemented


def test_from_dict_rejects_bad_input():
    with pytest.raises(ValueError, match=r"unknown key 'amp_config'\. Did you mean 'amp_configs'\?"):
        DistributedStrategy.from_dict({"amp_config": {}})
    with pytest.raises(ValueError, match=r"needs a dict of strategy attributes; got \['amp'\]"):
        DistributedStrategy.from_dict(["amp"])
    with pytest.raises(ValueError, match=names("dtype", "fp8")):
        DistributedStrategy.from_dict({"amp_configs": {"dtype": "fp8"}})


# --------------------------------------------------------------------------- BF16


def test_bf16_with_scaling_keys_warns_once_at_the_callers_line():
    s = DistributedStrategy()
    with pytest.warns(UserWarning, match="fixed at 1.0") as record:
        s.amp_configs = {"dtype": "bfloat16", "init_loss_scaling": 1024.0, "incr_ratio": 4.0, "use_pure_fp16": True}
    assert len(record) == 1
    message = str(record[0].message)
    assert "fixed at 1.0" in message
    assert "init_loss_scaling=1024.0" in message
    assert "incr_ratio=4.0" in message
    assert "use_pure_fp16" not in message
    assert record[0].filename == __file__



def test_bf16_with_overflow_retries_warns_that_they_never_happen():
    # Was: silent; a retry lowers the scale first, and BF16's fixed 1.0 cannot fall, so every overflowing
    # step(closure) was skipped (its batch dropped) without a retry or a word.
    s = DistributedStrategy()
    with pytest.warns(UserWarning, match=r"fixed at 1\.0 .* have no effect: overflow_retries=3\."):
        s.amp_configs = {"dtype": "bfloat16", "overflow_retries": 3}


def test_a_static_fp16_scale_with_overflow_retries_warns_that_they_never_happen():
    # Was: silent; every overflowing step(closure) was skipped without a retry.
    s = DistributedStrategy()
    with pytest.warns(UserWarning, match=r"overflow_retries=2 has no effect with use_dynamic_loss_scaling=False"):
        s.amp_configs = {"use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0, "overflow_retries": 2}

def test_a_static_fp16_scale_with_dynamic_settings_warns_that_they_have_no_effect():
    # Was: silent; a static scale reads none of the dynamic algorithm's settings.
    s = DistributedStrategy()
    with pytest.warns(UserWarning, match=r"use_dynamic_loss_scaling=False keeps") as record:
        s.amp_configs = {"use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0, "incr_ratio": 4.0,
                         "min_loss_scaling": 2.0, "loss_scaling_algorithm": "lognormal"}
    assert len(record) == 1
    assert str(record[0].message) == (
        "amp_configs: use_dynamic_loss_scaling=False keeps the loss scale at init_loss_scaling=8, so these "
        "settings of dynamic scaling have no effect: incr_ratio=4.0, loss_scaling_algorithm='lognormal', "
        "min_loss_scaling=2.0. Remove them, or set use_dynamic_loss_scaling=True."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.amp_configs = {"use_dynamic_loss_scaling": False, "init_loss_scaling": 8.0}


def test_lognormal_with_backoff_settings_warns_that_they_have_no_effect():
    # Was: silent; the log-normal scaler reads neither the backoff counters nor the ratios, so a
    # decr_every_n_nan_or_inf or decr_ratio set with it changed nothing without a word.
    s = DistributedStrategy()
    with pytest.warns(UserWarning, match=r"lognormal") as record:
        s.amp_configs = {"loss_scaling_algorithm": "lognormal", "decr_every_n_nan_or_inf": 1, "decr_ratio": 0.25,
                         "init_loss_scaling": 1024.0, "min_loss_scaling": 2.0}
    assert len(record) == 1
    message = str(record[0].message)
    assert "no effect: decr_every_n_nan_or_inf=1, decr_ratio=0.25." in message
    assert "init_loss_scaling" not in message
    assert "min_loss_scaling" not in message
    assert record[0].filename == __file__


def test_lognormal_alone_and_backoff_settings_with_a_static_or_bf16_scale_do_not_warn_of_lognormal():
    s = DistributedStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.amp_configs = {"loss_scaling_algorithm": "lognormal", "init_loss_scaling": 1024.0, "overflow_retries": 2}
        s.amp_configs = {"loss_scaling_algorithm": "backoff", "incr_ratio": 4.0}
    with pytest.warns(UserWarning, match=r"fixed at 1\.0") as record:  # BF16 names every key it ignores, once
        s.amp_configs = {"dtype": "bfloat16", "loss_scaling_algorithm": "lognormal", "incr_ratio": 4.0}
    assert len(record) == 1


def test_bf16_without_scaling_keys_and_fp16_do_not_warn():
    s = DistributedStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True, "comm_dtype": "float32"}
        s.amp_configs = {**s.amp_configs}  # every key present, all scaling keys at their defaults
        s.amp_configs = {"init_loss_scaling": 1024.0, "incr_ratio": 4.0}
        copy.deepcopy(s)


# --------------------------------------------------------------------------- fuzzing

AMP_KEYS = list(CONTRACT_DEFAULTS)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=2.0**26),
    st.text(max_size=12),
    st.binary(max_size=6),
    st.sampled_from(["float16", "bfloat16", "float32", "backoff", "lognormal", torch.float16, torch.bfloat16]),
    st.sampled_from([*sorted(known_op_names()), "matmull", ""]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner), st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=4,
)
_keys = st.one_of(
    st.sampled_from([*AMP_KEYS, "k_steps", "avg", "stage"]),
    st.text(max_size=20),
    st.none(),
    st.integers(),
    st.binary(max_size=4),
)


def _names_an_offending_key(message: str, config: dict) -> bool:
    return any((isinstance(k, str) and k in message) or repr(k) in message for k in config)


@settings(max_examples=200, deadline=None)
@given(config=st.one_of(st.dictionaries(_keys, _values, max_size=4), _values))
def test_fuzz_configs_accept_or_raise_value_error_naming_the_key(config):
    for attr in ("amp_configs", "gradient_merge_configs", "sharding_configs"):
        s = DistributedStrategy()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                setattr(s, attr, config)
        except ValueError as error:
            message = str(error)
            if isinstance(config, dict) and config:
                assert _names_an_offending_key(message, config), message
            else:
                assert attr in message, message
            continue
        # Accepted: the stored config is well-typed and survives a JSON round trip.
        assert isinstance(config, dict)
        plain = json.loads(json.dumps(s.to_dict(), allow_nan=False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert DistributedStrategy.from_dict(plain) == s
        assert set(config) <= set(getattr(s, attr))


@settings(max_examples=100, deadline=None)
@given(
    init=st.floats(min_value=1.0, max_value=2.0**24),
    incr=st.integers(min_value=1, max_value=10**6),
    ratio=st.floats(min_value=1.0, exclude_min=True, max_value=1e6),
    decr=st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True),
)
def test_fuzz_valid_numbers_are_accepted(init, incr, ratio, decr):
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": init, "incr_every_n_steps": incr, "incr_ratio": ratio, "decr_ratio": decr}
    assert s.amp_config.init_loss_scaling == init
    assert s.amp_config.incr_every_n_steps == incr


@settings(max_examples=200, deadline=None)
@given(
    amp=st.dictionaries(st.sampled_from(AMP_KEYS), _values, max_size=4),
    merge=st.dictionaries(st.sampled_from(["k_steps", "avg"]), _values, max_size=2),
)
def test_fuzz_known_keys_with_random_values(amp, merge):
    for attr, config in (("amp_configs", amp), ("gradient_merge_configs", merge)):
        s = DistributedStrategy()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                setattr(s, attr, config)
        except ValueError as error:
            assert _names_an_offending_key(str(error), config), str(error)
        else:
            defaults = AmpConfig().to_dict() if attr == "amp_configs" else GradientMergeConfig().to_dict()
            for key, value in getattr(s, attr).items():
                assert isinstance(value, type(defaults[key])) or value is None or defaults[key] is None


# --------------------------------------------------------------------------- sharding


def test_sharding_configs_defaults_round_trip_and_view():
    s = DistributedStrategy()
    assert s.sharding is False
    assert s.sharding_configs == {"stage": 1, "overlap_param_gather": False, "units": []}
    s.sharding = True
    s.sharding_configs = {"stage": 2}
    assert s.sharding_config == ShardingConfig(stage=2)
    assert s.sharding_config.stage == 2
    assert repr(s) == "DistributedStrategy(sharding=True, sharding_configs={'stage': 2})"
    assert repr(ShardingConfig(stage=2)) == "ShardingConfig(stage=2, overlap_param_gather=False, units=())"
    assert ShardingConfig.from_dict({"stage": 2}).to_dict() == {"stage": 2, "overlap_param_gather": False,
                                                                "units": []}
    back = DistributedStrategy.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    assert copy.deepcopy(s) == s
    assert pickle.loads(pickle.dumps(s)) == s
    with pytest.raises(TypeError, match=re.escape("strategy.sharding_configs = {**strategy.sharding_configs, 'stage'")):
        s.sharding_configs["stage"] = 1
    with pytest.raises(ValueError, match=r"sharding_config is read-only; assign a dict to sharding_configs"):
        s.sharding_config = ShardingConfig()
    s.sharding_configs = {"overlap_param_gather": True}
    assert s.sharding_configs == {"stage": 1, "overlap_param_gather": True, "units": []}  # replaces: stage is 1 again
    assert repr(s) == "DistributedStrategy(sharding=True, sharding_configs={'overlap_param_gather': True})"
    s.sharding_configs = {}
    assert s.sharding_configs == {"stage": 1, "overlap_param_gather": False, "units": []}
    s.sharding_configs = {"stage": 3, "units": ("blocks.*",)}
    assert s.sharding_configs == {"stage": 3, "overlap_param_gather": False, "units": ["blocks.*"]}
    assert repr(s) == "DistributedStrategy(sharding=True, sharding_configs={'stage': 3, 'units': ['blocks.*']})"
    assert DistributedStrategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_sharding_configs_typo_suggests_stage():
    with pytest.raises(
        ValueError, match=r"sharding_configs has no key 'stag'\. Did you mean 'stage'\? Valid keys: stage, "
        r"overlap_param_gather, units\."
    ):
        DistributedStrategy().sharding_configs = {"stag": 1}
    with pytest.raises(ValueError, match=r"Did you mean 'overlap_param_gather'\?"):
        DistributedStrategy().sharding_configs = {"overlap_params_gather": True}


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_overlap_param_gather_must_be_a_bool(value):
    with pytest.raises(ValueError, match=re.escape(
            f"sharding_configs['overlap_param_gather'] must be a bool (True or False); got {value!r}.")):
        DistributedStrategy().sharding_configs = {"overlap_param_gather": value}


@pytest.mark.parametrize("value", [4, 0, True, "1", 1.0, None])
def test_sharding_stage_must_be_1_2_or_3(value):
    with pytest.raises(ValueError, match=re.escape(
            f"sharding_configs['stage'] must be one of 1, 2, 3; got {value!r}.")):
        DistributedStrategy().sharding_configs = {"stage": value}


def test_stage_3_refuses_overlap_param_gather_and_other_stages_refuse_units():
    with pytest.raises(ValueError, match=re.escape(
            "sharding_configs['overlap_param_gather'] must be False with stage 3; got True. It overlaps the "
            "all-gather of stages 1 and 2")):
        DistributedStrategy().sharding_configs = {"stage": 3, "overlap_param_gather": True}
    with pytest.raises(ValueError, match=re.escape(
            "sharding_configs['units'] must be empty unless stage is 3; got ['blocks.*'].")):
        DistributedStrategy().sharding_configs = {"stage": 2, "units": ["blocks.*"]}
    with pytest.raises(ValueError, match=re.escape(
            "sharding_configs['units'] must be a list of module-name patterns (non-empty strings); got 'blocks'. "
            "Wrap a single name in a list: ['blocks'].")):
        DistributedStrategy().sharding_configs = {"stage": 3, "units": "blocks"}
    with pytest.raises(ValueError, match=re.escape("whose item '' is not a non-empty string")):
        DistributedStrategy().sharding_configs = {"stage": 3, "units": [""]}


def test_sharding_flag_must_be_a_bool():
    with pytest.raises(ValueError, match=re.escape("strategy.sharding must be a bool (True or False); got 1.")):
        DistributedStrategy().sharding = 1


# --------------------------------------------------------------------------- check_replicas_every


def test_check_replicas_every_defaults_to_off_and_round_trips():
    s = DistributedStrategy()
    assert s.check_replicas_every == 0
    assert s.to_dict()["check_replicas_every"] == 0
    s.check_replicas_every = np.int64(100)
    assert s.check_replicas_every == 100
    assert type(s.check_replicas_every) is int
    assert repr(s) == "DistributedStrategy(check_replicas_every=100)"
    back = DistributedStrategy.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    assert back != DistributedStrategy()
    assert DistributedStrategy(check_replicas_every=7).check_replicas_every == 7
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.parametrize("value", [-1, True, False, 1.0, 2.5, "10", None, math.nan, 2**63])
def test_check_replicas_every_rejects(value):
    s = DistributedStrategy(check_replicas_every=3)
    with pytest.raises(ValueError, match=re.escape(
            f"strategy.check_replicas_every must be an int >= 0 (at most 2**63 - 1); got {value!r}.")):
        s.check_replicas_every = value
    assert s.check_replicas_every == 3  # a refused value changes nothing
    with pytest.raises(ValueError, match=re.escape("strategy.check_replicas_every must be an int >= 0")):
        DistributedStrategy.from_dict({"check_replicas_every": value})
