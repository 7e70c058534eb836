"""Lockstep under stress: 4 ranks, 500 steps, inf/NaN injected on random ranks.

A seeded schedule (the same on every rank) picks steps, a rank and a kind
of injection:

- before communication: NaN in that rank's input, or an infinite loss, so
  the all-reduce spreads non-finite gradients to every rank;
- after communication: inf written into one gradient of that rank only,
  after backward and before ``step()``, which only the found-inf flag sync
  can make the other ranks notice.

Every 50 steps each rank hashes its 16-bit parameters, FP32 masters, inner
optimizer state and loss scale, and the hashes are all-gathered: they must
be equal. The run must finish within the timeout (no hang), ``step()`` must
return False exactly at the injected steps, and the skip counter must equal
the number of injected steps.
"""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers

WORLD_SIZE = 4
STEPS = 500
CHECK_EVERY = 50
KINDS = ("input_nan", "loss_inf", "grad_inf_after_comm")


def injection_schedule(seed: int, steps: int, world_size: int) -> dict[int, tuple[int, str]]:
    """step -> (rank, kind), about one step in eight."""
    rng = random.Random(seed)
    return {
        step: (rng.randrange(world_size), rng.choice(KINDS))
        for step in range(steps)
        if rng.random() < 0.125
    }


def state_hash(model: nn.Module, optimizer) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for m in optimizer.master_weights.masters:
        digest.update(m.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for state in optimizer.inner_opt.state.values():
        for key in sorted(state):
            digest.update(torch.as_tensor(state[key]).reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(repr(optimizer.get_loss_scaling()).encode())
    return digest.hexdigest()


def _stress(rank, world_size, seed):
    import torch.distributed as dist

    from distamp import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    # Scale capped at 2**10 so that tiny-model gradients never overflow by
    # themselves: every skip must come from an injection.
    strategy.amp_configs = {
        "use_pure_fp16": True,
        "dtype": "float16",
        "init_loss_scaling": 1024.0,
        "max_loss_scaling": 1024.0,
        "incr_every_n_steps": 10,
        "decr_every_n_nan_or_inf": 1,
    }
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), strategy)
    model = fleet.distributed_model(model)

    schedule = injection_schedule(seed, STEPS, world_size)
    data = torch.Generator().manual_seed(1000 * seed + rank)
    skipped_at, hashes, scales = [], [], set()
    for step in range(STEPS):
        x = torch.randn(8, 8, generator=data)
        y = torch.randn(8, 4, generator=data)
        target_rank, kind = schedule.get(step, (-1, ""))
        mine = target_rank == rank
        if mine and kind == "input_nan":
            x[0, step % 8] = float("nan")
        with fleet.auto_cast():
            loss = F.mse_loss(model(x.half()).float(), y)
        if mine and kind == "loss_inf":
            loss = loss * float("inf")
        optimizer.zero_grad()
        optimizer.backward(loss)
        if mine and kind == "grad_inf_after_comm":
            params = [p for p in model.parameters() if p.grad is not None]
            grad = params[step % len(params)].grad
            grad.view(-1)[step % grad.numel()] = float("inf") if step % 2 else float("-inf")
        if not optimizer.step():
            skipped_at.append(step)
        scales.add(optimizer.get_loss_scaling())
        if (step + 1) % CHECK_EVERY == 0:
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, state_hash(model.module, optimizer))
            hashes.append(everyone)
    return skipped_at, optimizer.steps_skipped, optimizer.steps_applied, hashes, sorted(scales)


# About 15 s on an idle 2-core machine (up to ~50 s when other jobs share the
# cores), half of it spawning and tearing down the 4 ranks: not marked slow.
@pytest.mark.timeout(150)
def test_four_ranks_stay_in_lockstep_through_500_steps_of_injected_inf_and_nan():
    seed = 20261122
    out = run_workers(_stress, WORLD_SIZE, seed, timeout=140)
    schedule = injection_schedule(seed, STEPS, WORLD_SIZE)
    kinds = {kind for _, kind in schedule.values()}
    assert kinds == set(KINDS)
    assert len({r for r, _ in schedule.values()}) == WORLD_SIZE
    for skipped_at, skipped, applied, hashes, scales in out:
        assert skipped_at == sorted(schedule)
        assert skipped == len(schedule)
        assert applied == STEPS - len(schedule)
        assert len(hashes) == STEPS // CHECK_EVERY
        for everyone in hashes:
            assert len(set(everyone)) == 1, everyone
        assert hashes == out[0][3]
        assert min(scales) < 1024.0 == max(scales)  # the scale really moved, in step
