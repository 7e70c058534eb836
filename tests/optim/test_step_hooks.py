"""Step hooks on the optimizer distamp returns fire once per applied step, with the param groups whole.

O2 and the sharded stages step the inner optimizer a chunk at a time; torch's
step hooks (``register_step_pre_hook`` / ``register_step_post_hook`` and the
global ones) must still see one step, as around ``torch.optim``'s own
``step()``: an EMA, a step counter or a logger registered there would
otherwise run once per chunk on a part of the model. A skipped step runs no
hook, as GradScaler's skipped ``optimizer.step()`` runs none.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers

STEPS = 3
SKIPPED = 1  # the iteration whose loss is inf on rank 0: skipped on every rank


def _train(rank: int, world: int, stage: int, pure: bool) -> dict:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from distamp import fleet

    torch.manual_seed(0)
    # 4 x 256 x 256 weights: O2's chunked update cuts this into several chunks (1/16 of the model each).
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256),
                          nn.ReLU(), nn.Linear(256, 10))
    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": pure}
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), strategy)
    model = fleet.distributed_model(model)
    calls: list[tuple[str, int]] = []

    def elements(o: torch.optim.Optimizer) -> int:
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                   for group in o.param_groups for p in group["params"])

    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", elements(o))))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", elements(o))))
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", elements(o)))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", elements(o))))]
    g = torch.Generator().manual_seed(rank)
    applied = []
    for i in range(STEPS):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        with fleet.auto_cast():
            loss = F.cross_entropy(model(x), y)
        if i == SKIPPED and rank == 0:
            loss = loss * float("inf")
        opt.zero_grad()
        opt.backward(loss)
        applied.append(opt.step())
    for handle in handles:
        handle.remove()
    return {"calls": calls, "applied": applied, "elements": elements(opt.inner_opt)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "stage", "pure"),
                         [(1, 0, False), (1, 0, True), (2, 0, True), (2, 1, True), (2, 2, True), (2, 3, True),
                          (2, 3, False)])
def test_step_hooks_fire_once_per_applied_step_with_the_whole_param_groups(world, stage, pure):
    out = run_workers(_train, world, stage, pure, timeout=180)
    for rank in range(world):
        result = out[rank]
        assert result["applied"] == [i != SKIPPED for i in range(STEPS)]
        n = result["elements"]  # what this rank's inner optimizer holds: all, or its slice or shards
        one_step = [("global pre", n), ("pre", n), ("post", n), ("global post", n)]
        assert result["calls"] == one_step * (STEPS - 1)
