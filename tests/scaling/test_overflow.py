"""Overflow attribution: which parameters' gradients are non-finite, and the log/suggestion of OverflowLog."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from distamp.scaling.overflow import SUGGEST_AFTER, OverflowLog, nonfinite_parameters


def _params(*grads):
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros(3, dtype=g.dtype if g is not None else torch.float32))
        p.grad = g
        params.append(p)
    return params


def test_names_exactly_the_nonfinite_gradients_across_dtypes_in_order():
    params = _params(torch.ones(3), torch.tensor([1.0, float("nan"), 0.0]), None,
                     torch.tensor([float("-inf"), 0, 0], dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16))
    names = ["a.w", "a.b", "c.w", "d.w", "e.w"]
    assert nonfinite_parameters(params, names, None) == ["a.b", "d.w"]


def test_all_finite_none_and_empty():
    assert nonfinite_parameters(_params(torch.ones(3), None), ["x", "y"], None) == []
    assert nonfinite_parameters(_params(None, None), ["x", "y"], None) == []
    assert nonfinite_parameters([], [], None) == []


def test_a_large_finite_float16_gradient_is_finite():
    assert nonfinite_parameters(_params(torch.full((3,), 65504.0, dtype=torch.float16)), ["x"], None) == []


def test_record_logs_one_line_and_keeps_last_overflow(caplog):
    log = OverflowLog()
    names = [f"layer{i}.weight" for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="distamp"):
        log.record(12, names, 1024.0)
        log.record(13, [], 512.0, retrying=True)
    assert [r.getMessage() for r in caplog.records] == [
        ("step 12 skipped: non-finite gradients in layer0.weight, layer1.weight, layer2.weight, layer3.weight, "
         "layer4.weight, layer5.weight and 2 more (loss scale 1024)"),
        "step 13 retried at a lower loss scale: non-finite gradients in no parameter (loss scale 512)",
    ]
    assert log.last_overflow == {"step": 13, "params": []}
    assert log.overflows == 2


def test_suggests_fp32_once_per_module_after_repeated_overflows(caplog):
    log = OverflowLog()
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for step in range(1, SUGGEST_AFTER + 3):
            log.record(step, ["head.weight", "head.bias", "bias"], 8.0)  # two params of one module: counted once
    hints = [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()]
    assert hints == [
        (f"module 'head' had non-finite gradients in {SUGGEST_AFTER} skipped steps at a loss scale that could not "
         "go lower (8); if it keeps overflowing, run it in FP32: strategy.amp_configs = {..., "
         "'custom_black_varnames': ['head']}"),
        # 'bias' is the root's own parameter: no module name could keep it in FP32.
        (f"the model's own parameters 'bias' (of its root module, not of a submodule) had non-finite gradients "
         f"in {SUGGEST_AFTER} skipped steps at a loss scale that could not go lower (8); custom_black_varnames "
         "names submodules and cannot keep the root in FP32. Move them into a submodule and list that one in "
         "custom_black_varnames, or train with amp_configs['dtype'] = 'bfloat16', whose range is FP32's"),
    ]


def test_overflows_while_the_scale_falls_or_retries_blame_no_module(caplog):
    log = OverflowLog()
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for step in range(1, 3 * SUGGEST_AFTER):
            log.record(step, ["wte.weight"], 2.0 ** (24 - step), scale_falls=True)  # backing off from 2**24
            log.record(step, ["wte.weight"], 8.0, retrying=True)  # a retry lowered the scale too
    assert [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()] == []
    assert log.overflows == 2 * (3 * SUGGEST_AFTER - 1)  # every verdict is still counted and logged
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for step in range(SUGGEST_AFTER):
            log.record(100 + step, ["wte.weight"], 1.0)  # the scale stopped falling: now the module is the cause
    assert [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()] == [
        (f"module 'wte' had non-finite gradients in {SUGGEST_AFTER} skipped steps at a loss scale that could not "
         "go lower (1); if it keeps overflowing, run it in FP32: strategy.amp_configs = {..., "
         "'custom_black_varnames': ['wte']}")
    ]


def test_the_suggested_name_is_accepted_by_custom_black_varnames():
    from distamp.amp.black_modules import keep_in_fp32

    model = torch.nn.Sequential()
    model.add_module("head", torch.nn.Linear(2, 2))
    model.register_parameter("bias", torch.nn.Parameter(torch.zeros(2)))
    log = OverflowLog()
    for step in range(SUGGEST_AFTER):
        log.record(step, ["head.weight", "bias"], 8.0)
    assert log._suggested == {"head", ""}
    keep_in_fp32(model, ["head"]).remove()  # the suggested pattern works
    with pytest.raises(ValueError, match="'bias'"):
        keep_in_fp32(model, ["bias"])  # what the old hint suggested for a root parameter


def test_state_dict_saves_counts_only():
    log = OverflowLog()
    log.record(1, ["x"], 1.0)
    assert log.state_dict() == {"overflows": 1}
    other = OverflowLog()
    other.load_state_dict({"overflows": 7})
    assert other.overflows == 7
    assert other.last_overflow is None
    other.load_state_dict({})
    assert other.overflows == 0
