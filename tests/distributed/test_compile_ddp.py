"""torch.compile of the data-parallel wrapper: 16-bit like torch.autocast, no graph break from distamp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 4))


def _train(compiled, step) -> torch.dtype:
    dtype = None
    for _ in range(3):
        dtype = step(compiled)
    return dtype


def _compiled_runs(rank, world_size):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model)

    def distamp_step(compiled):
        with fleet.auto_cast():
            out = compiled(torch.randn(4, 8))
            loss = F.mse_loss(out.float(), torch.zeros(4, 4))
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
        return out.dtype

    ours = _train(torch.compile(wrapped), distamp_step)
    ours_breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    counters.clear()
    native = DistributedDataParallel(_model())
    native_opt = torch.optim.SGD(native.parameters(), lr=0.1)

    def native_step(compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(torch.randn(4, 8))
            loss = F.mse_loss(out.float(), torch.zeros(4, 4))
        native_opt.zero_grad()
        loss.backward()
        native_opt.step()
        return out.dtype

    theirs = _train(torch.compile(native), native_step)
    return ours, ours_breaks, theirs, sum(counters["graph_break"].values())


@pytest.mark.timeout(240)
def test_compiled_distributed_model_breaks_no_more_than_compiled_ddp():
    for ours, ours_breaks, theirs, theirs_count in run_workers(_compiled_runs, 2, timeout=220):
        assert ours == theirs == torch.bfloat16
        assert not [reason for reason in ours_breaks if "distamp" in reason], ours_breaks
        assert sum(ours_breaks.values()) <= theirs_count
