"""Sharded checkpoints on real processes: one part per rank, re-sliced on load at any world size.

Two ranks train O2 BF16 AdamW (two param groups, a StepLR) unsharded, with
stage 1 and with stage 2, save at step 3 and go on to step 6. The same
world size resumes each bitwise; one rank and four ranks resume them into
other sharding settings (unsharded <-> sharded in both directions) and end
within BF16 rounding of the uninterrupted run: the global batch is the same,
but its gradient is summed over another number of ranks.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import (
    _flat,
    _model,
    _strategy,
    assert_within_bf16_rounding,
)

GLOBAL, SAVE_AT, END = 8, 3, 6


def _build(stage: int, pure: bool = True, sgd: bool = False):
    """Model, wrapped model, BF16 optimizer (O2 or O1; AdamW or SGD with momentum, two param groups), StepLR."""
    from distamp import fleet

    fleet.init()
    model = _model()
    strategy = _strategy(stage, use_pure_fp16=pure, dtype="bfloat16")
    groups = [{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:], "lr": 5e-3}]
    inner = torch.optim.SGD(groups, lr=1e-2, momentum=0.9) if sgd else torch.optim.AdamW(groups, lr=1e-2)
    opt = fleet.distributed_optimizer(inner, strategy)
    wrapped = fleet.distributed_model(model, strategy)
    return model, wrapped, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(rank, world, wrapped, opt, scheduler, first, last):
    from distamp import fleet

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 3, generator=g)) for _ in range(END)]
    n = GLOBAL // world
    for x, y in data[first:last]:
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x[rank * n:(rank + 1) * n]).float(), y[rank * n:(rank + 1) * n])
        opt.zero_grad()
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        assert opt.step()
        scheduler.step()


def _save_and_resume_at_the_same_size(rank, world, root, stages=(0, 1, 2), readout=None):
    """Per stage: (uninterrupted, resumed) after END steps, read by ``readout(model, wrapped, opt)``."""
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    readout = readout or (lambda model, wrapped, opt: _flat(model))
    out = {}
    for stage in stages:
        model, wrapped, opt, scheduler = _build(stage)
        _train(rank, world, wrapped, opt, scheduler, 0, SAVE_AT)
        save_checkpoint(os.path.join(root, f"stage{stage}"), SAVE_AT, model=wrapped, optimizer=opt,
                        scheduler=scheduler)
        _train(rank, world, wrapped, opt, scheduler, SAVE_AT, END)
        model2, wrapped2, opt2, scheduler2 = _build(stage)
        info = load_latest_checkpoint(os.path.join(root, f"stage{stage}"), model=wrapped2, optimizer=opt2,
                                      scheduler=scheduler2)
        assert info.step == SAVE_AT
        assert info.rng_restored
        _train(rank, world, wrapped2, opt2, scheduler2, SAVE_AT, END)
        out[stage] = (readout(model, wrapped, opt), readout(model2, wrapped2, opt2))
    return out


@contextlib.contextmanager
def recording_reads():
    """Yields the list of the parts this rank reads (``load._load`` calls) while inside."""
    from distamp.checkpoint import load

    read: list[str] = []
    original = load._load

    def recording(path, manifest, part, check):
        read.append(part)
        return original(path, manifest, part, check)

    load._load = recording
    try:
        yield read
    finally:
        load._load = original


def _resume(rank, world, root, plan):
    from distamp.checkpoint import load_latest_checkpoint

    out = {}
    with recording_reads() as read:  # which parts this rank reads
        for saved, stage in plan:
            read.clear()
            model, wrapped, opt, scheduler = _build(stage)
            info = load_latest_checkpoint(os.path.join(root, f"stage{saved}"), model=wrapped, optimizer=opt,
                                          scheduler=scheduler)
            assert info.step == SAVE_AT
            assert info.world_size == 2
            assert [g["lr"] for g in opt.param_groups] == [5e-3, 2.5e-3]  # the scheduler's state came back
            _train(rank, world, wrapped, opt, scheduler, SAVE_AT, END)
            out[saved, stage] = (_flat(model), sorted(read))
    return out


@pytest.mark.timeout(300)
def test_stage_1_and_2_checkpoints_from_two_ranks_resume_on_two_one_and_four(tmp_path):
    saved = run_workers(_save_and_resume_at_the_same_size, 2, str(tmp_path), timeout=120)
    for stage in (0, 1, 2):
        uninterrupted, resumed = saved[0][stage]
        assert torch.equal(resumed, uninterrupted), stage  # same world size and layout: bitwise
        assert torch.equal(saved[1][stage][0], uninterrupted)
    names = sorted(os.listdir(tmp_path / "stage2"))
    assert [n.split(".")[1] for n in names if n.endswith(".pt")] == ["common", "rank-00000", "rank-00001"]
    assert [n.split(".")[1] for n in sorted(os.listdir(tmp_path / "stage0")) if n.endswith(".pt")] == ["common"]

    # (saved with, resumed with): sharded -> unsharded, unsharded -> sharded, stage 1 <-> stage 2.
    plan = [(1, 0), (2, 2), (0, 1)]
    one = run_workers(_resume, 1, str(tmp_path), plan, timeout=120)[0]
    plan4 = [(1, 2), (2, 1), (0, 2)]
    four = run_workers(_resume, 4, str(tmp_path), plan4, timeout=200)
    for results, world_plan in ((one, plan), *((r, plan4) for r in four)):
        for saved_stage, stage in world_plan:
            assert_within_bf16_rounding(results[saved_stage, stage][0], saved[0][saved_stage][0])
    for key in plan4:
        assert all(torch.equal(r[key][0], four[0][key][0]) for r in four)
    # Each rank reads the common part and only the saved slices that overlap its own.
    assert one[1, 0][1] == ["common", "rank-00000", "rank-00001"]
    assert [r[2, 1][1] for r in four] == [["common", "rank-00000"]] * 2 + [["common", "rank-00001"]] * 2
    assert [r[0, 2][1] for r in four] == [["common"]] * 4  # an unsharded checkpoint has everything in common
