"""The loss-scaler base: argument checks of update/load_state_dict, float32 rounding, static and unit scalers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distamp.scaling.scaler_base import (
    LossScaler,
    StaticLossScaler,
    UnitLossScaler,
    _to_float32,
)


class NeedsMax(StaticLossScaler):
    needs_grad_max = True

    def __init__(self):
        super().__init__(2.0)
        self.seen = []

    def _update(self, found_inf, grad_max):
        self.seen.append((found_inf, grad_max))


def test_to_float32_rounds_like_torch():
    for x in (0.1, 1e-40, 3.0e38, 65504.0, 1 / 3):
        assert _to_float32(x) == torch.tensor(x, dtype=torch.float32).item()


def test_static_scaler_never_changes():
    s = StaticLossScaler(1024.0)
    s.update(True)
    s.update(torch.tensor(0.0))
    assert s.scale == 1024.0
    assert not s.can_decrease
    assert not s.decrease_now()
    assert s.state_dict() == {"scale": 1024.0}
    s.load_state_dict({"scale": 8.0})
    assert s.scale == 8.0
    assert repr(s) == "StaticLossScaler(scale=8.0)"
    assert StaticLossScaler(0.1).scale == torch.tensor(0.1).item()


def test_unit_scaler():
    s = UnitLossScaler()
    s.update(True)
    assert s.scale == 1.0
    assert s.state_dict() == {}
    assert repr(s) == "UnitLossScaler()"
    s.load_state_dict({})
    assert isinstance(s, LossScaler)


@pytest.mark.parametrize("flag", [True, 1, np.bool_(True), torch.tensor([1.0]), torch.tensor(True)])
def test_found_inf_accepts_bools_numbers_and_one_element_tensors(flag):
    s = NeedsMax()
    s.update(flag)
    assert s.seen == [(True, None)]


def test_found_inf_refuses_other_things():
    with pytest.raises(TypeError,
                       match=r"^found_inf must be a bool or a one-element tensor, got a tensor of shape \(2,\)\.$"):
        NeedsMax().update(torch.zeros(2))
    with pytest.raises(TypeError, match=r"^found_inf must be a bool or a one-element tensor, got 'yes'\.$"):
        NeedsMax().update("yes")


def test_grad_max_is_required_and_checked_on_finite_steps_only():
    s = NeedsMax()
    s.update(False, torch.tensor(3.5))
    s.update(True)  # not needed on an overflow
    assert s.seen == [(False, 3.5), (True, None)]
    with pytest.raises(ValueError, match=r"^grad_max is required on finite steps by this loss scaler"):
        s.update(False)
    with pytest.raises(ValueError, match=r"^grad_max must be a finite number >= 0 on a step with found_inf=False, "
                                         r"got inf; a non-finite gradient means found_inf=True\.$"):
        s.update(False, float("inf"))
    with pytest.raises(ValueError, match=r"got -1\.0"):
        s.update(False, -1.0)
    assert len(s.seen) == 2


def test_load_state_dict_checks_type_keys_and_values():
    s = StaticLossScaler(2.0)
    with pytest.raises(TypeError, match=r"^state_dict must be a mapping, got list\.$"):
        s.load_state_dict([])
    with pytest.raises(ValueError, match=r"^StaticLossScaler.load_state_dict: missing keys \['scale'\], unknown keys "
                                         r"\['num_good_steps'\] \(expected \['scale'\]\); was the checkpoint saved "
                                         r"with a different loss scaler"):
        s.load_state_dict({"num_good_steps": 1})
    with pytest.raises(ValueError, match=r"state_dict\['scale'\] must be representable in float32"):
        s.load_state_dict({"scale": 1e39})
    s.load_state_dict({"scale": torch.tensor(4.0)})  # a one-element tensor is a number
    assert s.scale == 4.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_static_scales(bad):
    with pytest.raises(ValueError, match=r"^scale must be a finite number > 0, got "):
        StaticLossScaler(bad)
