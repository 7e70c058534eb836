"""Fuzzing what users type: strategy attributes, ``from_dict`` and the distrun command line.

tests/test_strategy.py already throws random dicts at ``amp_configs`` and
``gradient_merge_configs``, and tests/launcher/test_fuzz_cli.py random word
lists at ``parse_plan``. This file adds:

- random attribute names and values on ``DistributedStrategy`` (``setattr``
  and constructor keywords), and random nested dicts for ``from_dict``;
- valid strategies generated from the documented ranges, which must be
  accepted and survive ``to_dict`` -> JSON -> ``from_dict`` unchanged;
- the distrun command line from a grammar (``--flag value`` and
  ``--flag=value``, any order, script arguments that look like flags) with
  at most one invalid item: valid lines must parse into exactly the plan
  they describe, with the script's arguments untouched; a line with an
  invalid item must be refused with a ``UsageError`` (a ``ValueError``)
  naming that item, and ``main`` must return 2 with that message on stderr
  without starting anything.

No other exception is ever allowed.
"""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from distamp.launcher.cli import main, parse_plan
from distamp.launcher.plan import LaunchPlan, UsageError
from distamp.strategy import AmpConfig, DistributedStrategy, GradientMergeConfig
from distamp.torch_compat import grace_period_supported

ATTRS = ["amp", "amp_configs", "gradient_merge", "gradient_merge_configs", "sharding", "sharding_configs",
         "find_unused_parameters", "fuse_grad_size_in_MB", "check_replicas_every"]
