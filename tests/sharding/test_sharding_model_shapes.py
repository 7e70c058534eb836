"""The sharding stages against sharding off on loops and model shapes the other sharding tests do not cover.

Each worker trains the same model from the same data with sharding off and with
the sharding stages, on 2 gloo ranks, and the test compares the final FP32 values.
AMP off and O2 BF16 without gradient merge are compared bitwise: on 2 ranks the
reduce-scatter sums the same two halves in FP32 that the unsharded all-reduce
sums (see tests/sharding/test_sharding.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import _Gain, assert_within_bf16_rounding

STEPS, PER_RANK = 3, 4


class _Normed(nn.Module):
    """A BatchNorm between two Linears: its running statistics change in every forward, evaluated or not."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(5, 8)
        self.norm = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.norm(self.l1(x))))


def _strategy(stage: int, amp: str):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=amp != "off", sharding=stage > 0)
    if amp == "o2-bf16":
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if stage:
        strategy.sharding_configs = {"stage": stage}
    if stage != 3:  # stage 3 sends one FSDP2 unit at a time and refuses a bucket size
        strategy.fuse_grad_size_in_MB = 0.0001  # several buckets, one cut by the slice boundary
    return strategy


def _evaluate_between_backward_and_step(rank, world, amp, grad_enabled):
    """Each step: a training forward and backward, then a forward in eval mode (a validation loss), then step()."""
    from distamp import fleet

    fleet.init()
    out = {}
    for stage in (0, 1, 2):
        model = _Normed()
        strategy = _strategy(stage, amp)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        g = torch.Generator().manual_seed(10 + rank)
        applied = []
        for _ in range(STEPS):
            x, y = torch.randn(PER_RANK, 5, generator=g), torch.randn(PER_RANK, 3, generator=g)
            opt.zero_grad()
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
            opt.backward(loss)
            wrapped.eval()
            with torch.set_grad_enabled(grad_enabled), fleet.auto_cast():
                wrapped(2 * x)
            wrapped.train()
            applied.append(opt.step())
        out[stage] = {"applied": applied, "fp32": opt.fp32_state_dict(wrapped)}
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("grad_enabled", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("amp", ["off", "o2-bf16"])
def test_a_forward_between_backward_and_step_trains_as_unsharded(amp, grad_enabled):
    """Stage 1 freed each zeroed ``.grad`` before the first forward after the first backward (so that DDP's
    bucket rebuild finds the old buckets gone); when that forward came between backward and step() (an
    evaluation), step() found the backward's gradients cleared and raised "optimizer.step() after a zero_grad()".
    Now nothing is freed while a backward's gradients wait for step(), and every stage applies every step,
    bitwise as sharding off."""
    out = run_workers(_evaluate_between_backward_and_step, 2, amp, grad_enabled, timeout=100)
    for rank in (0, 1):
        for stage in (0, 1, 2):
            result = out[rank][stage]
            assert result["applied"] == [True] * STEPS, (rank, stage)
            for name, value in out[0][0]["fp32"].items():
                if name.startswith("norm.running") and rank == 1:
                    continue  # rank 1's statistics are its own until the next training forward broadcasts rank 0's
                assert torch.equal(result["fp32"][name], value), (rank, stage, name)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(5, 9)
        self.l2 = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _two_backwards_of_one_forward(rank, world, amp):
    """``optimizer.backward(loss, retain_graph=True)`` then ``optimizer.backward(loss)`` after one forward:
    first straight to step() (what it does or raises), then followed by another forward and backward."""
    from distamp import fleet

    fleet.init()
    out = {}
    for stage in (0, 1, 2):
        for then_forward in (False, True):
            model = _Plain()
            strategy = _strategy(stage, amp)
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
            wrapped = fleet.distributed_model(model, strategy)
            g = torch.Generator().manual_seed(10 + rank)
            x, y = torch.randn(PER_RANK, 5, generator=g), torch.randn(PER_RANK, 3, generator=g)
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
            opt.backward(loss, retain_graph=True)
            opt.backward(loss)
            if then_forward:
                with fleet.auto_cast():
                    opt.backward(F.mse_loss(wrapped(x).float(), y))
            try:
                applied = opt.step()
            except RuntimeError as error:
                out[stage, then_forward] = str(error)
                continue
            out[stage, then_forward] = {"applied": applied, "fp32": opt.fp32_state_dict(wrapped)}
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("amp", ["off", "o2-bf16"])
def test_a_second_backward_of_one_forward_is_reduced_or_refused_on_every_stage(amp):
    """DDP (sharding off and stage 1) reduces in the first backward after each forward only. A second backward
    through the same forward left each rank's own gradient: sharding off applied it (the ranks drifted apart),
    stage 1 left it out of the slices (the ranks agreed on half the gradient). Now step() raises on every rank
    unless a later synced backward reduces it (as after a no_sync() backward), and then every stage applies the
    three gradients' mean; stage 2's reducer reduces every backward and applies it either way."""
    out = run_workers(_two_backwards_of_one_forward, 2, amp, timeout=100)
    for rank in (0, 1):
        for stage in (0, 1):
            message = out[rank][stage, False]
            assert isinstance(message, str), (rank, stage)
            assert "second backward through one forward" in message
            assert "optimizer.backward once" in message
        assert out[rank][2, False]["applied"]
        for stage in (0, 1, 2):
            result = out[rank][stage, True]
            assert result["applied"], (rank, stage)
            for name, value in out[0][stage, True]["fp32"].items():
                assert torch.equal(result["fp32"][name], value), (rank, stage, name)  # the ranks agree
                # Stage 2 reduces three gradients and sums them in FP32; DDP reduces the sum of the last two
                # (16-bit in O2) added to the first's reduced value: rounding apart.
                expected = out[0][2, True]["fp32"][name]
                if amp == "off":
                    torch.testing.assert_close(result["fp32"][name], expected, rtol=0, atol=1e-6)
                else:
                    assert_within_bf16_rounding(result["fp32"][name], expected)


def _merged_sum_beyond_fp16(rank, world):
    """O2 FP16, gradient merge K=2, a fixed scale of 1: each of rank 0's micro-batches has the gradient
    3 * 2**14 (the loss divided by K), their sum 3 * 2**15 is beyond FP16's 65504, and the mean over the ranks
    (rank 1's gradients are 0), 3 * 2**14, fits FP16 exactly."""
    from distamp import fleet

    fleet.init()
    out = {}
    for stage in (0, 1, 2):
        model = _Gain()
        strategy = fleet.DistributedStrategy(amp=True, sharding=stage > 0, gradient_merge=True)
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "float16", "use_dynamic_loss_scaling": False,
                                "init_loss_scaling": 1.0}
        strategy.gradient_merge_configs = {"k_steps": 2}
        if stage:
            strategy.sharding_configs = {"stage": stage}
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1e-5), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        x = torch.full((1, 4), 3.0 * 2**15 if rank == 0 else 0.0)
        for _ in range(2):
            with fleet.auto_cast():
                loss = wrapped(x).sum()
            opt.backward(loss)
            applied = opt.step()
        out[stage] = applied, opt.fp32_state_dict(wrapped)["weight"]
    return out


