"""Numerics you can debug: overflow attribution, check_nan_inf, step(closure) with overflow retries."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.optim import AmpOptimizer
from distamp.optim.overflow import SUGGEST_AFTER
from distamp.strategy import DistributedStrategy
from tests.multiprocess import run_workers


def _strategy(**amp_configs) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = amp_configs
    return strategy


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _train_step(model, opt, x, y, poison=None):
    from distamp.amp import auto_cast

    with auto_cast(dtype=opt.strategy.amp_config.dtype):
        loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    opt.backward(loss)
    if poison is not None:
        poison.grad.view(-1)[0] = float("inf")
    return opt.step()


def test_a_skipped_step_names_the_parameter_learnt_at_the_first_forward(caplog):
    model = Net()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    assert _train_step(model, opt, x, y)
    assert opt.stats()["last_overflow"] is None
    with caplog.at_level(logging.WARNING, logger="distamp"):
        assert not _train_step(model, opt, x, y, poison=model.head[1].bias)
    assert opt.stats()["last_overflow"] == {"step": 2, "params": ["head.1.bias"]}
    assert "step 2 skipped: non-finite gradients in head.1.bias" in caplog.text


def test_a_module_that_keeps_overflowing_gets_the_black_varnames_hint(caplog):
    model = Net()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for _ in range(SUGGEST_AFTER):
            assert not _train_step(model, opt, x, y, poison=model.body.weight)
    hints = [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()]
    assert hints == [
        (f"module 'body' had non-finite gradients in {SUGGEST_AFTER} skipped steps; if it keeps overflowing, "
         "run it in FP32: strategy.amp_configs = {..., 'custom_black_varnames': ['body']}")
    ]
    assert opt.stats()["overflows"] == SUGGEST_AFTER


def _attribution_on_two_ranks(rank, world_size):
    from distamp import fleet

    model = Net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    wrapped = fleet.distributed_model(model)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    seen = []
    # 1. Before communication, on rank 1 only: the all-reduce spreads it to every rank.
    hook = model.body.bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if rank else g)
    seen.append((_train_step(wrapped, opt, x, y), opt.stats()["last_overflow"]))
    hook.remove()
    # 2. After communication, on rank 0 only: the verdicts are all-reduced, so rank 1 names it too.
    seen.append((_train_step(wrapped, opt, x, y, poison=model.head[1].weight if rank == 0 else None),
                 opt.stats()["last_overflow"]))
    return seen, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.timeout(120)
def test_attribution_is_identical_on_every_rank():
    out = run_workers(_attribution_on_two_ranks, 2, timeout=100)
    for seen, params in out:
        assert seen == [
            (False, {"step": 1, "params": ["body.bias"]}),
            (False, {"step": 2, "params": ["head.1.weight"]}),
        ]
        assert torch.equal(params, out[0][1])


def test_check_nan_inf_names_the_module_and_the_parameter():
    from distamp import fleet

    model = Net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      _strategy(dtype="bfloat16", check_nan_inf=True))
    wrapped = fleet.distributed_model(model)
    x = torch.randn(3, 4)
    with fleet.auto_cast(), pytest.raises(
        FloatingPointError,
        match=r"^check_nan_inf: NaN in the forward output of module 'body' \(Linear\) on rank 0 at step 1, "
              r"dtype torch.bfloat16",
    ):
        wrapped(torch.full((3, 4), float("inf")))   # inf * w summed with -inf * w: NaN
    with fleet.auto_cast():
        loss = (wrapped(x) * 0).sqrt().sum()   # finite forward, non-finite gradient
    with pytest.raises(FloatingPointError, match=r"in the local gradient of parameter 'head.1.(weight|bias)' "
                                                 r"\(before communication\) on rank 0 at step 1"):
        opt.backward(loss)


def _inf_on_rank_one(rank, world_size):
    from distamp import fleet

    model = Net()
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(check_nan_inf=True))
    wrapped = fleet.distributed_model(model)
    x = torch.randn(3, 4)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        with fleet.auto_cast():
            wrapped(x)
    except FloatingPointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_check_nan_inf_raises_on_the_rank_that_produced_it():
    out = run_workers(_inf_on_rank_one, 2, timeout=100)
    assert out[0] is None
    assert "NaN in the forward output of module 'body' (Linear) on rank 1 at step 1" in out[1]


def _closure_steps(rank, world_size):
    from distamp import fleet

    strategy = _strategy(init_loss_scaling=2.0**40, max_loss_scaling=2.0**40, overflow_retries=40)
    model = Net()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), strategy)
    wrapped = fleet.distributed_model(model)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)) for _ in range(5)]
    losses = []
    for x, y in batches:
        def closure(x=x, y=y):
            opt.zero_grad()
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x), y)
            opt.backward(loss)
            return loss
        losses.append(float(opt.step(closure)))
    return opt.stats(), losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.timeout(120)
def test_step_closure_with_retries_applies_every_batch_in_lockstep():
    out = run_workers(_closure_steps, 2, timeout=100)
    for stats, losses, params in out:
        assert stats["steps_applied"] == 5
        assert stats["steps_skipped"] == 0
        assert stats["retries"] > 0
        assert stats["retries"] == out[0][0]["retries"]
        assert stats["loss_scale"] < 2.0**40
        assert all(torch.isfinite(torch.tensor(losses)))
        assert torch.equal(params, out[0][2])


def test_a_skipped_first_step_with_the_documented_scheduler_pattern_warns_nothing():
    model = Net()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            if _train_step(model, opt, x, y, poison=model.body.bias if step == 0 else None):
                scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
