"""Gradient merge in O2 sums the micro-batches in FP32, not in the 16-bit ``.grad``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp.auto_cast import auto_cast
from distamp.core.grad_accumulator import Fp32GradAccumulator
from distamp.optim.optimizer import AmpOptimizer
from distamp.strategy import DistributedStrategy

K = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)) for _ in range(K)]


def _optimizer(model: nn.Module, amp: bool = True, merge: bool = False) -> AmpOptimizer:
    strategy = DistributedStrategy(amp=amp)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if merge:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": K}
    return AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)


def _merged_gradient(merge: bool, amp: bool = True) -> torch.Tensor:
    """The FP32 master gradient the step would apply after K micro-batches."""
    model = _model()
    opt = _optimizer(model, amp, merge)
    for x, y in _micro_batches():
        with auto_cast(enable=amp, dtype="bfloat16"):
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss if merge else loss / K)  # gradient merge divides by K itself
    opt.unscale_()
    return torch.cat([m.grad.double().reshape(-1) for m in opt.master_weights.masters])


def _exact_sum_of_micro_batch_gradients() -> torch.Tensor:
    """Each micro-batch's BF16 gradient on its own, summed in float64."""
    model = _model()
    opt = _optimizer(model)
    total = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    for x, y in _micro_batches():
        opt.zero_grad()
        with auto_cast(dtype="bfloat16"):
            loss = F.mse_loss(model(x).float(), y)
        opt.backward(loss / K)
        total += torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
    return total


def test_k8_bf16_merge_in_fp32_is_closer_to_the_fp32_references_than_16_bit_accumulation():
    """O2 BF16, K=8. Relative L2 error of the merged gradient (measured on torch 2.13 CPU):

    ==============================================  ===============  ====================
    reference                                       FP32 accumulator  16-bit ``.grad`` sum
    ==============================================  ===============  ====================
    the same BF16 micro-batch gradients, float64    0 (exact)         3.5e-3
    an FP32 model (AMP off) with gradient merge     3.6e-3            5.0e-3
    ==============================================  ===============  ====================

    The 16-bit sum is what gradient merge did before (autograd accumulates in
    the parameter's dtype); it is reproduced here by K plain backward calls.
    Against the FP32 model both carry the BF16 forward's error; the 16-bit
    sum adds its own on top.
    """
    fp32_accumulated, bf16_accumulated = _merged_gradient(merge=True), _merged_gradient(merge=False)
    errors = {}
    for name, reference in (("exact", _exact_sum_of_micro_batch_gradients()),
                            ("fp32 model", _merged_gradient(merge=True, amp=False))):
        errors[name] = tuple(float((g - reference).norm() / reference.norm())
                             for g in (fp32_accumulated, bf16_accumulated))
    print(f"relative error (FP32 accumulator, 16-bit accumulation): {errors}")
    assert errors["exact"][0] < 1e-6, errors
    assert errors["exact"][1] > 1e-3, errors
    assert errors["fp32 model"][0] < errors["fp32 model"][1], errors


def test_accumulator_holds_only_16_bit_parameters_and_starts_each_window_afresh():
    low = nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    full = nn.Parameter(torch.ones(2))
    acc = Fp32GradAccumulator([low, full])
    assert acc.nbytes == 0
    assert acc.take() is None
    low.grad = torch.full((3,), 0.5, dtype=torch.bfloat16)
    full.grad = torch.ones(2)
    acc.add_and_zero()
    acc.add_and_zero()  # second micro-batch: zero gradient
    low.grad.fill_(0.25)
    acc.add_and_zero()
    assert acc.nbytes == 3 * 4  # FP32 parameters accumulate in their own FP32 .grad
    assert torch.equal(low.grad, torch.zeros(3, dtype=torch.bfloat16))
    assert torch.equal(full.grad, torch.ones(2))
    assert torch.equal(acc.take()[id(low)], torch.full((3,), 0.75))
    acc.consumed = True  # a comm hook added it
    assert acc.take() is None
    acc.reset()
    low.grad.fill_(1.0)
    acc.add_and_zero()
    assert torch.equal(acc.take()[id(low)], torch.ones(3))
