"""torch.compile of a sharded model (stages 1-3): the same numbers as eager, no graph break from distamp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import names_distamp, run_workers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _train(rank, stage, compiled):
    """Four O2 BF16 AdamW steps on this rank's batches; the losses and the FP32 model."""
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.sharding_configs = {"stage": stage}
    fleet.init(strategy=strategy)
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    forward = torch.compile(wrapped) if compiled else wrapped
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        with fleet.auto_cast():
            loss = F.mse_loss(forward(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, opt.fp32_state_dict(model)


def _eager_and_compiled(rank, world, stage):
    import torch._dynamo
    from torch._dynamo.utils import counters

    eager = _train(rank, stage, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled = _train(rank, stage, compiled=True)
    return eager, compiled, [reason for reason in counters["graph_break"] if names_distamp(reason)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_compiled_sharded_model_trains_bitwise_like_eager(stage):
    # Stage 1 used to fail here: its DDP buckets were smaller than DDP's first, which dynamo's DDPOptimizer refuses.
    for (eager_losses, eager_model), (losses, model), distamp_breaks in run_workers(
            _eager_and_compiled, 2, stage, timeout=280):
        assert losses == eager_losses
        assert eager_model.keys() == model.keys()
        for name, value in eager_model.items():
            assert torch.equal(model[name], value), name
        assert not distamp_breaks


def _stage3_compiled_first(rank, compile_first):
    """Stage 3, O2 FP16, units and custom_black_varnames by name, on a model compiled (or not) before fleet's
    calls: three steps, the third overflowing. The losses, the FP32 model and the optimizer's stats."""
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"dtype": "float16", "use_pure_fp16": True, "custom_black_varnames": ["3"],
                            "init_loss_scaling": 128.0}
    strategy.sharding_configs = {"stage": 3, "units": ["0"]}
    fleet.init(strategy=strategy)
    model = _model()
    given = torch.compile(model, backend="eager") if compile_first else model
    opt = fleet.distributed_optimizer(torch.optim.AdamW(given.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(given)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for scale in (1.0, 1.0, 1e6):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y) * scale
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses, opt.fp32_state_dict(wrapped), opt.stats()


def _eager_and_compiled_first(rank, world):
    import torch._dynamo

    eager = _stage3_compiled_first(rank, compile_first=False)
    torch._dynamo.reset()
    return eager, _stage3_compiled_first(rank, compile_first=True)


@pytest.mark.timeout(300)
def test_stage3_of_a_model_compiled_before_fleet_is_named_and_trains_bitwise_like_eager():
    """torch.compile(model) before fleet.distributed_model at stage 3: the units and black modules are named as
    in the model, the training is the eager model's bit for bit, and last_overflow names the model's parameters."""
    for (eager_losses, eager_model, eager_stats), (losses, model, stats) in run_workers(
            _eager_and_compiled_first, 2, timeout=280):
        assert losses == eager_losses
        assert model.keys() == eager_model.keys()
        for name, value in eager_model.items():
            assert torch.equal(model[name], value), name
        assert stats["steps_applied"] == eager_stats["steps_applied"] == 2
        assert stats["last_overflow"] == eager_stats["last_overflow"]
        assert stats["last_overflow"]["step"] == 3
        assert "0.weight" in stats["last_overflow"]["params"]
