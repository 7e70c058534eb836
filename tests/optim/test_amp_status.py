"""optim.amp_status.AmpStatus: each read-out reads the part it names, and sync_found_inf writes through."""

from __future__ import annotations

import torch
from torch import nn

from distamp.core.precision import FullPrecision, MixedPrecision
from distamp.optim.accumulation import GradientMerge
from distamp.optim.amp_status import AmpStatus
from distamp.optim.grad_clipping import GradClipper
from distamp.optim.grad_watch import GradWatch
from distamp.optim.step_policy import StepPolicy
from distamp.strategy import AmpConfig


def _status(precision):
    status = AmpStatus()
    status.precision = precision
    status.merge = GradientMerge(3)
    params = precision.master_weights.model_params
    status.policy = StepPolicy(torch.optim.SGD(params, lr=0.1), precision, status.merge, GradWatch(params), None, None)
    status.clipper = GradClipper(precision, status.policy, status.merge)
    return status


def test_reads_the_parts():
    precision = MixedPrecision([nn.Parameter(torch.zeros(2))], AmpConfig.from_dict({"init_loss_scaling": 512.0}))
    status = _status(precision)
    assert status.master_weights is precision.master_weights
    assert status.loss_scaler is precision.scaler
    assert status.get_loss_scaling() == 512.0
    assert status.loss_scale == 512.0
    status.policy.steps_applied, status.policy.steps_skipped, status.policy.retries = 5, 2, 1
    status.policy.last_step_skipped = True
    status.policy.overflow.record(7, ["w"], 512.0)
    status.clipper.last_norm = 0.25
    assert status.step_was_skipped is True
    assert (status.steps_applied, status.steps_skipped) == (5, 2)
    assert status.last_grad_norm == 0.25
    assert status.stats() == {
        "steps_applied": 5,
        "steps_skipped": 2,
        "loss_scale": 512.0,
        "overflows": 1,
        "retries": 1,
        "last_overflow": {"step": 7, "params": ["w"]},
        "grad_norm": 0.25,
        "bytes_sent": None,
        "compression_rate": None,
    }


def test_merge_window_and_sync_flag():
    status = _status(FullPrecision([nn.Parameter(torch.zeros(2))], AmpConfig()))
    assert status.loss_scaler is None
    assert status.loss_scale == 1.0
    assert status.is_accumulating is False
    assert status.will_sync_next_backward() is False  # k_steps=3: the first backward does not communicate
    status.merge.count_backward()
    assert status.is_accumulating is True
    status.merge.count_backward()
    assert status.will_sync_next_backward() is True
    assert status.sync_found_inf is True
    status.sync_found_inf = False
    assert status.policy.sync_found_inf is False
    assert status.stats()["grad_norm"] is None


class _Compressor:
    def step_report(self):
        return 1234, 8.5


def test_stats_report_the_compressor():
    status = _status(MixedPrecision([nn.Parameter(torch.zeros(2))], AmpConfig()))
    status.policy.compressor = _Compressor()
    stats = status.stats()
    assert (stats["bytes_sent"], stats["compression_rate"]) == (1234, 8.5)
