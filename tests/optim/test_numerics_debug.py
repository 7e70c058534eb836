"""Numerics you can debug: overflow attribution, check_nan_inf, step(closure) with overflow retries."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.optim import AmpOptimizer
from distamp.scaling.overflow import SUGGEST_AFTER
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


def test_stats_last_overflow_is_a_copy_the_caller_may_change():
    model = Net()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    assert not _train_step(model, opt, x, y, poison=model.head[1].bias)
    seen = opt.stats()["last_overflow"]
    seen["params"].append("mine")
    seen["step"] = 99
    assert opt.stats()["last_overflow"] == {"step": 1, "params": ["head.1.bias"]}


@pytest.mark.parametrize("pure", [False, True])
def test_an_inf_from_an_earlier_micro_batch_of_a_merge_window_is_named(pure):
    # O2 moves a window's earlier micro-batches into an FP32 sum that .grad does not show: the skipped
    # step used to name no parameter ("non-finite gradients in no parameter").
    model = Net()
    strategy = _strategy(dtype="bfloat16", use_pure_fp16=pure)
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    from distamp.amp import auto_cast

    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with auto_cast(dtype="bfloat16"):
        loss = F.mse_loss(model(x), y)
    opt.backward(loss + model.head[1].bias.float().sum() * float("inf"))  # micro-batch 1 of 2: in the window
    assert not opt.step()
    assert not _train_step(model, opt, x, y)
    assert opt.step_was_skipped
    assert opt.stats()["last_overflow"] == {"step": 1, "params": ["head.1.bias"]}


def test_a_module_that_keeps_overflowing_gets_the_black_varnames_hint(caplog):
    model = Net()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype="bfloat16"))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for _ in range(SUGGEST_AFTER):
            assert not _train_step(model, opt, x, y, poison=model.body.weight)
    hints = [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()]
    assert hints == [
        (f"module 'body' had non-finite gradients in {SUGGEST_AFTER} skipped steps at a loss scale that could not "
         "go lower (1); if it keeps overflowing, run it in FP32: strategy.amp_configs = {..., "
         "'custom_black_varnames': ['body']}")
    ]
    assert opt.stats()["overflows"] == SUGGEST_AFTER


def _hints_with_a_huge_initial_scale(caplog, steps: int, **amp_configs) -> tuple[list[str], AmpOptimizer]:
    model = Net()
    strategy = _strategy(dtype="float16", init_loss_scaling=2.0**24, **amp_configs)
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        for _ in range(steps):
            _train_step(model, opt, torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g))
    return [r.getMessage() for r in caplog.records if "custom_black_varnames" in r.getMessage()], opt


def test_overflows_while_a_too_high_scale_backs_off_blame_no_module(caplog):
    """init_loss_scaling 2**24: the scale is the cause, and it falls until the steps fit; no module is named."""
    hints, opt = _hints_with_a_huge_initial_scale(caplog, steps=30)
    assert opt.steps_skipped >= 2 * SUGGEST_AFTER  # every one named the model's parameters
    assert opt.steps_applied > 0
    assert opt.get_loss_scaling() <= 2.0**17
    assert hints == []


def test_overflows_that_go_on_once_the_scale_stopped_falling_get_the_module_hint(caplog):
    """The scale stops at min_loss_scaling 2**22, where every step still overflows: now the modules are named."""
    steps = 4 + SUGGEST_AFTER  # 4 overflows lower the scale 2**24 -> 2**22, then SUGGEST_AFTER at the minimum
    hints, opt = _hints_with_a_huge_initial_scale(caplog, steps=steps, min_loss_scaling=2.0**22)
    assert opt.steps_applied == 0
    assert opt.get_loss_scaling() == 2.0**22
    assert hints == [
        (f"module {module!r} had non-finite gradients in {SUGGEST_AFTER} skipped steps at a loss scale that could "
         f"not go lower (4.1943e+06); if it keeps overflowing, run it in FP32: strategy.amp_configs = {{..., "
         f"'custom_black_varnames': [{module!r}]}}")
        for module in ("body", "head.1")
    ]
    messages = [r.getMessage() for r in caplog.records]
    first_hint = messages.index(hints[0])
    assert messages[first_hint - 1].startswith(f"step {steps} skipped")  # not before the last step


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
    _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(check_nan_inf=True))
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


class Branches(nn.Module):
    """A body and an extra branch whose gradient turns NaN (finite forward) when ``poison`` is set."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)
        self.poison = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        extra = self.extra(x)
        if self.poison:
            extra = extra + (extra * 0).sqrt()   # forward 0, gradient inf * 0 = NaN in extra only
        return self.body(x), extra


def _check_nan_inf_with_find_unused_and_an_unused_output(rank, world_size, stage):
    from distamp import fleet

    strategy = _strategy(dtype="bfloat16", check_nan_inf=True)
    strategy.find_unused_parameters = True
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    model = Branches()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model)
    applied = []
    for _ in range(2):
        with fleet.auto_cast():
            body, _ = wrapped(torch.randn(3, 4))
            loss = body.float().pow(2).mean()   # the extra output is not used
        opt.zero_grad()
        opt.backward(loss)
        applied.append(opt.step())
    return applied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 1])
def test_check_nan_inf_with_find_unused_parameters_and_an_output_the_loss_does_not_use(stage):
    # Was: AttributeError ('NoneType' object has no attribute 'is_floating_point') in backward: DDP's sink
    # hands the unused output's None gradient to the check's hook.
    out = run_workers(_check_nan_inf_with_find_unused_and_an_unused_output, 2, stage, timeout=100)
    assert out == [[True, True], [True, True]]


def _unfrozen_at_stage_3(rank, world_size):
    from distamp import fleet

    strategy = _strategy(dtype="bfloat16", check_nan_inf=True)
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 3}
    model = Branches()
    for p in model.extra.parameters():
        p.requires_grad_(False)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model)

    def step() -> bool:
        with fleet.auto_cast():
            body, extra = wrapped(torch.randn(3, 4))
            loss = (body + extra).float().pow(2).mean()
        opt.zero_grad()
        opt.backward(loss)
        return opt.step()

    assert step()
    for p in model.extra.parameters():
        p.requires_grad_(True)
    assert step()
    model.poison = True
    try:
        step()
    except FloatingPointError as exc:
        return str(exc)
    return opt.stats()["last_overflow"]


@pytest.mark.timeout(120)
def test_check_nan_inf_checks_a_layer_unfrozen_during_training_at_stage_3():
    # Was: the unfrozen layer had no gradient hook, so its NaN was only a skipped step.
    for rank, message in enumerate(run_workers(_unfrozen_at_stage_3, 2, timeout=100)):
        assert isinstance(message, str), message
        # The dtype is the gradient's as the parameter's hook gets it: FP32 on torch 2.13; on 2.15 the hook on
        # FSDP2's unsharded FP32 parameter gets autocast's BF16 gradient, before its cast (measured).
        assert re.match(rf"check_nan_inf: NaN in the local gradient of parameter 'extra\.(weight|bias)' \(before "
                        rf"communication\) on rank {rank} at step 3, dtype torch\.(float32|bfloat16)", message), message
