"""Overflow attribution: which parameters' gradients are non-finite, and the log/suggestion of OverflowLog."""

from __future__ import annotations

import logging

import torch
from torch import nn

from distamp.optim.overflow import SUGGEST_AFTER, OverflowLog, nonfinite_parameters


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
        (f"module 'head' had non-finite gradients in {SUGGEST_AFTER} skipped steps; if it keeps overflowing, "
         "run it in FP32: strategy.amp_configs = {..., 'custom_black_varnames': ['head']}"),
        (f"module 'bias' had non-finite gradients in {SUGGEST_AFTER} skipped steps; if it keeps overflowing, "
         "run it in FP32: strategy.amp_configs = {..., 'custom_black_varnames': ['bias']}"),
    ]


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
