"""Loss scalers: step-by-step traces with exact expected values, torch parity,
an independent log-normal reference, checkpoints and argument validation."""

import io
import math
import types

import numpy as np
import pytest
import torch

from distamp.scaling.loss_scaler import (
    BackoffLossScaler,
    LogNormalLossScaler,
    LossScaler,
    StaticLossScaler,
    UnitLossScaler,
    build_loss_scaler,
)
from distamp.strategy import AmpConfig

F32_MAX = float(np.finfo(np.float32).max)


def f32(x):
    """float32 rounding done by numpy, independently of the module's own."""
    return float(np.float32(x))


def backoff(**overrides):
    kwargs = {
        "init_scale": 8.0,
        "incr_every_n_steps": 3,
        "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
    }
    kwargs.update(overrides)
    return BackoffLossScaler(**kwargs)


def lognormal(**overrides):
    kwargs = {"init_scale": 32768.0, "min_scale": 1.0, "max_scale": 2.0**24}
    kwargs.update(overrides)
    return LogNormalLossScaler(**kwargs)


def roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint would go."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---------------------------------------------------------------- backoff traces
# Each row: (found_inf, scale, num_good_steps, num_bad_steps) *after* the update.
# "I" = a non-finite step, "F" = a finite step.
I, F = True, False

BACKOFF_TRACES = {
    "grows_after_n_consecutive_finite": (
        {},
        [(F, 8, 1, 0), (F, 8, 2, 0), (F, 16, 0, 0), (F, 16, 1, 0), (F, 16, 2, 0),
         (F, 32, 0, 0)],
    ),
    "inf_resets_the_good_counter": (
        {},
        [(F, 8, 1, 0), (F, 8, 2, 0), (I, 8, 0, 1), (F, 8, 1, 0), (F, 8, 2, 0),
         (F, 16, 0, 0)],
    ),
    "shrinks_after_n_consecutive_inf": (
        {},
        [(I, 8, 0, 1), (I, 4, 0, 0), (I, 4, 0, 1), (I, 2, 0, 0), (F, 2, 1, 0),
         (I, 2, 0, 1), (I, 1, 0, 0)],
    ),
    "non_consecutive_inf_never_shrinks": (
        {"incr_every_n_steps": 1000},
        [(I, 8, 0, 1), (F, 8, 1, 0), (I, 8, 0, 1), (F, 8, 1, 0), (I, 8, 0, 1),
         (F, 8, 1, 0), (F, 8, 2, 0), (I, 8, 0, 1), (F, 8, 1, 0), (I, 8, 0, 1)],
    ),
    "overflow_burst_with_decr_every_1": (
        {"init_scale": 2.0**15, "decr_every_n_nan_or_inf": 1},
        [(I, 2**14, 0, 0), (I, 2**13, 0, 0), (I, 2**12, 0, 0), (I, 2**11, 0, 0),
         (F, 2**11, 1, 0), (F, 2**11, 2, 0), (F, 2**12, 0, 0)],
    ),
    "min_bound_holds": (
        {"init_scale": 4.0, "decr_every_n_nan_or_inf": 1, "incr_every_n_steps": 2},
        [(I, 2, 0, 0), (I, 1, 0, 0), (I, 1, 0, 0), (I, 1, 0, 0), (F, 1, 1, 0),
         (F, 2, 0, 0)],
    ),
    "min_bound_clamps_a_non_power_of_two": (
        {"init_scale": 3.0, "decr_every_n_nan_or_inf": 1},
        [(I, 1.5, 0, 0), (I, 1.0, 0, 0), (I, 1.0, 0, 0)],
    ),
    "min_bound_not_a_power_of_two": (
        {"init_scale": 1.0, "min_scale": 0.3, "decr_every_n_nan_or_inf": 1},
        [(I, 0.5, 0, 0), (I, f32(0.3), 0, 0), (I, f32(0.3), 0, 0)],
    ),
    "growth_capped_at_max": (
        {"init_scale": 2.0**22, "max_scale": 2.0**23, "incr_every_n_steps": 1},
        [(F, 2**23, 0, 0), (F, 2**23, 0, 0), (I, 2**23, 0, 1), (I, 2**22, 0, 0),
         (F, 2**23, 0, 0)],
    ),
    "growth_capped_at_a_max_between_powers": (
        {"init_scale": 2.0**20, "max_scale": 3e6, "incr_every_n_steps": 1},
        [(F, 2**21, 0, 0), (F, 3e6, 0, 0), (F, 3e6, 0, 0)],
    ),
    "never_inf_when_max_exceeds_float32": (
        {"init_scale": 2.0**126, "min_scale": 2.0**120, "max_scale": 2.0**128,
         "incr_every_n_steps": 1, "decr_every_n_nan_or_inf": 1},
        [(F, 2**127, 0, 0), (F, 2**127, 0, 0), (F, 2**127, 0, 0), (I, 2**126, 0, 0),
         (F, 2**127, 0, 0)],
    ),
    "non_power_of_two_ratios_round_to_float32": (
        {"init_scale": 3.0, "incr_ratio": 1.1, "decr_ratio": 0.7,
         "incr_every_n_steps": 1, "decr_every_n_nan_or_inf": 1},
        [(F, f32(3 * 1.1), 0, 0), (F, f32(f32(3 * 1.1) * 1.1), 0, 0),
         (I, f32(f32(f32(3 * 1.1) * 1.1) * 0.7), 0, 0)],
    ),
}


