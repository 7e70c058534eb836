"""distamp.checkpoint.state: only weights_only-loadable values are saved; payloads are checked before use."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch import nn

from distamp.checkpoint.manifest import FORMAT
from distamp.checkpoint.state import (
    UnusablePayload,
    build_payload,
    check_extra,
    check_objects,
    check_payload,
    check_plain,
    restore,
)
from distamp.model_views import unwrap_model


def test_plain_values_pass_and_the_first_foreign_one_is_named():
    check_plain({"a": [1, 2.5, None, "s", b"b", (True,)], "t": torch.ones(2), "d": torch.float16}, "x")
    with pytest.raises(TypeError, match=r"x\['a'\]\[1\] is a int64 .*Convert it with int\(\.\.\.\)"):
        check_plain({"a": [1, np.int64(2)]}, "x")
    with pytest.raises(TypeError, match=r"x\['d'\] is a defaultdict"):
        check_plain({"d": collections.defaultdict(int)}, "x")
    with pytest.raises(TypeError, match=r"x\['k'\] is a ndarray .*Convert it with \.tolist\(\)"):
        check_plain({"k": np.zeros(1)}, "x")
    with pytest.raises(TypeError, match=r"key np.float64\(1.5\) of x is a float64"):
        check_plain({np.float64(1.5): 1}, "x")


def test_check_extra():
    assert check_extra(None) == {}
    assert check_extra(collections.OrderedDict(a=1)) == {"a": 1}
    with pytest.raises(TypeError, match=r"extra must be a dict, got list"):
        check_extra([1])


def test_check_objects_names_the_wrong_argument():
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    check_objects(model, opt, None)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        check_objects("m", opt, None)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer .*got dict"):
        check_objects(model, {}, None)
    with pytest.raises(TypeError, match=r"scheduler must have state_dict\(\) and load_state_dict\(\)"):
        check_objects(model, opt, 3)


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def make_payload(step=4):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    payload = build_payload(step, 1, _Wrapper(_Wrapper(model)), "SGD", opt.state_dict(), None, [{}], {"e": 1})
    return model, payload


def test_build_payload_saves_the_unwrapped_model():
    model, payload = make_payload()
    assert payload["format"] == FORMAT
    assert payload["step"] == 4
    assert set(payload["model"]) == {"weight", "bias"}
    assert unwrap_model(_Wrapper(model)) is model
    check_payload(payload, 4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: [1, 2], r"not a distamp.checkpoint/2 payload \(found 'list'\)"),
        (lambda p: {**p, "format": "x/1"}, r"not a distamp.checkpoint/2 payload \(found 'x/1'\)"),
        (lambda p: {k: v for k, v in p.items() if k != "rng"}, r"payload lacks \['rng'\]"),
        (lambda p: {**p, "step": 5}, r"payload is for step 5, its manifest for step 4"),
        (lambda p: {**p, "world_size": 2}, r"payload of 2 rank\(s\) lacks their RNG states"),
    ],
)
def test_check_payload_refuses_what_is_not_this_steps_payload(change, message):
    _, payload = make_payload()
    with pytest.raises(UnusablePayload, match=message):
        check_payload(change(payload), 4)


def test_restore_names_a_mismatch():
    model, payload = make_payload()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer is a SGD, this one is a AdamW"):
        restore(payload, model, torch.optim.AdamW(model.parameters()), None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match=r"has no LR scheduler state but scheduler=a scheduler was passed"):
        restore(payload, model, opt, sched)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight"):
        restore(payload, nn.Linear(3, 2), torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1), None)
    other = nn.Linear(2, 2)
    restore(payload, other, torch.optim.SGD(other.parameters(), lr=0.1), None)
    assert torch.equal(other.weight, model.weight)