@pytest.mark.timeout(120)
def test_o2_fp16_merged_sum_beyond_fp16_whose_mean_fits_is_applied_as_sharded():
    """Sharding off added the FP32 sum of the window's micro-batches into the 16-bit bucket before dividing it by
    the world size, so 3 * 2**15 became inf there and every rank skipped a step that stages 1 and 2 (which
    reduce-scatter each micro-batch, divided first) applied. It now divides the FP32 sum first, as the hook
    divides an FP32 (O1) gradient before the wire cast: every stage applies the mean, 3 * 2**14."""
    out = run_workers(_merged_sum_beyond_fp16, 2, timeout=100)
    expected = torch.ones(4).add_(torch.full((4,), 3.0 * 2**14), alpha=-1e-5)
    for rank in (0, 1):
        for stage in (0, 1, 2):
            applied, weight = out[rank][stage]
            assert applied is True, (rank, stage)
            assert torch.equal(weight, expected), (rank, stage, weight)


class _EmptyParameter(nn.Module):
    """A Linear and a trainable parameter of no elements (a placeholder some models keep)."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(5, 3)
        self.empty = nn.Parameter(torch.zeros(0), requires_grad=not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.empty.sum()


def _stage3_with_an_empty_parameter(rank, world, frozen):
    from distamp import fleet

    fleet.init()
    model = _EmptyParameter(frozen)
    strategy = _strategy(3, "off")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    try:
        wrapped = fleet.distributed_model(model, strategy)
    except ValueError as error:
        return str(error)
    x = torch.randn(PER_RANK, 5, generator=torch.Generator().manual_seed(rank))
    opt.backward(wrapped(x).pow(2).mean())
    return opt.step()


@pytest.mark.timeout(120)
def test_stage3_refuses_a_trainable_parameter_without_elements_before_sharding():
    """FSDP2 accepted it and failed in the first backward with "_chunk_cat expects non-empty tensor"; now
    fleet.distributed_model names it and the fixes, before any collective. Frozen, it trains."""
    for message in run_workers(_stage3_with_an_empty_parameter, 2, False, timeout=100):
        assert message == (
            "sharding stage 3: parameters ['empty'] have no elements; FSDP2's gradient reduce-scatter fails on "
            "them in the first backward (torch: '_chunk_cat expects non-empty tensor'). Remove them, register "
            "them as buffers, or set requires_grad=False on them before fleet.distributed_model (stages 1 and 2 "
            "train them).")
    assert run_workers(_stage3_with_an_empty_parameter, 2, True, timeout=100) == [True, True]


class _StridedWeights(nn.Module):
    """Three units of ``x * weight``: a contiguous weight, a ``channels_last`` one and a transposed one."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.Sequential(_Gain(), _Gain(), _Gain())
        self.units[1].weight = nn.Parameter(torch.ones(2, 3, 2, 2).to(memory_format=torch.channels_last))
        self.units[2].weight = nn.Parameter(torch.ones(3, 2).t())

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum((unit(x).sum() for unit, x in zip(self.units, xs, strict=True)), torch.zeros(()))