@pytest.mark.parametrize("name", sorted(BACKOFF_TRACES))
def test_backoff_trace(name):
    overrides, trace = BACKOFF_TRACES[name]
    scaler = backoff(**overrides)
    for step, (found_inf, scale, good, bad) in enumerate(trace):
        scaler.update(found_inf)
        got = (scaler.scale, scaler.num_good_steps, scaler.num_bad_steps)
        assert got == (scale, good, bad), f"{name}: step {step}"
        assert type(scaler.scale) is float
        assert math.isfinite(scaler.scale)


def test_backoff_3000_finite_steps_grow_every_1000():
    scaler = backoff(init_scale=32768.0, incr_every_n_steps=1000)
    for step in range(1, 3001):
        scaler.update(False)
        assert scaler.scale == 2.0 ** (15 + step // 1000), step
        assert scaler.num_good_steps == step % 1000, step
        assert scaler.num_bad_steps == 0


def test_backoff_can_decrease_flips_at_the_min_bound():
    scaler = backoff(init_scale=2.0, decr_every_n_nan_or_inf=1, incr_every_n_steps=1)
    assert scaler.can_decrease
    scaler.update(True)
    assert scaler.scale == 1.0
    assert not scaler.can_decrease
    scaler.update(True)
    assert scaler.scale == 1.0
    assert not scaler.can_decrease
    scaler.update(False)
    assert scaler.scale == 2.0
    assert scaler.can_decrease


@pytest.mark.parametrize(
    "overrides",
    [
        {"init_scale": 1.0, "min_scale": 0.3},  # float32(0.3) > 0.3
        {"init_scale": 1.0, "min_scale": 0.5, "decr_ratio": 1.0 - 1e-9},  # rounds back
    ],
)
def test_backoff_cannot_decrease_when_a_decrease_would_not_change_the_scale(overrides):
    scaler = backoff(decr_every_n_nan_or_inf=1, **overrides)
    for _ in range(3):
        scaler.update(True)
    before = scaler.scale
    assert not scaler.can_decrease
    scaler.update(True)
    assert scaler.scale == before


def test_backoff_found_inf_accepts_tensors():
    scaler = backoff(decr_every_n_nan_or_inf=1)
    scaler.update(torch.tensor([1.0]))  # torch's found_inf is a float tensor
    scaler.update(torch.tensor(False))
    assert (scaler.scale, scaler.num_good_steps) == (4.0, 1)
    with pytest.raises(TypeError, match="one-element tensor"):
        scaler.update(torch.zeros(2))
    scaler.update(np.True_)
    assert (scaler.scale, scaler.num_bad_steps) == (2.0, 0)
    for bad in ("yes", None, [True]):
        with pytest.raises(TypeError, match="found_inf"):
            scaler.update(bad)


# -------------------------------------------------------------- torch parity
def _torch_trace(found, init, interval, growth, backoff_factor):
    scale = torch.tensor([init], dtype=torch.float32)
    tracker = torch.zeros(1, dtype=torch.int32)
    out = []
    for flag in found:
        torch._amp_update_scale_(
            scale, tracker, torch.tensor([float(flag)]), growth, backoff_factor, interval
        )
        out.append((scale.item(), int(tracker.item())))
    return out


@pytest.mark.parametrize(
    ("interval", "growth", "backoff_factor", "p_inf", "bounds"),
    [
        (1000, 2.0, 0.5, 0.0004, (1.0, 2.0**24)),  # the contract's defaults, decr_every=1
        (50, 2.0, 0.5, 0.01, (1.0, 2.0**60)),
        (37, 1.5, 0.7, 0.01, (2.0**-40, 2.0**60)),
    ],
)
def test_backoff_matches_torch_amp_update_scale(interval, growth, backoff_factor, p_inf, bounds):
    rng = np.random.default_rng(interval)
    found = rng.random(4000) < p_inf
    found[1500:1504] = True  # a burst
    expected = _torch_trace(found, 32768.0, interval, growth, backoff_factor)
    scaler = BackoffLossScaler(32768.0, interval, 1, growth, backoff_factor, *bounds)
    changes = 0
    for step, (flag, (scale, tracker)) in enumerate(zip(found, expected, strict=True)):
        # Below min or above max the two algorithms differ by design.
        assert bounds[0] <= scale <= bounds[1], f"trace leaves the shared regime at {step}"
        before = scaler.scale
        scaler.update(bool(flag))
        assert (scaler.scale, scaler.num_good_steps) == (scale, tracker), step
        changes += scaler.scale != before
    assert changes >= 5  # the trace exercised both growth and backoff


def test_backoff_matches_torch_grad_scaler():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    scaler = BackoffLossScaler(1024.0, 5, 1, 2.0, 0.5, 1.0, 2.0**24)
    found = np.random.default_rng(7).random(200) < 0.1
    for step, flag in enumerate(found):
        optimizer.zero_grad()
        grad_scaler.scale(param.sum()).backward()
        if flag:
            param.grad[1] = float("inf")
        grad_scaler.step(optimizer)
        grad_scaler.update()
        scaler.update(bool(flag))
        assert scaler.scale == grad_scaler.get_scale(), step
        assert scaler.num_good_steps == grad_scaler._get_growth_tracker(), step


# ---------------------------------------------------------------- log-normal
def _reference_cutoff(xs, beta1=0.99, beta2=0.999, k=3.09):
    """Bias-corrected EMAs written as explicit weighted sums over all observations."""
    x = np.asarray(xs, dtype=np.float64)
    t = len(x)
    age = np.arange(t - 1, -1, -1)
    w1 = (1 - beta1) * beta1**age / (1 - beta1**t)
    w2 = (1 - beta2) * beta2**age / (1 - beta2**t)
    mu = w1 @ x
    variance = w2 @ (x * x) - (w2 @ x) ** 2
    return mu + k * math.sqrt(max(variance, 0.0))


def _reference_lognormal(events, init, lo, hi, max_repr=65504.0):
    """Scales after each (found_inf, grad_max) event, per the documented algorithm."""
    xs, scale, out = [], f32(init), []
    for found_inf, grad_max in events:
        if found_inf:
            bound = math.log2(max_repr / scale)
            if xs:
                bound = max(bound, _reference_cutoff(xs))
            xs.append(bound + 1.0)
        elif grad_max > 0:
            xs.append(math.log2(grad_max))
        if found_inf or grad_max > 0:
            exponent = math.log2(max_repr) - _reference_cutoff(xs)
            new = min(max(2.0 ** min(max(exponent, -1000), 1000), lo), hi)
            if found_inf:
                new = min(new, max(scale / 2, lo))
            scale = min(f32(new), F32_MAX)
        out.append(scale)
    return out


def _grad_max_phases(rng):
    """log2 of gradient maxima: a run clamped at max_scale, a noisy stationary run
    with single-step spikes and all-zero gradients, then maxima that overflow
    even at min_scale."""
    return np.concatenate(
        [
            rng.normal(-12.0, 0.5, 80),  # 65504 / 2**-10.5 > max_scale: clamped
            rng.normal(-8.0, 1.0, 200),  # overflows now and then
            [-1.0],  # spike
            rng.normal(-8.0, 1.0, 30),
            [0.0, 1.0],  # two spikes in a row
            np.full(5, -np.inf),  # all-zero gradients: grad_max == 0
            rng.normal(-7.0, 1.0, 150),
            rng.normal(17.0, 0.3, 20),  # overflows at any scale >= 1
        ]
    )


def test_lognormal_matches_reference_and_hits_every_branch():
    rng = np.random.default_rng(3)
    scaler = lognormal(init_scale=1024.0, min_scale=1.0, max_scale=2.0**24)
    events, scales, seen = [], [], {}
    for log_g in _grad_max_phases(rng):
        grad_max = float(2.0**log_g)
        # The overflow a real backward would see with this scale.
        found_inf = grad_max * scaler.scale >= 65520.0
        before = scaler.scale
        scaler.update(found_inf, None if found_inf else grad_max)
        events.append((found_inf, grad_max))
        scales.append(scaler.scale)
        kind = "inf" if found_inf else "zero" if grad_max == 0 else "finite"
        where = {2.0**24: "max", 1.0: "min"}.get(before, "between")
        seen[kind, where] = seen.get((kind, where), 0) + 1
        assert scaler.can_decrease == (scaler.scale > 1.0)
        if found_inf:
            # Every overflow lowers the scale (at least 2x) unless it is at the minimum.
            assert scaler.scale <= max(before / 2, 1.0)
        if grad_max == 0:
            assert scaler.scale == before
    assert seen[("finite", "max")] >= 50
    assert seen[("finite", "between")] >= 300
    assert seen[("inf", "max")] >= 1
    assert seen[("inf", "between")] >= 10
    assert seen[("inf", "min")] >= 1
    assert seen[("zero", "between")] == 5
    reference = _reference_lognormal(events, 1024.0, 1.0, 2.0**24)
    # Summation orders differ, so allow one float32 ulp (in practice all are equal).
    assert scales == pytest.approx(reference, rel=2.0**-23, abs=0)


def test_lognormal_first_step_overflow_feeds_one_binade_above_threshold():
    scaler = lognormal(init_scale=2.0**24)
    scaler.update(True)
    fed = math.log2(65504.0 / 2.0**24) + 1.0
    state = scaler.state_dict()
    assert state["num_observations"] == 1
    assert state["mean_ema"] == pytest.approx(0.01 * fed, rel=1e-15)
    assert scaler.log2_stats() == pytest.approx((fed, 0.0), abs=1e-9)
    # sigma == 0 so the proposal is 2**(log2(65504) - fed) ~= 2**23: one halving.
    assert scaler.scale == pytest.approx(2.0**23, rel=1e-6)
    assert scaler.scale <= 2.0**23
    scaler.update(True)  # not a fixed point: a second overflow lowers it again
    assert scaler.scale <= 2.0**22


def test_lognormal_overflow_at_max_clamp_halves_and_raises_the_estimate():
    scaler = lognormal(init_scale=2.0**24)
    for _ in range(50):
        scaler.update(False, 2.0**-40)
    assert scaler.scale == 2.0**24
    mu_before, _ = scaler.log2_stats()
    scaler.update(True)
    assert scaler.scale == 2.0**23  # the averages alone would keep 2**24
    mu_after, _ = scaler.log2_stats()
    # Fed log2(65504 / 2**24) + 1 ~= -7, far above mu ~= -40.
    assert mu_after > mu_before + 0.3


def test_lognormal_overflow_at_min_clamp_never_lowers_the_estimate():
    scaler = lognormal(init_scale=1.0)
    for _ in range(20):
        scaler.update(False, 2.0**20)  # needs a scale below min_scale
    assert scaler.scale == 1.0
    assert not scaler.can_decrease
    mu, _sigma = scaler.log2_stats()
    scaler.update(True)  # bound log2(65504) ~= 16 is below the model's cutoff
    assert scaler.scale == 1.0
    assert scaler.log2_stats()[0] > mu


def test_lognormal_max_beyond_float32_caps_at_float32_max():
    scaler = lognormal(init_scale=1.0, max_scale=2.0**200)
    scaler.update(False, 2.0**-140)  # proposes 2**156: finite in float64 only
    assert scaler.scale == F32_MAX
    scaler = lognormal(init_scale=1.0, max_scale=2.0**200)
    scaler.update(False, 1e-300)  # log2 ~= -997: 2.0 ** 1013 would raise OverflowError
    assert scaler.scale == F32_MAX


def test_lognormal_all_zero_gradients_change_nothing():
    scaler = lognormal()
    scaler.update(False, 2.0**-10)
    state = scaler.state_dict()
    scaler.update(False, 0.0)
    assert scaler.state_dict() == state


def test_lognormal_grad_max_is_validated_on_finite_steps_only():
    scaler = lognormal()
    assert scaler.needs_grad_max
    assert not backoff().needs_grad_max
    for bad in (None, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="grad_max"):
            scaler.update(False, bad)
    assert scaler.num_observations == 0
    scaler.update(True, None)
    scaler.update(True, float("inf"))
    scaler.update(False, torch.tensor(0.5))
    assert scaler.num_observations == 3
    with pytest.raises(RuntimeError, match="at least one"):
        lognormal().log2_stats()


# --------------------------------------------------------------- checkpoints
def _backoff_events(rng, n):
    return [(bool(f), None) for f in rng.random(n) < 0.3]


def _lognormal_events(rng, n):
    return [(bool(f), float(2.0 ** rng.normal(-8, 2))) for f in rng.random(n) < 0.1]


def _counters(scaler):
    state = scaler.state_dict()
    return state, scaler.scale


@pytest.mark.parametrize(
    ("make", "events"),
    [
        (lambda: backoff(incr_every_n_steps=4), _backoff_events),
        (lambda: lognormal(), _lognormal_events),
        (lambda: StaticLossScaler(512.0), _backoff_events),
        (UnitLossScaler, _backoff_events),
    ],
)
def test_state_dict_roundtrip_mid_trace_continues_identically(make, events):
    trace = events(np.random.default_rng(11), 600)
    uninterrupted = make()
    for found_inf, grad_max in trace[:250]:
        uninterrupted.update(found_inf, grad_max)
    state = roundtrip(uninterrupted.state_dict())
    assert all(isinstance(v, (int, float)) for v in state.values())
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == uninterrupted.state_dict()
    for step, (found_inf, grad_max) in enumerate(trace[250:]):
        uninterrupted.update(found_inf, grad_max)
        resumed.update(found_inf, grad_max)
        assert resumed.state_dict() == uninterrupted.state_dict(), step


def test_load_state_dict_accepts_tensors():
    scaler = backoff()
    scaler.load_state_dict(
        {"scale": torch.tensor(64.0), "num_good_steps": torch.tensor(2), "num_bad_steps": 0}
    )
    scaler.update(False)
    assert (scaler.scale, scaler.num_good_steps) == (128.0, 0)


@pytest.mark.parametrize(
    ("make", "state", "error", "match"),
    [
        (backoff, {"scale": 8.0, "num_good_steps": 0}, ValueError, r"missing keys \['num_bad_steps'\]"),
        (backoff, {"scale": 8.0, "num_good_steps": 0, "num_bad_steps": 0, "x": 1},
         ValueError, r"unknown keys \['x'\]"),
        (backoff, {"scale": 0.0, "num_good_steps": 0, "num_bad_steps": 0}, ValueError, "scale"),
        (backoff, {"scale": 8.0, "num_good_steps": -1, "num_bad_steps": 0}, ValueError,
         "num_good_steps"),
        (backoff, {"scale": 8.0, "num_good_steps": 1.5, "num_bad_steps": 0}, ValueError,
         "num_good_steps"),
        (backoff, {"scale": "8", "num_good_steps": 0, "num_bad_steps": 0}, TypeError, "scale"),
        (UnitLossScaler, {"scale": 1.0}, ValueError, "different loss scaler"),
        (lambda: StaticLossScaler(2.0), {}, ValueError, "missing keys"),
        (lognormal, {"scale": 8.0, "num_observations": 1, "mean_ema": float("nan"),
                     "slow_mean_ema": 0.0, "sq_ema": 0.0}, ValueError, "mean_ema"),
        (backoff, [("scale", 8.0)], TypeError, "mapping"),
    ],
)
def test_load_state_dict_rejects_bad_state(make, state, error, match):
    scaler = make()
    before = scaler.state_dict()
    with pytest.raises(error, match=match):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


# --------------------------------------------------------------- fixed scales
def test_static_and_unit_scalers_never_change():
    static, unit = StaticLossScaler(1000.1), UnitLossScaler()
    for found_inf in (True, False, True, True):
        static.update(found_inf)
        unit.update(found_inf)
    assert static.scale == f32(1000.1)
    assert unit.scale == 1.0
    assert not static.can_decrease
    assert not unit.can_decrease
    assert static.state_dict() == {"scale": f32(1000.1)}
    assert unit.state_dict() == {}


def test_reprs_show_state():
    scaler = backoff()
    scaler.update(True)
    assert "BackoffLossScaler(scale=8.0, num_good_steps=0, num_bad_steps=1" in repr(scaler)
    assert repr(StaticLossScaler(4)) == "StaticLossScaler(scale=4.0)"
    assert repr(UnitLossScaler()) == "UnitLossScaler()"
    assert repr(lognormal()).startswith("LogNormalLossScaler(scale=32768.0, num_observations=0")


def test_base_class_is_abstract():
    with pytest.raises(TypeError):
        LossScaler()


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: backoff(init_scale=0.0), r"init_scale must be a finite number > 0, got 0\.0"),
        (lambda: backoff(init_scale=float("inf")), "init_scale"),
        (lambda: backoff(init_scale=2.0**129, max_scale=2.0**130), "representable in float32"),
        (lambda: backoff(init_scale=True), "init_scale"),
        (lambda: backoff(init_scale=2.0**25), r"init_scale must lie within \[min_scale, max_scale\]"),
        (lambda: backoff(incr_every_n_steps=0), r"incr_every_n_steps must be an int >= 1, got 0"),
        (lambda: backoff(incr_every_n_steps=10.0), "incr_every_n_steps"),
        (lambda: backoff(decr_every_n_nan_or_inf=0), "decr_every_n_nan_or_inf"),
        (lambda: backoff(incr_ratio=1.0), r"incr_ratio must be a number in \(1\.0, inf\), got 1\.0"),
        (lambda: backoff(decr_ratio=1.0), "decr_ratio"),
        (lambda: backoff(decr_ratio=0), "decr_ratio"),
        (lambda: backoff(min_scale=-1.0), "min_scale"),
        (lambda: backoff(min_scale=1e-50, init_scale=1.0), "min_scale must be representable"),
        (lambda: backoff(min_scale=4.0, max_scale=2.0), "max_scale must be a finite number >= min_scale"),
        (lambda: backoff(max_scale=float("inf")), "max_scale"),
        (lambda: lognormal(beta1=1.0), r"beta1 must be a number in \[0, 1\)"),
        (lambda: lognormal(beta2=-0.1), "beta2"),
        (lambda: lognormal(overflow_std_dev=-1.0), "overflow_std_dev"),
        (lambda: lognormal(max_representable=0.0), "max_representable"),
        (lambda: lognormal(init_scale=0.5), "init_scale must lie within"),
        (lambda: StaticLossScaler(-2.0), r"scale must be a finite number > 0, got -2\.0"),
    ],
)
def test_constructors_validate_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --------------------------------------------------------- build_loss_scaler
def amp_config(**overrides):
    """AmpConfig's attributes as a plain namespace, so build_loss_scaler's own checks can be fed bad values."""
    cfg = AmpConfig().to_dict()
    cfg.update(overrides)
    return types.SimpleNamespace(**cfg)


