"""optim.step_policy.StepPolicy: apply or skip on the verdict, counters, retries, merge windows, attribution."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distamp.core.precision import MixedPrecision
from distamp.optim.accumulation import GradientMerge
from distamp.optim.grad_watch import GradWatch
from distamp.optim.model_binding import ModelBinding
from distamp.optim.step_policy import StepPolicy
from distamp.strategy import AmpConfig


def _policy(k_steps=1, scale=4.0):
    model = nn.Linear(2, 1, bias=False)
    config = AmpConfig.from_dict({"init_loss_scaling": scale, "min_loss_scaling": 1.0})
    precision = MixedPrecision(list(model.parameters()), config)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    merge = GradientMerge(k_steps)
    watch = GradWatch(model.parameters())
    policy = StepPolicy(inner, precision, merge, watch, None, None)
    policy.binding = ModelBinding(precision.master_weights, config, True, lambda: policy.step_number + 1)
    policy.binding.adopt(model, [])
    return policy, model


def _backward(policy, model, grad):
    model.weight.grad = torch.tensor([grad], dtype=torch.float32) * policy.precision.loss_scale
    policy.merge.count_backward()
    policy.watch.after_backward(policy.precision.loss_scale)


def test_finite_step_is_applied_with_unscaled_gradients():
    policy, model = _policy()
    before = model.weight.detach().clone()
    _backward(policy, model, [0.5, -1.0])
    assert policy.step() is True
    assert torch.equal(model.weight.detach(), before - torch.tensor([[0.5, -1.0]]))
    assert (policy.steps_applied, policy.steps_skipped, policy.step_number) == (1, 0, 1)
    assert policy.last_step_skipped is False
    assert policy.unscaled is False


def test_overflow_skips_attributes_and_counts():
    policy, model = _policy()
    before = model.weight.detach().clone()
    _backward(policy, model, [float("nan"), 1.0])
    assert policy.step() is False
    assert torch.equal(model.weight.detach(), before)
    assert (policy.steps_applied, policy.steps_skipped) == (0, 1)
    assert policy.last_step_skipped is True
    assert policy.overflow.last_overflow == {"step": 1, "params": ["weight"]}


def test_step_without_new_gradients_does_nothing():
    policy, _ = _policy()
    with pytest.warns(UserWarning, match="found no new gradients"):
        assert policy.step() is False
    assert policy.step_number == 0


def test_mid_window_step_is_refused_and_window_step_applies():
    policy, model = _policy(k_steps=2)
    _backward(policy, model, [1.0, 1.0])
    assert policy.step() is False
    assert policy.step_number == 0
    _backward(policy, model, [1.0, 1.0])
    assert policy.step() is True
    assert policy.merge.micro_steps == 0


def test_closure_retries_at_a_lower_scale():
    policy, model = _policy(scale=8.0)
    calls = []

    def closure():
        calls.append(policy.precision.loss_scale)
        bad = len(calls) == 1
        model.weight.grad = torch.tensor([[float("inf") if bad else 1.0, 0.0]]) * policy.precision.loss_scale
        policy.watch.after_backward(policy.precision.loss_scale)  # what optimizer.backward tells it
        return torch.tensor(float(len(calls)))

    loss = policy.step_with_closure(closure, retries=2)
    assert loss.item() == 2.0
    assert calls == [8.0, 4.0]
    assert (policy.retries, policy.steps_applied, policy.steps_skipped) == (1, 1, 0)
    assert policy.overflow.overflows == 1


def test_a_retried_attempt_is_logged_with_the_scale_it_ran_at(caplog):
    # Was: the retry's line showed the scale already lowered for the next attempt (4, 2 for attempts at 8, 4),
    # while a skipped step's line shows the scale it ran at.
    policy, model = _policy(scale=8.0)

    def closure():
        model.weight.grad = torch.tensor([[float("inf"), 0.0]]) * policy.precision.loss_scale
        policy.watch.after_backward(policy.precision.loss_scale)
        return torch.tensor(0.0)

    with caplog.at_level("WARNING", logger="distamp"):
        policy.step_with_closure(closure, retries=2)
    assert [r.getMessage() for r in caplog.records if r.name == "distamp"] == [
        "step 1 retried at a lower loss scale: non-finite gradients in weight (loss scale 8)",
        "step 1 retried at a lower loss scale: non-finite gradients in weight (loss scale 4)",
        "step 1 skipped: non-finite gradients in weight (loss scale 2)",
    ]


def test_closure_refused_with_gradient_merge():
    policy, _ = _policy(k_steps=3)
    with pytest.raises(RuntimeError, match=re.escape(
        "step(closure) runs one micro-batch per call and cannot close a gradient-merge window of k_steps=3"
    )):
        policy.step_with_closure(lambda: torch.zeros(()), retries=0)


def test_a_closure_that_clips_after_its_backward_is_unscaled_once():
    policy, model = _policy(scale=8.0)
    before = model.weight.detach().clone()
    clipper_norms = []

    def closure():
        _backward(policy, model, [3.0, 4.0])  # unscaled gradient (3, 4), norm 5
        policy.unscale_and_check()  # what clip_grad_norm_ does first
        clipper_norms.append(float(model.weight.grad.norm()))
        return torch.tensor(1.0)

    policy.step_with_closure(closure, retries=0)
    assert clipper_norms == [5.0]  # unscaled by the clip, and not divided by the scale again at the step
    assert policy.steps_applied == 1
    assert torch.equal(model.weight.detach(), before - torch.tensor([[3.0, 4.0]]))


def test_inside_the_window_after_a_skipped_one_nothing_is_skipped():
    # Was: step_was_skipped stayed True through the next window's micro-batches, so a loop counting
    # `step_was_skipped` counted one skipped window k_steps times.
    policy, model = _policy(k_steps=2)
    seen = []
    for grad in ([1.0, 1.0], [float("inf"), 1.0], [1.0, 1.0], [1.0, 1.0]):
        _backward(policy, model, grad)
        seen.append((policy.step(), policy.last_step_skipped))
    assert seen == [(False, False), (False, True), (False, False), (True, False)]
    assert (policy.steps_applied, policy.steps_skipped) == (1, 1)
