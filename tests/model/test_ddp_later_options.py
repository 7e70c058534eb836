"""DDP's later bucket options (``batched_grad_copy``, torch 2.13; ``lazy_bucket_allocation``, torch 2.15) under
distamp's comm hooks: with sharding off and at stage 1 they change how DDP fills its buckets, never the numbers.

distamp builds DDP with ``gradient_as_bucket_view=True`` and hooks it (the 16-bit all-reduce, gradient merge's
FP32 window sum added into the bucket, PowerSGD, stage 1's reduce-scatter); each case trains on 2 gloo ranks with
and without the option and must be bitwise the same. Skipped where the installed torch's DDP lacks the option.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers

CASES = ("o1", "o2", "o2-merge-2", "no_sync", "powersgd", "stage-1", "channels_last")
STEPS = 3


def _ddp_takes(name: str) -> bool:
    return name in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _strategy(case: str):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": case.startswith("o2") or case == "stage-1", "init_loss_scaling": 64.0}
    strategy.fuse_grad_size_in_MB = 2**-12  # 256-byte buckets: several per backward
    if case == "o2-merge-2":
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 2}
    if case == "powersgd":
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": 1, "start_step": 0, "min_compression_rate": 1.0}
    if case == "stage-1":
        strategy.sharding = True
        strategy.sharding_configs = {"stage": 1}
    return strategy


def _train_case(rank: int, case: str, options: dict[str, bool]) -> tuple[dict[str, torch.Tensor], int, bool]:
    """Train ``case`` (channels_last: STEPS steps, else STEPS rounds of 2 micro-batches); the FP32 state at the
    end, the steps applied, and whether DDP got the options."""
    from distamp import fleet
    from tests.distributed.test_memory_formats import LR, _Gains, _inputs

    if case == "channels_last":  # a channels_last conv weight and a transposed one, O1 (stages 1-3 refuse them)
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"init_loss_scaling": 8.0}
        model = _Gains(strided=True)
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=LR), strategy)
        wrapped = fleet.distributed_model(model, strategy, **options)
        for step in range(STEPS):
            opt.zero_grad()
            with fleet.auto_cast():
                loss = wrapped(_inputs(rank, step))
            opt.backward(loss)
            opt.step()
        return _outcome(opt, wrapped, options)
    strategy = _strategy(case)
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy, **options)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            quiet = case == "no_sync" and micro == 0
            with wrapped.no_sync() if quiet else contextlib.nullcontext():
                with fleet.auto_cast():
                    loss = F.mse_loss(wrapped(x), y)
                opt.backward(loss)
            if case != "no_sync" and case != "o2-merge-2":
                opt.step()
                opt.zero_grad()
        if case in ("no_sync", "o2-merge-2"):
            opt.step()
    return _outcome(opt, wrapped, options)


def _outcome(opt, wrapped, options: dict[str, bool]) -> tuple[dict[str, torch.Tensor], int, bool]:
    state = {k: v.clone() for k, v in opt.fp32_state_dict(wrapped).items()}
    return state, opt.steps_applied, all(getattr(wrapped.ddp, k) == v for k, v in options.items())


def _with_and_without(rank: int, world_size: int, name: str) -> dict[str, tuple[dict, dict]]:
    from distamp import fleet

    fleet.init()
    return {case: (_train_case(rank, case, {}), _train_case(rank, case, {name: True})) for case in CASES}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["batched_grad_copy", "lazy_bucket_allocation"])
def test_ddps_later_bucket_options_train_bitwise_as_without_under_distamps_hooks(name):
    if not _ddp_takes(name):
        pytest.skip(f"the installed torch's DDP has no {name}")
    initial = {k: v.float() for k, v in _model().state_dict().items()}
    for rank, out in enumerate(run_workers(_with_and_without, 2, name, timeout=360)):
        for case, ((plain, plain_steps, _), (optioned, steps, taken)) in out.items():
            assert taken, (case, f"DDP was not given {name}")
            assert steps == plain_steps > 0, (rank, case)
            assert plain.keys() == optioned.keys(), (rank, case)
            for key, value in plain.items():
                assert torch.equal(optioned[key], value), (rank, case, key)
                if case != "channels_last":
                    assert not torch.equal(value, initial[key]), (rank, case, key)  # it trained
