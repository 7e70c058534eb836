"""FirstForwardFinder: hands the optimizer the first module whose forward owns all its parameters, then leaves."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from distamp import fleet
from distamp.optim.first_forward import FirstForwardFinder


class FakeOptimizer:
    """What the finder reads of an AmpOptimizer, around a real strategy; records what it is handed."""

    def __init__(self, params, enabled=True, keep_norm_fp32=True, amp=True, black=()):
        self.master_weights = SimpleNamespace(model_params=list(params), enabled=enabled)
        self.strategy = fleet.DistributedStrategy(amp=amp)
        self.strategy.amp_configs = {"use_pure_fp16": enabled, "keep_norm_fp32": keep_norm_fp32,
                                     "custom_black_varnames": list(black)}
        self.amp_enabled = amp
        self.steps_applied = self.steps_skipped = 0
        self.adopted = []
        self.options = []

    def adopt_model(self, module, keep, **options):
        self.adopted.append((module, keep))
        self.options.append(options)


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


def test_custom_black_varnames_modules_run_in_fp32_and_are_handed_over():
    model = _model()
    opt = FakeOptimizer(model.parameters(), black=["0"])
    finder = FirstForwardFinder(opt)
    try:
        model(torch.ones(1, 2))
    finally:
        finder.remove()
    (module, keep), = opt.adopted
    assert module is model
    assert [id(p) for p in keep] == [id(p) for p in model.parameters()]  # the Linear (black) and the LayerNorm
    handle = opt.options[0]["black_modules"]
    assert handle.names == ["0"]
    assert opt.options[0]["reduces_grads"] is False
    with torch.autocast("cpu", torch.bfloat16):
        assert model[0](torch.ones(1, 2)).dtype == torch.float32  # computes in FP32 under autocast
    handle.remove()


def test_with_only_distributed_optimizer_a_black_listed_layer_stays_fp32_in_weights_and_compute():
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", "custom_black_varnames": ["1"]}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    assert model[1].weight.dtype == torch.bfloat16  # converted before the model is known
    with fleet.auto_cast():
        out = model(torch.ones(3, 2))
    # was: the named layer stayed 16-bit and computed in 16 bits
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32
    assert out.dtype == torch.float32
    optimizer.backward(out.sum())
    assert optimizer.step()


@pytest.mark.parametrize("amp", [True, False])
def test_the_model_is_adopted_with_amp_on_or_off(amp):
    model = _model()
    opt = FakeOptimizer(model.parameters(), enabled=False, amp=amp)
    finder = FirstForwardFinder(opt)
    try:
        model(torch.ones(1, 2))
    finally:
        finder.remove()
    assert [m for m, _ in opt.adopted] == [model]