def test_build_backoff_passes_every_setting():
    cfg = amp_config(init_loss_scaling=64.0, incr_every_n_steps=7, decr_every_n_nan_or_inf=3,
                     incr_ratio=3.0, decr_ratio=0.25, min_loss_scaling=2.0, max_loss_scaling=512.0)
    scaler = build_loss_scaler(cfg)
    assert type(scaler) is BackoffLossScaler
    assert scaler.scale == 64.0
    assert (scaler.incr_every_n_steps, scaler.decr_every_n_nan_or_inf) == (7, 3)
    assert (scaler.incr_ratio, scaler.decr_ratio) == (3.0, 0.25)
    assert (scaler.min_scale, scaler.max_scale) == (2.0, 512.0)


def test_build_lognormal_static_and_unit():
    scaler = build_loss_scaler(amp_config(loss_scaling_algorithm="lognormal",
                                          init_loss_scaling=8.0, max_loss_scaling=64.0))
    assert type(scaler) is LogNormalLossScaler
    assert scaler.scale == 8.0
    assert (scaler.min_scale, scaler.max_scale) == (1.0, 64.0)
    static = build_loss_scaler(amp_config(use_dynamic_loss_scaling=False,
                                          init_loss_scaling=2.0**30))
    assert type(static) is StaticLossScaler
    assert static.scale == 2.0**30
    for dynamic in (True, False):
        unit = build_loss_scaler(amp_config(dtype="bfloat16", use_dynamic_loss_scaling=dynamic,
                                            loss_scaling_algorithm="lognormal"))
        assert type(unit) is UnitLossScaler


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"dtype": "float32"}, ValueError, "dtype must be 'float16' or 'bfloat16', got 'float32'"),
        ({"loss_scaling_algorithm": "logmax"}, ValueError,
         "loss_scaling_algorithm must be 'backoff' or 'lognormal', got 'logmax'"),
        ({"incr_ratio": 0.5}, ValueError, "incr_ratio"),
    ],
)
def test_build_rejects_bad_config(overrides, error, match):
    with pytest.raises(error, match=match):
        build_loss_scaler(amp_config(**overrides))


def test_build_rejects_objects_without_amp_config_attributes():
    cfg = amp_config()
    del cfg.max_loss_scaling
    with pytest.raises(TypeError, match="max_loss_scaling"):
        build_loss_scaler(cfg)


def test_build_from_the_real_amp_config_defaults():
    scaler = build_loss_scaler(AmpConfig())
    assert type(scaler) is BackoffLossScaler
    assert (scaler.scale, scaler.incr_every_n_steps, scaler.decr_every_n_nan_or_inf) == (
        32768.0, 1000, 2)
