"""optim.grad_watch.GradWatch: unscaled backward raises, scaled-gradient edits warn once, empty steps warn once."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
from torch import nn

from distamp.optim.grad_watch import GradWatch


def _p():
    return nn.Parameter(torch.zeros(3))


def test_step_after_backward_proceeds():
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    watch.after_backward(1024.0)
    assert watch.before_step(1024.0) is True


def test_plain_backward_under_scaling_raises():
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)  # changed without optimizer.backward
    with pytest.raises(RuntimeError, match=re.escape(
        "optimizer.step() found gradients that did not come from optimizer.backward(loss): with the loss scale "
        "at 1024, a plain loss.backward()"
    )):
        watch.before_step(1024.0)
    assert watch.before_step(1.0) is True  # no scaling: applied as they are


def test_the_plain_backward_error_names_a_kept_grad_scaler_as_a_cause_too():
    # A DDP + torch.amp loop moved to distamp that kept its GradScaler (scaler.scale(loss).backward(),
    # scaler.step(optimizer)) reaches this error too; it said only "a plain loss.backward()".
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"GradScaler's scaler\.scale\(loss\)\.backward\(\).*drop any GradScaler"):
        watch.before_step(1024.0)


def test_in_place_change_is_noticed_by_version():
    p = _p()
    p.grad = torch.zeros(3)
    watch = GradWatch([p])
    p.grad.add_(1)
    with pytest.raises(RuntimeError, match=r"did not come from optimizer\.backward"):
        watch.before_step(2.0)


def test_nothing_new_warns_once_and_refuses():
    p = _p()
    watch = GradWatch([p])
    with pytest.warns(UserWarning, match=re.escape("optimizer.step() found no new gradients since the last step")):
        assert watch.before_step(1.0) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert watch.before_step(1.0) is False  # once only


def test_scaled_gradients_changed_before_unscale_warn_once(caplog):
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    watch.after_backward(8.0)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        watch.before_unscale()
        assert caplog.records == []
        p.grad.mul_(0.5)
        watch.before_unscale()
        watch.before_unscale()
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith(
        "the gradients changed after optimizer.backward() while still multiplied by the loss scale."
    )


def test_no_snapshot_at_scale_one(caplog):
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    watch.after_backward(1.0)
    p.grad.mul_(0.5)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        watch.before_unscale()
    assert caplog.records == []


def test_after_step_resets_and_track_adds():
    p, q = _p(), _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    watch.after_backward(4.0)
    watch.after_step()
    watch.track([q])
    q.grad = torch.ones(3)  # a new tracked parameter got a gradient without optimizer.backward
    with pytest.raises(RuntimeError, match=r"did not come from optimizer\.backward"):
        watch.before_step(4.0)
    q.grad = None
    p.grad = None  # freed (zero_grad): a change too
    with pytest.raises(RuntimeError, match=r"did not come from optimizer\.backward"):
        watch.before_step(4.0)


def test_replaced_gradient_object_is_a_change():
    p = _p()
    p.grad = torch.ones(3)
    watch = GradWatch([p])
    p.grad = torch.ones(3)  # same values, another tensor
    with pytest.raises(RuntimeError, match=r"did not come from optimizer\.backward"):
        watch.before_step(4.0)


def test_a_new_gradient_of_the_same_version_is_noticed_and_none_is_referenced():
    import weakref

    p = _p()
    p.grad = torch.zeros(3)
    watch = GradWatch([p])
    # No reference to the gradient: a weak one makes torch.utils.swap_tensors (model.to under FSDP2) refuse it.
    assert weakref.getweakrefcount(p.grad) == 0
    p.grad = torch.ones(3)  # a new tensor at version 0, as a plain backward after zero_grad() makes
    assert p.grad._version == 0
    with pytest.raises(RuntimeError, match=r"did not come from optimizer\.backward"):
        watch.before_step(2.0)


def test_an_untouched_gradient_is_still_nothing_new():
    p = _p()
    p.grad = torch.zeros(3)
    watch = GradWatch([p])
    other = GradWatch([p])  # a second watch's stamps do not disturb the first's
    with pytest.warns(UserWarning, match="found no new gradients"):
        assert watch.before_step(2.0) is False
    with pytest.warns(UserWarning, match="found no new gradients"):
        assert other.before_step(2.0) is False


def test_zero_grad_between_backward_and_step_is_refused_until_the_next_backward():
    p = _p()
    watch = GradWatch([p])
    p.grad = torch.ones(3)
    watch.after_backward(1024.0)
    p.grad = None
    watch.cleared()
    with pytest.raises(RuntimeError, match=re.escape("optimizer.step() after optimizer.zero_grad(): the gradients")):
        watch.refuse_cleared()
    p.grad = torch.ones(3)
    watch.after_backward(1024.0)  # a new backward after the zero_grad: its gradients are what step applies
    watch.refuse_cleared()
    assert watch.before_step(1024.0) is True


def test_zero_grad_before_backward_or_after_step_is_the_usual_loop():
    p = _p()
    watch = GradWatch([p])
    watch.cleared()  # zero_grad() at the top of the first iteration
    p.grad = torch.ones(3)
    watch.after_backward(8.0)
    watch.refuse_cleared()
    watch.after_step()
    watch.cleared()  # zero_grad() after step()
    watch.refuse_cleared()


def test_every_gradient_of_the_backward_set_to_none_elsewhere_is_refused_too():
    # model.zero_grad() bypasses the optimizer: the backward's gradients are all None at step().
    p, unused = _p(), _p()
    watch = GradWatch([p, unused])
    p.grad = torch.ones(3)
    watch.after_backward(8.0)
    p.grad = None
    with pytest.raises(RuntimeError, match=re.escape("optimizer.step() after a zero_grad() (model.zero_grad()")):
        watch.refuse_cleared()


def test_a_backward_that_left_no_gradient_on_the_model_is_not_taken_for_a_cleared_one():
    # O2 moves gradients into the masters and stage 2 frees them into its buckets during backward.
    p = _p()
    delivered = [0]
    watch = GradWatch([p], deliveries=lambda: delivered[0])
    delivered[0] += 1
    watch.after_backward(8.0)
    watch.refuse_cleared()