PADDLE_ONLY = ["recompute", "pipeline", "dgc", "lars", "a_sync", "amp_config", "gradient_merge_config",
               "sharding_config"]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=1e-3, max_value=2.0**21),
    st.text(max_size=10),
    st.sampled_from(["float16", "bfloat16", "backoff", "lognormal", "matmul", torch.float16, b"x", 1j]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(
            st.one_of(st.sampled_from(["k_steps", "avg", "dtype", "init_loss_scaling"]), st.text(max_size=6)),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=5,
)
_attr_names = st.one_of(
    st.sampled_from(ATTRS + PADDLE_ONLY), st.from_regex(r"[a-z_][a-zA-Z0-9_]{0,20}", fullmatch=True)
)


def _keys_of(value) -> list:
    """Every dict key in ``value``, at any depth."""
    if isinstance(value, dict):
        return [k for k, v in value.items() for k in [k, *_keys_of(v)]]
    if isinstance(value, (list, tuple)):
        return [k for item in value for k in _keys_of(item)]
    return []


def _names_one_of(message: str, candidates) -> bool:
    """Whether ``message`` names one of ``candidates`` as a setting, not merely contains its letters.

    A key counts as named where the message spells it as a setting (``strategy.amp``,
    ``amp_configs['dtype']``) or quotes it (``'dtyp'``, ``key 5``): a random one-letter key
    such as ``'a'`` is in nearly every message as a letter, rarely as a setting.
    """
    for c in candidates:
        if isinstance(c, str) and c:
            key = re.escape(c)
            as_setting = rf"(?:^|[\s(])(?:DistributedStrategy\.|strategy\.)?{key}(?:\[| must\b| is\b|=|[\s.,;:]|$)"
            if re.search(as_setting, message) and (len(c) > 1 or re.search(rf"(?:strategy\.|^){key}\b", message)):
                return True
            if f"[{c!r}]" in message:
                return True
            if repr(c) in message:
                return True
        else:
            try:
                shown = repr(c)
            except ValueError:  # huge ints
                continue
            if re.search(rf"\bkey {re.escape(shown)}(?!\w|\.\d)", message):
                return True
    return False


def _assert_well_formed(strategy: DistributedStrategy) -> None:
    """An accepted strategy is typed, JSON-clean and round-trips through from_dict."""
    assert isinstance(strategy.amp, bool)
    assert isinstance(strategy.gradient_merge, bool)
    assert isinstance(strategy.sharding, bool)
    assert strategy.sharding_config.stage in (1, 2, 3)
    assert isinstance(strategy.find_unused_parameters, bool)
    assert strategy.fuse_grad_size_in_MB > 0
    assert math.isfinite(strategy.fuse_grad_size_in_MB)
    assert type(strategy.check_replicas_every) is int
    assert strategy.check_replicas_every >= 0
    assert isinstance(strategy.amp_config, AmpConfig)
    assert isinstance(strategy.gradient_merge_config, GradientMergeConfig)
    plain = json.loads(json.dumps(strategy.to_dict(), allow_nan=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert DistributedStrategy.from_dict(plain) == strategy


# --------------------------------------------------------------------------- strategy attributes


@settings(max_examples=250, deadline=None)
@given(assignments=st.lists(st.tuples(_attr_names, _values), min_size=1, max_size=4))
def test_random_attribute_assignments_are_accepted_or_name_the_attribute(assignments):
    strategy = DistributedStrategy()
    for name, value in assignments:
        before = strategy.to_dict()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                setattr(strategy, name, value)
        except ValueError as error:
            assert name in str(error), (name, value, str(error))
            assert strategy.to_dict() == before  # a refused assignment changes nothing
        else:
            assert name in ATTRS
    _assert_well_formed(strategy)


@settings(max_examples=200, deadline=None)
@given(kwargs=st.dictionaries(_attr_names, _values, max_size=4))
def test_random_constructor_keywords_are_accepted_or_name_the_attribute(kwargs):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = DistributedStrategy(**kwargs)
    except ValueError as error:
        assert _names_one_of(str(error), [*kwargs, *_keys_of(kwargs)]), (kwargs, str(error))
        return
    assert set(kwargs) <= set(ATTRS)
    _assert_well_formed(strategy)


@settings(max_examples=250, deadline=None)
@given(data=st.one_of(
    st.dictionaries(st.one_of(_attr_names, st.integers(), st.none()), _values, max_size=4),
    st.fixed_dictionaries({}, optional={
        "amp": _values,
        "amp_configs": st.dictionaries(st.sampled_from(list(AmpConfig().to_dict())), _values, max_size=3),
        "gradient_merge_configs": st.dictionaries(st.sampled_from(["k_steps", "avg", "k_step"]), _values, max_size=2),
        "sharding_configs": st.dictionaries(st.sampled_from(["stage", "stag", "units"]), _values, max_size=2),
        "fuse_grad_size_in_MB": _values,
    }),
    _values,
))
def test_from_dict_accepts_or_names_the_offending_key(data):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            strategy = DistributedStrategy.from_dict(data)
    except ValueError as error:
        message = str(error)
        if isinstance(data, dict) and data:
            assert _names_one_of(message, [*data, *_keys_of(data)]), (data, message)
        else:
            assert "from_dict" in message or "configs" in message, (data, message)
        return
    assert isinstance(data, dict)
    _assert_well_formed(strategy)


# Disjoint samples of real op names, as a user would write them.
WHITE_OPS = ("matmul", "linear", "conv", "bmm", "scaled_dot_product_attention", "einsum")
BLACK_OPS = ("softmax", "gelu", "layer_norm", "cross_entropy", "exp", "sum")


def _op_names(ops):
    return st.lists(st.sampled_from(sorted(ops)), max_size=3, unique=True)


@st.composite
def valid_amp_configs(draw) -> dict:
    low = draw(st.floats(min_value=1.0, max_value=2.0**10))
    high = draw(st.floats(min_value=2.0**10, max_value=2.0**24))
    config = {
        "init_loss_scaling": draw(st.floats(min_value=low, max_value=high)),
        "use_dynamic_loss_scaling": draw(st.booleans()),
        "incr_every_n_steps": draw(st.integers(1, 10**6)),
        "decr_every_n_nan_or_inf": draw(st.integers(1, 100)),
        "incr_ratio": draw(st.floats(min_value=1.0, max_value=16.0, exclude_min=True)),
        "decr_ratio": draw(st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True)),
        "custom_white_list": draw(_op_names(WHITE_OPS)),
        "custom_black_list": draw(_op_names(BLACK_OPS)),
        "custom_black_varnames": draw(st.lists(st.sampled_from(["head", "classifier.*", "norm"]), max_size=2)),
        "use_pure_fp16": draw(st.booleans()),
        "dtype": draw(st.sampled_from(["float16", "bfloat16"])),
        "loss_scaling_algorithm": draw(st.sampled_from(["backoff", "lognormal"])),
        "min_loss_scaling": low,
        "max_loss_scaling": high,
        "comm_dtype": draw(st.sampled_from([None, "float16", "bfloat16", "float32"])),
        "gradient_predivide_factor": draw(st.one_of(st.none(), st.floats(min_value=1.0, max_value=64.0))),
        "stuck_scale_patience": draw(st.integers(1, 1000)),
    }
    keys = set(draw(st.lists(st.sampled_from(sorted(config)), unique=True)))
    bounds = {"init_loss_scaling", "min_loss_scaling", "max_loss_scaling"}
    if keys & bounds:  # the defaults (32768 in [1, 2**24]) only fit together
        keys |= bounds
    return {k: config[k] for k in sorted(keys)}


@settings(max_examples=200, deadline=None)
@given(
    amp=st.booleans(), amp_configs=valid_amp_configs(), merge=st.booleans(),
    k_steps=st.integers(1, 2**20), avg=st.booleans(), unused=st.booleans(),
    bucket=st.one_of(st.integers(1, 2**20), st.floats(min_value=1e-6, max_value=2.0**20)),
)
def test_valid_strategies_are_accepted_and_round_trip(amp, amp_configs, merge, k_steps, avg, unused, bucket):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy = DistributedStrategy(
            amp=amp, amp_configs=amp_configs, gradient_merge=merge,
            gradient_merge_configs={"k_steps": k_steps, "avg": avg},
            find_unused_parameters=unused, fuse_grad_size_in_MB=bucket,
        )
    for key, value in amp_configs.items():
        assert strategy.amp_configs[key] == value, key
    assert strategy.gradient_merge_config == GradientMergeConfig(k_steps=k_steps, avg=avg)
    _assert_well_formed(strategy)


# --------------------------------------------------------------------------- distrun command line


@st.composite
def command_lines(draw):
    """(argv, expected plan fields or None, token the error must name or None)."""
    nproc = draw(st.integers(1, 8))
    nnodes, node_rank = draw(st.sampled_from([(1, 0), (2, 0), (2, 1), (3, 2)]))
    world = nproc * nnodes
    tee_ranks = draw(st.lists(st.integers(0, world - 1), max_size=3, unique=True))
    tee_text = draw(st.sampled_from(["all", "none", ",".join(map(str, tee_ranks)) or "none"]))
    tee = {"all": None, "none": frozenset()}.get(tee_text, frozenset(tee_ranks))
    valid = {
        "--nproc_per_node": (str(nproc), ("nproc_per_node", nproc)),
        "--max_restarts": (str(draw(st.integers(0, 5))), None),
        # torch 2.11's agent always waits 30 s: distrun refuses any other grace period there.
        "--grace_period": (str(draw(st.integers(1, 60)) if grace_period_supported() else 30), None),
        "--tee": (tee_text, ("tee", tee)),
        "--log_dir": (draw(st.sampled_from(["log", "out/logs", "./x"])), None),
    }
    if nnodes > 1:
        valid["--nnodes"] = (str(nnodes), ("nnodes", nnodes))
        valid["--node_rank"] = (str(node_rank), ("node_rank", node_rank))
        valid["--master"] = ("127.0.0.1:29500", ("master_port", 29500))
    chosen = draw(st.lists(st.sampled_from(sorted(valid)), unique=True))
    if "--tee" in chosen and "--nproc_per_node" not in chosen:
        chosen.append("--nproc_per_node")  # the expected tee was computed for this world size
    if "--nnodes" in valid:
        chosen += [f for f in ("--nnodes", "--node_rank", "--master") if f not in chosen]
    items = [(flag, valid[flag][0]) for flag in chosen]
    invalid = {
        "--nproc_per_node": ["0", "-2", "two", "1.5", ""],
        "--nnodes": ["0", "x"],
        "--node_rank": [str(nnodes), "-1", "r"],
        "--master": ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "bad host:1", ":1"],
        # Several nodes may run different worker counts: their --tee ranks are checked after the rendezvous.
        "--tee": [str(world), "x", "0,,1"] if nnodes == 1 else ["x", "0,,1"],
        "--max_restarts": ["-1", "many"],
        "--grace_period": ["0", "-5"],
        "--gpus": ["0", "0,1", "a"],
        "--log_dir": [""],
    }
    bad = draw(st.sampled_from([None, None, None, "missing.py", "--bogus", "--nproc", "--gpu", *sorted(invalid)]))
    token = None
    if bad == "missing.py":
        token = bad
    elif bad in invalid:
        items = [(f, v) for f, v in items if f != bad]
        items.append((bad, draw(st.sampled_from(invalid[bad]))))
        token = bad
    elif bad is not None:
        items.append((bad, "1"))
        token = bad
    order = draw(st.permutations(items))
    argv = []
    for flag, value in order:
        argv += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    script_args = draw(
        st.lists(st.sampled_from(["--lr", "0.1", "-m", "--nproc_per_node", "7", "--tee=x", "$x", "--"]), max_size=4)
    )
    if bad == "missing.py":
        argv += ["missing.py", *script_args]
    else:
        argv += ["train.py", *script_args]
    expected = None
    if token is None:
        expected = dict(v[1] for f, v in valid.items() if f in chosen and v[1] is not None)
        expected["command"] = ("train.py", *script_args)
    return argv, expected, token


@pytest.mark.timeout(120)
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=command_lines())
def test_distrun_command_line_grammar(case, tmp_path_factory, monkeypatch, capsys):
    argv, expected, token = case
    event("accepted" if token is None else f"refused: {token}")
    base = tmp_path_factory.getbasetemp()
    monkeypatch.chdir(base)
    (base / "train.py").write_text("")
    if expected is not None:
        plan = parse_plan(argv)
        assert isinstance(plan, LaunchPlan)
        for field, value in expected.items():
            assert getattr(plan, field) == value, (argv, field)
        return
    with pytest.raises(UsageError) as info:
        parse_plan(argv)
    assert isinstance(info.value, ValueError)
    assert token in str(info.value), (argv, str(info.value))
    capsys.readouterr()
    assert main(argv) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert err.startswith("distrun: error: ")
    assert token in err
    assert "Traceback" not in err


def test_a_double_dash_right_after_the_script_reaches_the_script(tmp_path, monkeypatch):
    """Found by the grammar above: argparse.REMAINDER used to drop this '--'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert parse_plan(["train.py", "--", "--lr", "1"]).command == ("train.py", "--", "--lr", "1")
