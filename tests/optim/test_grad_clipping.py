"""optim.grad_clipping.GradClipper: clips the unscaled gradients exactly as torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from distamp.core.precision import MixedPrecision, PureLowPrecision
from distamp.optim.accumulation import GradientMerge
from distamp.optim.grad_clipping import GradClipper
from distamp.strategy import AmpConfig


class _Policy:
    """The part of StepPolicy the clipper uses: unscale once, remember the verdict."""

    def __init__(self, precision):
        self.precision, self.unscaled, self.found_inf, self.calls = precision, False, False, 0

    def unscale_and_check(self):
        self.calls += 1
        self.found_inf, _ = self.precision.unscale_and_check(None)
        self.unscaled = True


def _setup(pure=False, k_steps=1):
    g = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(5, generator=g)), nn.Parameter(torch.randn(2, 3, generator=g))]
    config = AmpConfig.from_dict({"init_loss_scaling": 64.0, "use_pure_fp16": pure})
    precision = (PureLowPrecision if pure else MixedPrecision)(params, config)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 64).to(p.dtype)
    policy = _Policy(precision)
    return params, precision, policy, GradClipper(precision, policy, GradientMerge(k_steps))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_o1_clip_matches_torch(norm_type):
    params, _, policy, clipper = _setup()
    reference = [g.clone() / 64 for g in (p.grad for p in params)]
    ref_params = [nn.Parameter(torch.zeros_like(r)) for r in reference]
    for p, r in zip(ref_params, reference, strict=True):
        p.grad = r
    expected_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5, norm_type=norm_type)
    norm = clipper.clip_grad_norm_(0.5, norm_type=norm_type)
    assert torch.equal(norm, expected_norm)
    assert clipper.last_norm == float(expected_norm)
    for p, r in zip(params, ref_params, strict=True):
        assert torch.equal(p.grad, r.grad)
    assert policy.calls == 1
    clipper.clip_grad_norm_(0.5)
    assert policy.calls == 1  # unscaled once per step


def test_o2_clips_the_fp32_masters_and_exposes_unscaled_grads():
    params, precision, _, clipper = _setup(pure=True)
    clipper.unscale_()
    masters = precision.master_weights.masters
    unscaled = [m.grad.clone() for m in masters]
    for p, u in zip(params, unscaled, strict=True):
        assert torch.equal(p.grad, u.half())  # what unscale_() shows the user
    ref = [nn.Parameter(torch.zeros_like(u)) for u in unscaled]
    for p, u in zip(ref, unscaled, strict=True):
        p.grad = u.clone()
    expected = torch.nn.utils.clip_grad_norm_(ref, 0.1)
    assert torch.equal(clipper.clip_grad_norm_(0.1), expected)
    for m, r in zip(masters, ref, strict=True):
        assert torch.equal(m.grad, r.grad)


def test_overflow_returns_inf_without_clipping():
    params, _, _, clipper = _setup()
    params[0].grad[0] = float("nan")
    norm = clipper.clip_grad_norm_(1.0)
    assert norm.item() == math.inf
    assert clipper.last_norm is None


def test_error_if_nonfinite_is_passed_on():
    params, _, policy, clipper = _setup()
    policy.unscaled = True  # the verdict says finite, yet a gradient is inf (e.g. changed after the check)
    params[0].grad[0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        clipper.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_the_merge_window_refusal_says_which_backward_may_clip():
    # A loop kept in the shape of its non-merged version clips at every iteration; the error said only
    # "before the step that completes the window", not which iteration that is.
    _, _, _, clipper = _setup(k_steps=4)
    clipper.merge.count_backward()
    with pytest.raises(RuntimeError, match=r"clip after every 4-th backward only"):
        clipper.unscale_()


def test_refused_in_the_middle_of_a_merge_window():
    _, _, _, clipper = _setup(k_steps=4)
    clipper.merge.count_backward()
    with pytest.raises(RuntimeError, match=re.escape(
        "unscale_()/clip_grad_norm_() called in the middle of a gradient-merge window (micro-batch 1 of 4)"
    )):
        clipper.clip_grad_norm_(1.0)
