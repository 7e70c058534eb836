"""BackoffLossScaler: Paddle's update_loss_scaling; with decr_every_n_nan_or_inf=1 exactly torch's GradScaler update."""

from __future__ import annotations

import random

import pytest
import torch

from distamp.scaling.backoff_scaler import BackoffLossScaler

FLOAT32_MAX = torch.finfo(torch.float32).max


def _scaler(**kw):
    args = {"init_scale": 32768.0, "incr_every_n_steps": 3, "decr_every_n_nan_or_inf": 2, "incr_ratio": 2.0,
            "decr_ratio": 0.5, "min_scale": 1.0, "max_scale": 2.0**24}
    args.update(kw)
    return BackoffLossScaler(**args)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("init", "growth", "backoff", "interval"),
                         [(65536.0, 2.0, 0.5, 2), (3.0e38, 2.0, 0.5, 1), (1000.0, 3.0, 0.3, 3)])
def test_matches_torch_amp_update_scale_bitwise(seed, init, growth, backoff, interval):
    """The kernel torch.amp.GradScaler.update runs, step by step, including the no-overflow-to-inf rule."""
    rng = random.Random(seed)
    ours = BackoffLossScaler(init, incr_every_n_steps=interval, decr_every_n_nan_or_inf=1, incr_ratio=growth,
                             decr_ratio=backoff, min_scale=1e-30, max_scale=1e300)
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for _ in range(60):
        found = rng.random() < 0.3
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(found)), growth, backoff, interval)
        ours.update(found)
        assert ours.scale == scale.item()
        assert ours.num_good_steps == tracker.item()


def test_torch_grad_scaler_defaults_agree():
    ref = torch.amp.GradScaler("cpu")
    ours = BackoffLossScaler(ref.get_scale(), ref.get_growth_interval(), 1, ref.get_growth_factor(),
                             ref.get_backoff_factor(), 1.0, 2.0**100)
    assert ours.scale == 65536.0


def test_counters_are_consecutive_and_paddle_semantics():
    s = _scaler()
    s.update(True)
    assert (s.scale, s.num_good_steps, s.num_bad_steps) == (32768.0, 0, 1)
    s.update(False)  # a finite step resets the bad counter
    assert (s.num_good_steps, s.num_bad_steps) == (1, 0)
    s.update(True)
    s.update(True)
    assert (s.scale, s.num_good_steps, s.num_bad_steps) == (16384.0, 0, 0)
    for _ in range(3):
        s.update(False)
    assert (s.scale, s.num_good_steps) == (32768.0, 0)


def test_bounds_bind():
    s = _scaler(init_scale=2.0**24, incr_every_n_steps=1)
    s.update(False)
    assert s.scale == 2.0**24
    low = _scaler(init_scale=1.5, decr_every_n_nan_or_inf=1)
    low.update(True)
    assert low.scale == 1.0
    assert not low.can_decrease
    assert not low.decrease_now()
    low.update(True)
    assert low.scale == 1.0


def test_growth_that_would_be_inf_in_float32_keeps_the_old_scale():
    s = _scaler(init_scale=3.0e38, max_scale=1e300, incr_every_n_steps=1)
    s.update(False)
    assert s.scale == torch.tensor(3.0e38).item()
    assert s.num_good_steps == 0


def test_decrease_now_restarts_both_counters():
    s = _scaler()
    s.update(False)
    s.update(True)
    assert s.can_decrease
    assert s.decrease_now()
    assert (s.scale, s.num_good_steps, s.num_bad_steps) == (16384.0, 0, 0)


def test_scale_is_rounded_to_float32():
    s = _scaler(init_scale=0.1, min_scale=0.01, decr_ratio=0.3, decr_every_n_nan_or_inf=1)
    assert s.scale == torch.tensor(0.1).item() != 0.1
    s.update(True)
    assert s.scale == torch.tensor(torch.tensor(0.1).item() * 0.3).item()


def test_state_dict_round_trip_and_loading_larger_counters():
    s = _scaler()
    s.update(False)
    s.update(False)
    state = s.state_dict()
    assert state == {"scale": 32768.0, "num_good_steps": 2, "num_bad_steps": 0}
    t = _scaler(init_scale=2.0)
    t.load_state_dict(state)
    assert t.state_dict() == state
    t.load_state_dict({"scale": 8.0, "num_good_steps": 10, "num_bad_steps": 0})  # saved with a larger interval
    t.update(False)
    assert (t.scale, t.num_good_steps) == (16.0, 0)


@pytest.mark.parametrize(("state", "error", "match"), [
    ({"scale": 1.0}, ValueError, (r"BackoffLossScaler.load_state_dict: missing keys \['num_bad_steps', "
                                  r"'num_good_steps'\], unknown keys \[\]")),
    ({"scale": 1.0, "num_good_steps": -1, "num_bad_steps": 0}, ValueError,
     r"state_dict\['num_good_steps'\] must be an int >= 0, got -1\."),
    ({"scale": 0.0, "num_good_steps": 0, "num_bad_steps": 0}, ValueError,
     r"state_dict\['scale'\] must be a finite number > 0, got 0.0\."),
])
def test_bad_state_is_refused(state, error, match):
    with pytest.raises(error, match=match):
        _scaler().load_state_dict(state)


@pytest.mark.parametrize(("kw", "match"), [
    ({"init_scale": 0.0}, r"init_scale must be a finite number > 0, got 0.0\."),
    ({"incr_every_n_steps": 0}, r"incr_every_n_steps must be an int >= 1, got 0\."),
    ({"decr_every_n_nan_or_inf": 1.5}, r"decr_every_n_nan_or_inf must be an int >= 1, got 1.5\."),
    ({"incr_ratio": 1.0}, r"incr_ratio must be a number in \(1.0, inf\), got 1.0\."),
    ({"decr_ratio": 1.0}, r"decr_ratio must be a number in \(0.0, 1.0\), got 1.0\."),
    ({"min_scale": 4.0, "max_scale": 2.0}, r"max_scale must be a finite number >= min_scale \(4.0\), got 2.0\."),
    ({"init_scale": 2.0**30}, r"init_scale must lie within \[min_scale, max_scale\] = \[1.0, 16777216.0\]"),
])
def test_bad_arguments_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        _scaler(**kw)


def test_repr():
    assert repr(_scaler()) == (
        "BackoffLossScaler(scale=32768.0, num_good_steps=0, num_bad_steps=0, incr_every_n_steps=3, "
        "decr_every_n_nan_or_inf=2, incr_ratio=2.0, decr_ratio=0.5, min_scale=1.0, max_scale=16777216.0)")
