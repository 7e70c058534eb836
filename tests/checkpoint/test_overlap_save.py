"""save_checkpoint with ``overlap_param_gather``: every rank finishes every gather the model's hooks know.

Two ranks train a model with two distamp optimizers (AdamW over disjoint
parameters, O2 BF16, sharding stage 1 or 2), both attached by
``fleet.distributed_model``, on gathers of many small rounds in collective
rounds (NCCL's path, forced on gloo). After ``step()`` both gathers are
left running. Rank 0 alone builds the common payload from the model's
``state_dict()``, whose pre-hook finishes every attached optimizer's
gather: unless every rank finished them first, rank 0 waits in rounds the
other rank never joins. Each save must hold, bitwise, the parameters of a
run without overlap.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import _flat, _strategy

D, PER_RANK = 16, 2


def _build(stage: int, overlap: bool):
    """Model, wrapped model and its two distamp optimizers (first and last layer), gathers in collective rounds."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4 * D), nn.Tanh(), nn.Linear(4 * D, D))
    strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
    strategy.fuse_grad_size_in_MB = 0.0002  # the gathers run in many rounds of 200 bytes, one at a time
    first = fleet.distributed_optimizer(torch.optim.AdamW(model[0].parameters(), lr=1e-2), strategy)
    last = fleet.distributed_optimizer(torch.optim.AdamW(model[2].parameters(), lr=1e-2), strategy)
    for opt in (first, last):
        opt.master_weights.gather.pairwise = False  # collective rounds, as on NCCL (gloo's default is pairwise)
    return model, fleet.distributed_model(model, strategy), first, last


def _step(rank, world, wrapped, optimizers, g):
    from distamp import fleet

    x = torch.randn(PER_RANK * world, D, generator=g)[rank * PER_RANK:(rank + 1) * PER_RANK]
    with fleet.auto_cast():
        loss = wrapped(x).float().square().mean()
    for opt in optimizers:
        opt.zero_grad()
    optimizers[0].backward(loss)
    for opt in optimizers:
        assert opt.step()


def _saved_model(path: str) -> torch.Tensor:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    return torch.cat([v.float().reshape(-1) for v in payload["model"].values()])


def _save_after_step(rank, world, root):
    """Per (stage, overlap): the model as each save wrote it, whether a gather ran on after it, the final model.

    The first save is given one of the two distamp optimizers, the second an optimizer distamp does not know
    (``save_checkpoint`` takes any ``torch.optim.Optimizer``; here the first one's inner optimizer).
    """
    from distamp.checkpoint import save_checkpoint

    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            model, wrapped, first, last = _build(stage, overlap)
            g = torch.Generator().manual_seed(1)
            saved, running = [], []
            for step, optimizer in ((2, first), (3, first.inner_opt)):
                while first.steps_applied < step:
                    _step(rank, world, wrapped, (first, last), g)
                where = os.path.join(root, f"stage{stage}-overlap{overlap}-{type(optimizer).__name__}")
                path = save_checkpoint(where, step, model=wrapped, optimizer=optimizer, timeout=30)
                saved.append(_saved_model(path))
                running.append([opt.master_weights.gather_running for opt in (first, last)])
            out[stage, overlap] = {"saved": saved, "running": running, "params": _flat(model)}
    return out


@pytest.mark.timeout(150)
def test_a_save_right_after_step_finishes_every_attached_optimizers_gather_on_every_rank(tmp_path):
    """Was: with an optimizer that is not distamp's, nothing finished the model's gathers on every rank; rank 0's
    model.state_dict() (building the payload alone) finished them on rank 0 only and waited there for rounds rank 1
    never launched, while rank 1 waited for rank 0 on the store: the save timed out. With two distamp optimizers it
    worked only because the stage-3 check happened to take the model's state_dict() on every rank."""
    results = run_workers(_save_after_step, 2, str(tmp_path), timeout=130)
    for rank, out in enumerate(results):
        for stage in (1, 2):
            plain, overlapped = out[stage, False], out[stage, True]
            assert overlapped["running"] == [[False, False]] * 2, (rank, stage)
            for ours, theirs in zip(overlapped["saved"], plain["saved"], strict=True):
                assert torch.equal(ours, theirs), (rank, stage)
            assert torch.equal(overlapped["params"], plain["params"]), (rank, stage)
            assert torch.equal(overlapped["params"], results[0][stage, True]["params"]), (rank, stage)
