"""FirstForwardFinder: hands the optimizer the first module whose forward owns all its parameters, then leaves."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import torch
from torch import nn

from distamp.optim.first_forward import FirstForwardFinder


class FakeOptimizer:
    """What the finder reads of an AmpOptimizer."""

    def __init__(self, params, enabled=True, keep_norm_fp32=True):
        self.master_weights = SimpleNamespace(model_params=list(params), enabled=enabled)
        self.strategy = SimpleNamespace(amp_config=SimpleNamespace(keep_norm_fp32=keep_norm_fp32))
        self.steps_applied = self.steps_skipped = 0
        self.adopted = []

    def adopt_model(self, module, keep):
        self.adopted.append((module, keep))


def _installed(finder) -> bool:
    from torch.nn.modules.module import _global_forward_pre_hooks

    return finder._handle.id in _global_forward_pre_hooks


def _model():
    return nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))


def test_the_model_is_adopted_at_its_first_forward_with_its_norm_parameters():
    model = _model()
    opt = FakeOptimizer(model.parameters())
    finder = FirstForwardFinder(opt)
    try:
        model(torch.ones(1, 2))  # Sequential's pre-hook runs before its children's
        assert not _installed(finder)  # removed itself once it found the model
        model(torch.ones(1, 2))
    finally:
        finder.remove()
    assert len(opt.adopted) == 1
    module, keep = opt.adopted[0]
    assert module is model
    assert [id(p) for p in keep] == [id(model[1].weight), id(model[1].bias)]


def test_keep_norm_fp32_false_keeps_nothing():
    model = _model()
    opt = FakeOptimizer(model.parameters(), keep_norm_fp32=False)
    finder = FirstForwardFinder(opt)
    try:
        model(torch.ones(1, 2))
    finally:
        finder.remove()
    assert opt.adopted == [(model, [])]


def test_a_submodule_owning_only_some_parameters_is_not_adopted():
    model = _model()
    opt = FakeOptimizer(model.parameters())
    finder = FirstForwardFinder(opt)
    try:
        model[0](torch.ones(1, 2))
        nn.Linear(2, 2)(torch.ones(1, 2))
        assert opt.adopted == []
        model(torch.ones(1, 2))
    finally:
        finder.remove()
    assert opt.adopted[0][0] is model


def test_after_the_first_step_it_gives_up_with_a_warning_in_o2_only(caplog):
    for enabled in (True, False):
        caplog.clear()
        model = _model()
        opt = FakeOptimizer(model.parameters(), enabled=enabled)
        opt.steps_skipped = 1
        finder = FirstForwardFinder(opt)
        try:
            with caplog.at_level(logging.WARNING, logger="distamp"):
                model(torch.ones(1, 2))
                model(torch.ones(1, 2))
        finally:
            finder.remove()
        assert opt.adopted == []
        messages = [r.getMessage() for r in caplog.records]
        if enabled:
            assert messages == [
                ("O2: no module owning all the optimizer's parameters ran a forward before the first step, so "
                 "normalization layers stay 16-bit; pass the model to fleet.distributed_model to keep them FP32")]
        else:
            assert messages == []


def test_the_optimizer_is_held_weakly():
    model = _model()
    opt = FakeOptimizer(model.parameters())
    finder = FirstForwardFinder(opt)
    try:
        del opt
        gc.collect()
        assert finder._optimizer() is None
        model(torch.ones(1, 2))  # removes itself, no error
        assert not _installed(finder)
    finally:
        finder.remove()
