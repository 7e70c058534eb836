"""DelegatingOptimizer: param_groups, state, defaults and step hooks are the inner optimizer's very objects."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from distamp.optim.delegating import DelegatingOptimizer


def _inner():
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)


def test_surface_is_the_inner_optimizers():
    inner = _inner()
    wrapped = DelegatingOptimizer(inner)
    assert wrapped.inner_opt is inner
    assert wrapped.param_groups is inner.param_groups
    assert wrapped.state is inner.state
    assert wrapped.defaults is inner.defaults
    assert isinstance(wrapped, torch.optim.Optimizer)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # DelegatingOptimizer has no step()
def test_lr_scheduler_changes_the_inner_learning_rate():
    inner = _inner()
    scheduler = torch.optim.lr_scheduler.StepLR(DelegatingOptimizer(inner), step_size=1, gamma=0.5)
    inner.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.05


def test_step_hooks_are_registered_on_the_inner_optimizer():
    inner = _inner()
    wrapped = DelegatingOptimizer(inner)
    calls = []
    pre = wrapped.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt)))
    wrapped.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt)))
    inner.step()
    assert calls == [("pre", inner), ("post", inner)]
    pre.remove()
    inner.step()
    assert calls[2:] == [("post", inner)]


def test_refuses_non_optimizers_double_wrapping_and_pickling():
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer, got Linear$"):
        DelegatingOptimizer(nn.Linear(2, 2))
    wrapped = DelegatingOptimizer(_inner())
    with pytest.raises(TypeError, match=r"^optimizer is already an AmpOptimizer; wrap the inner optimizer only once$"):
        DelegatingOptimizer(wrapped)
    with pytest.raises(TypeError,
                       match=r"^DelegatingOptimizer is not picklable; save optimizer.state_dict\(\) instead$"):
        pickle.dumps(wrapped)
