"""strategy.powersgd and PowerSGDConfig: defaults, validation, the refusal with sharding, round trips."""

from __future__ import annotations

import pytest
from torch import nn

from distamp import fleet
from distamp.distributed.fingerprint import fingerprint
from distamp.strategy import PowerSGDConfig


def test_defaults_and_typed_view():
    s = fleet.DistributedStrategy()
    assert s.powersgd is False
    assert s.powersgd_configs == {"rank": 1, "start_step": 1000, "min_compression_rate": 2.0,
                                  "warm_start": True, "error_feedback": True}
    s.powersgd = True
    s.powersgd_configs = {"rank": 4, "start_step": 100}
    assert s.powersgd_config == PowerSGDConfig(rank=4, start_step=100)
    assert s.powersgd_configs["min_compression_rate"] == 2.0  # assigning replaces: unset keys are defaults
    assert repr(s) == "DistributedStrategy(powersgd=True, powersgd_configs={'rank': 4, 'start_step': 100})"
    assert fleet.DistributedStrategy.from_dict(s.to_dict()) == s


def test_compression_rate_rule():
    cfg = PowerSGDConfig(rank=4, min_compression_rate=2.0)
    assert cfg.compression_rate(1024, 1024) == 1024 * 1024 / (4 * 2048)
    assert cfg.compresses(1024, 1024)
    assert not cfg.compresses(8, 4)       # 32 / 48 < 2
    assert not cfg.compresses(0, 4)


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ({"rnak": 2}, r"powersgd_configs has no key 'rnak'. Did you mean 'rank'\?"),
        ({"rank": 0}, r"powersgd_configs\['rank'\] must be an int >= 1 \(at most 2\*\*63 - 1\); got 0\."),
        ({"rank": 2.0}, r"powersgd_configs\['rank'\] must be an int >= 1"),
        ({"start_step": -1}, r"powersgd_configs\['start_step'\] must be an int >= 0"),
        ({"min_compression_rate": 0.5}, r"powersgd_configs\['min_compression_rate'\] must be a finite float >= 1"),
        ({"warm_start": 1}, r"powersgd_configs\['warm_start'\] must be a bool \(True or False\); got 1\."),
        ({"error_feedback": "yes"}, r"powersgd_configs\['error_feedback'\] must be a bool"),
    ],
)
def test_bad_values_name_the_key(configs, message):
    s = fleet.DistributedStrategy()
    with pytest.raises(ValueError, match=message):
        s.powersgd_configs = configs


def test_refused_with_sharding_in_either_order():
    s = fleet.DistributedStrategy(sharding=True)
    with pytest.raises(ValueError, match=r"strategy.sharding and strategy.powersgd cannot both be True"):
        s.powersgd = True
    s = fleet.DistributedStrategy(powersgd=True)
    with pytest.raises(ValueError, match=r"strategy.sharding and strategy.powersgd cannot both be True"):
        s.sharding = True
    s.powersgd = False
    s.sharding = True  # one off first, then the other on: fine
    with pytest.raises(ValueError, match=r"powersgd_config is read-only; assign a dict to powersgd_configs"):
        s.powersgd_config = PowerSGDConfig()


def test_part_of_the_rank_agreement_fingerprint():
    s = fleet.DistributedStrategy(powersgd=True)
    s.powersgd_configs = {"rank": 2}
    values = fingerprint(s, nn.Linear(2, 2))
    assert values["powersgd"] == "True"
    assert values["powersgd_configs['rank']"] == "2"
    assert values["powersgd_configs['start_step']"] == "1000"
