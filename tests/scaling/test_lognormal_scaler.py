"""LogNormalLossScaler: bias-corrected log2 statistics of grad_max, the scale they give, censored overflows."""

from __future__ import annotations

import math
import random

import pytest
import torch

from distamp.scaling.lognormal_scaler import LogNormalLossScaler


def F32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def _reference_stats(xs, beta1, beta2):
    """Bias-corrected EMAs written out as weighted sums (independent of the class's recurrences)."""
    n = len(xs)
    w1 = [(1 - beta1) * beta1 ** (n - 1 - i) for i in range(n)]
    w2 = [(1 - beta2) * beta2 ** (n - 1 - i) for i in range(n)]
    mu = sum(w * x for w, x in zip(w1, xs, strict=True)) / (1 - beta1**n)
    slow = sum(w * x for w, x in zip(w2, xs, strict=True)) / (1 - beta2**n)
    sq = sum(w * x * x for w, x in zip(w2, xs, strict=True)) / (1 - beta2**n)
    return mu, math.sqrt(max(sq - slow * slow, 0.0))


def test_one_observation_sets_the_scale_to_max_over_grad_max():
    s = LogNormalLossScaler(32768.0, min_scale=1.0, max_scale=2.0**24)
    assert s.needs_grad_max
    s.update(False, grad_max=0.01)
    mu, sigma = s.log2_stats()
    assert mu == pytest.approx(math.log2(0.01), abs=1e-12)
    assert sigma == pytest.approx(0.0, abs=1e-6)
    assert s.scale == pytest.approx(65504 / 0.01, rel=1e-5)
    assert s.scale == F32(s.scale)


def test_statistics_and_scale_follow_the_reference_over_a_random_run():
    rng = random.Random(0)
    s = LogNormalLossScaler(1.0, min_scale=2.0**-20, max_scale=2.0**40, beta1=0.9, beta2=0.95,
                            overflow_std_dev=2.0, max_representable=65504.0)
    xs = []
    for _ in range(40):
        g = 2.0 ** rng.uniform(-12, -4)
        s.update(False, grad_max=g)
        xs.append(math.log2(g))
    mu, sigma = s.log2_stats()
    ref_mu, ref_sigma = _reference_stats(xs, 0.9, 0.95)
    assert mu == pytest.approx(ref_mu, rel=1e-12)
    assert sigma == pytest.approx(ref_sigma, rel=1e-9)
    assert s.num_observations == 40
    assert s.scale == F32(2.0 ** (math.log2(65504.0) - (mu + 2.0 * sigma)))


def test_all_zero_gradients_carry_no_information():
    s = LogNormalLossScaler(8.0, min_scale=1.0, max_scale=2.0**24)
    before = s.state_dict()
    s.update(False, grad_max=0.0)
    assert s.state_dict() == before


def test_an_overflow_is_a_censored_observation_one_binade_up_and_at_least_halves():
    s = LogNormalLossScaler(32768.0, min_scale=1.0, max_scale=2.0**24)
    s.update(True)
    assert s.num_observations == 1
    mu, _ = s.log2_stats()
    assert mu == pytest.approx(math.log2(65504.0 / 32768.0) + 1.0)
    assert s.scale <= 16384.0
    previous = s.scale
    for _ in range(40):
        s.update(True)
        assert s.scale < previous or s.scale == 1.0
        previous = s.scale
    assert s.scale == 1.0
    assert not s.can_decrease
    assert not s.decrease_now()


def test_decrease_now_halves_and_keeps_the_statistics():
    s = LogNormalLossScaler(1024.0, min_scale=1.0, max_scale=2.0**24)
    s.update(False, grad_max=1.0)
    stats = s.state_dict()
    assert s.decrease_now()
    assert s.scale == stats["scale"] / 2
    assert s.num_observations == 1
    assert {k: v for k, v in s.state_dict().items() if k != "scale"} == {k: v for k, v in stats.items() if k != "scale"}


def test_bounds_clamp_and_max_scale_beyond_float32_is_capped():
    s = LogNormalLossScaler(1.0, min_scale=1.0, max_scale=1e300)
    s.update(False, grad_max=2.0**-200)  # wants 2**216: clamped in log space, capped at float32's max
    assert s.scale == torch.finfo(torch.float32).max
    low = LogNormalLossScaler(4.0, min_scale=2.0, max_scale=8.0)
    low.update(False, grad_max=1e30)
    assert low.scale == 2.0


def test_log2_stats_before_any_observation_raises():
    with pytest.raises(RuntimeError, match=r"^log2_stats\(\) needs at least one update\(\) with an observation\.$"):
        LogNormalLossScaler(1.0, min_scale=1.0, max_scale=2.0).log2_stats()


def test_grad_max_is_required_on_finite_steps():
    with pytest.raises(ValueError, match="grad_max is required on finite steps"):
        LogNormalLossScaler(1.0, min_scale=1.0, max_scale=2.0).update(False)


@pytest.mark.parametrize(("kw", "match"), [
    ({"beta1": 1.0}, r"^beta1 must be a number in \[0, 1\), got 1.0\.$"),
    ({"beta2": -0.1}, r"^beta2 must be a number in \[0, 1\), got -0.1\.$"),
    ({"overflow_std_dev": -1}, r"^overflow_std_dev must be a finite number >= 0, got -1\.$"),
    ({"max_representable": float("inf")}, r"^max_representable must be a finite number > 0, got inf\.$"),
    ({"init_scale": 0.5}, r"^init_scale must lie within \[min_scale, max_scale\] = \[1.0, 2.0\]"),
])
def test_bad_arguments(kw, match):
    args = {"init_scale": 1.0, "min_scale": 1.0, "max_scale": 2.0, **kw}
    with pytest.raises(ValueError, match=match):
        LogNormalLossScaler(**args)


def test_state_dict_round_trip_and_non_finite_averages_refused():
    s = LogNormalLossScaler(64.0, min_scale=1.0, max_scale=2.0**24)
    for g in (0.5, 0.25, 2.0):
        s.update(False, grad_max=g)
    t = LogNormalLossScaler(1.0, min_scale=1.0, max_scale=2.0**24)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    s.update(False, grad_max=0.125)
    t.update(False, grad_max=0.125)
    assert t.state_dict() == s.state_dict()
    bad = {**s.state_dict(), "sq_ema": float("nan")}
    with pytest.raises(ValueError, match=r"^state_dict\['sq_ema'\] must be finite, got nan\.$"):
        t.load_state_dict(bad)