def _stage3_with_strided_parameters(rank, world):
    from torch.distributed.tensor import DTensor

    from distamp import fleet

    fleet.init()
    model = _StridedWeights()
    strategy = _strategy(3, "off")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    try:
        fleet.distributed_model(model, strategy)
    except ValueError as error:
        message = str(error)
    untouched = not any(isinstance(p, DTensor) for p in model.parameters())
    kept = model.units[1].weight.is_contiguous(memory_format=torch.channels_last)
    model.to(memory_format=torch.contiguous_format)  # the fixes the message names
    model.units[2].weight.data = model.units[2].weight.data.contiguous()
    wrapped = fleet.distributed_model(model, strategy)
    xs = [torch.full(p.shape, 2.0) for p in model.parameters()]
    opt.backward(wrapped(xs))
    applied = opt.step()
    return message, untouched, kept, applied, [p.full_tensor() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_stage3_refuses_non_contiguous_parameters_by_name_before_sharding():
    """torch's fully_shard raised NotImplementedError("FSDP does not support non-contiguous parameters yet")
    naming no parameter, after the start-up collectives and with the units before it already sharded into
    DTensors. fleet.distributed_model now names each one with the fix, and leaves the model as it was; with
    the fix applied it trains (the gradient is 2 everywhere: every weight becomes 1 - 0.5 * 2 = 0)."""
    for message, untouched, kept, applied, weights in run_workers(_stage3_with_strided_parameters, 2, timeout=100):
        assert message == (
            "sharding stage 3: parameters 'units.1.weight' (shape (2, 3, 2, 2), strides (12, 1, 6, 3)), "
            "'units.2.weight' (shape (2, 3), strides (1, 2)) are not contiguous (channels_last, or a transposed "
            "view); FSDP2 shards rows of contiguous parameters only (torch: 'FSDP does not support non-contiguous "
            "parameters'). Make them contiguous before fleet.distributed_model: model.to(memory_format="
            "torch.contiguous_format) for 4-d and 5-d weights, p.data = p.data.contiguous() for others (sharding "
            "off and PowerSGD train any memory format).")
        assert untouched, "the model was sharded before the refusal"
        assert kept, "the test needs the weight in channels_last"
        assert applied is True
        for weight in weights:
            assert torch.equal(weight, torch.zeros(weight.shape)), weight


def _strided_after_the_optimizer(rank, world, stage):
    from distamp import fleet

    fleet.init()
    model = _StridedWeights()
    model.to(memory_format=torch.contiguous_format)
    model.units[2].weight.data = model.units[2].weight.data.contiguous()
    strategy = _strategy(stage, "o2-bf16")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    model.to(memory_format=torch.channels_last)  # after the optimizer cut its slices
    model.units[2].weight.data = model.units[2].weight.data.t().contiguous().t()
    try:
        wrapped = fleet.distributed_model(model, strategy)
    except ValueError as error:
        return str(error)
    opt.backward(wrapped([torch.full(p.shape, 2.0) for p in model.parameters()]))
    return opt.step()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_refuse_parameters_made_non_contiguous_after_the_optimizer(stage):
    """fleet.distributed_optimizer refuses non-contiguous parameters (its slices are flat ranges of each one);
    a model moved to channels_last between it and fleet.distributed_model failed in the first step() with
    torch's "view size is not compatible with input tensor's size and stride". fleet.distributed_model now
    names the parameters and the fix, before any collective."""
    for message in run_workers(_strided_after_the_optimizer, 2, stage, timeout=100):
        assert message == (
            f"sharding stage {stage}: parameters 'units.1.weight' (shape (2, 3, 2, 2), strides (12, 1, 6, 3)), "
            "'units.2.weight' (shape (2, 3), strides (1, 2)) are not contiguous (channels_last, or a transposed "
            "view) although they were when fleet.distributed_optimizer cut them into slices, which are flat ranges "
            "of each parameter. Change the memory format before building the optimizer and keep it, or make them "
            "contiguous again: model.to(memory_format=torch.contiguous_format) for 4-d and 5-d weights, "
            "p.data = p.data.contiguous() for others (sharding off and PowerSGD train any memory format).")
