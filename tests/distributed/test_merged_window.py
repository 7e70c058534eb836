"""Gradient merge in O2 with sharding off: the comm hooks (16-bit all-reduce and PowerSGD) add the window's
FP32 sum to the last micro-batch's gradient in the bucket.

Two ways that went wrong, each checked against values the arithmetic gives exactly:
- DDP's bucket holds a gradient in its parameter's memory order, the FP32 sum is in index order: a
  ``channels_last`` weight's sum was added to other elements of the gradient.
- PowerSGD rounded the FP32 sum into the 16-bit bucket before dividing it by the world size (dense
  gradients) or building the matrix from it (compressed ones): a per-rank sum beyond FP16's 65504 whose
  mean fits became inf, and every rank skipped a step the 16-bit hook applies.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import _Gain

LR = 2.0**-4


def _rank_one_pattern() -> torch.Tensor:
    """``(o + 1) * (1 + c*4 + h*2 + w)`` for a (2, 3, 2, 2) weight: distinct values in every row, a rank-1
    matrix when viewed as PowerSGD views the weight (the first dim by the rest), so rank-1 PowerSGD
    reproduces it up to FP32 rounding, which the 16-bit gradient does not keep."""
    rows = torch.arange(1, 3, dtype=torch.float32).view(2, 1, 1, 1)
    return rows * torch.arange(1, 13, dtype=torch.float32).view(1, 3, 2, 2)


def _train_window(rank, world, weight, x, powersgd, pure=True, k=2):
    """One gradient-merge window of ``k`` micro-batches at a fixed loss scale of 1; returns (applied, FP32 weight)."""
    from distamp import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True, gradient_merge=True)
    strategy.amp_configs = {"use_pure_fp16": pure, "dtype": "float16", "use_dynamic_loss_scaling": False,
                            "init_loss_scaling": 1.0}
    strategy.gradient_merge_configs = {"k_steps": k}
    if powersgd is not None:
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": 1, "start_step": 0, "min_compression_rate": powersgd}
    model = _Gain(weight)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=LR), strategy)
    wrapped = fleet.distributed_model(model)
    applied = None
    for _ in range(k):
        with fleet.auto_cast():
            loss = wrapped(x).sum()
        opt.backward(loss)
        applied = opt.step()
    return applied, opt.fp32_state_dict(wrapped)["weight"], model.weight.is_contiguous(
        memory_format=torch.channels_last)


def _channels_last(rank, world, powersgd, pure):
    weight = torch.ones(2, 3, 2, 2).to(memory_format=torch.channels_last)
    return _train_window(rank, world, weight, _rank_one_pattern() * (rank + 1), powersgd, pure)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("powersgd", "pure"), [
    (None, True), (None, False),  # the 16-bit all-reduce, O2 and O1 (O1 merges in .grad: no FP32 sum)
    (1.0, True),  # PowerSGD compresses the 2 x 12 matrix (rate 24/14 >= 1)
    (4.0, True),  # PowerSGD sends it whole (rate below 4): its dense path
])
def test_a_channels_last_weight_gets_its_window_sum_element_by_element(powersgd, pure):
    """Rank r's gradient is (r + 1) * pattern in each of the 2 micro-batches (the loss divided by 2): the
    mean over the window and the ranks is 1.5 * pattern, exact in FP16, and the step applies lr times it.
    The hook added the FP32 sum in index order to a bucket in memory order: 0.28 off (O2, 16-bit hook)."""
    out = run_workers(_channels_last, 2, powersgd, pure, timeout=100)
    expected = torch.ones(2, 3, 2, 2) - LR * 1.5 * _rank_one_pattern()
    for rank, (applied, weight, kept_layout) in enumerate(out):
        assert applied is True, rank
        assert kept_layout, "the test needs the model's weight in channels_last"
        assert torch.equal(weight, expected), (rank, (weight - expected).abs().max())


def _sum_beyond_fp16(rank, world, powersgd):
    """Rank 0's micro-batch gradients are 3 * 2**14 (the loss divided by K=2), their sum 3 * 2**15 is beyond
    FP16's 65504; rank 1's are 0, so the mean over the ranks, 3 * 2**14, fits FP16 exactly."""
    x = torch.full((8, 8), 3.0 * 2**15 if rank == 0 else 0.0)
    return _train_window(rank, world, torch.ones(8, 8), x, powersgd)[:2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("powersgd", [None, 1.0, 100.0], ids=["allreduce", "compressed", "dense"])
def test_a_window_sum_beyond_fp16_whose_mean_fits_is_applied(powersgd):
    """The 16-bit hook divides the FP32 sum by the world size before rounding it; PowerSGD rounded the sum
    into the 16-bit bucket first (inf: every rank skipped the step). Now it divides a dense gradient's sum
    in FP32 too, and builds a compressed gradient's matrix from the FP32 sum (a constant 8 x 8 matrix is
    rank 1: rank-1 PowerSGD gives its mean up to FP32 rounding, below FP16's spacing of 32 at 49152)."""
    out = run_workers(_sum_beyond_fp16, 2, powersgd, timeout=100)
    expected = torch.ones(8, 8).add_(torch.full((8, 8), 3.0 * 2**14), alpha=-LR)
    for rank, (applied, weight) in enumerate(out):
        assert applied is True, rank
        assert torch.equal(weight, expected), (rank, weight)
