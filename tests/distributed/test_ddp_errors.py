"""DDP's "marked as ready twice" error, re-raised by optimizer.backward with the fixes a distamp user has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distamp.distributed.ddp_errors import explain_ddp_errors
from tests.multiprocess import run_workers


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(lambda t: F.relu(self.inner(t)), x, use_reentrant=True)
        return self.head(x)


def _train(rank: int, world: int, static_graph: bool) -> str:
    from distamp import fleet

    torch.manual_seed(0)
    model = _Checkpointed()
    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    strategy.find_unused_parameters = True
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    model = fleet.distributed_model(model, strategy, **({"static_graph": True} if static_graph else {}))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    try:
        for _ in range(2):
            with fleet.auto_cast():
                loss = model(x).float().square().mean()
            opt.zero_grad()
            opt.backward(loss)
            opt.step()
    except RuntimeError as exc:
        return f"{exc!s} [cause: {type(exc.__cause__).__name__}]"
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_reentrant_checkpointing_with_find_unused_parameters_names_the_fixes_and_static_graph_is_one():
    failed = run_workers(_train, 2, False, timeout=100, pg_timeout=60)
    for message in failed:
        assert message.startswith("DDP's reducer got a gradient for the same parameter twice in one backward")
        for fix in ("use_reentrant=False", "fleet.distributed_model(model, static_graph=True)",
                    "strategy.find_unused_parameters=False", "sharding stage 2"):
            assert fix in message
        assert "torch: Expected to mark a variable ready only once" in message
        assert message.endswith("[cause: RuntimeError]")  # torch's error chained
    assert run_workers(_train, 2, True, timeout=100, pg_timeout=60) == ["trained", "trained"]


def test_other_errors_pass_through_unchanged():
    error = RuntimeError("something else")
    with pytest.raises(RuntimeError) as caught, explain_ddp_errors():
        raise error
    assert caught.value is error


def _first_backward_in_no_sync(rank: int, world: int) -> str:
    """DDP with static_graph=True whose first backward runs inside no_sync(): torch's internal assert."""
    from distamp import fleet

    torch.manual_seed(0)
    model = _Checkpointed()
    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16"}
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    model = fleet.distributed_model(model, strategy, static_graph=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        with model.no_sync():
            with fleet.auto_cast():
                loss = model(x).float().square().mean()
            opt.backward(loss)
    except RuntimeError as exc:
        return f"{exc!s} [cause: {type(exc.__cause__).__name__}]"
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_static_graph_whose_first_backward_does_not_communicate_names_the_fix():
    # torch's DDP records its static graph on the first backward, which must communicate; inside no_sync()
    # the user got only "expect_autograd_hooks_ INTERNAL ASSERT FAILED ... please report a bug to PyTorch".
    for message in run_workers(_first_backward_in_no_sync, 2, timeout=100, pg_timeout=60):
        assert message.startswith("fleet.distributed_model(..., static_graph=True): DDP records its static graph "
                                  "on the first backward, which must communicate")
        assert "no_sync()" in message
        assert "torch: expect_autograd_hooks_ INTERNAL ASSERT FAILED" in message
        assert message.endswith("[cause: RuntimeError]")
