"""Stage 3 checkpoints: whole tensors, as unsharded, so they resume at any world size, sharded or not.

Two ranks train O2 BF16 AdamW (two param groups, a StepLR) unsharded, with
stage 2 and with stage 3, save at step 3 and go on to step 6. Two ranks
resume each bitwise at its own stage; one rank unsharded and four ranks at
stage 3 resume the stage-3 checkpoint, and two ranks resume unsharded and
stage-2 checkpoints at stage 3 and the stage-3 one at stage 2, within BF16
rounding of the uninterrupted run (the global batch is the same; its
gradient is summed over another number of ranks, or in another order).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checkpoint.test_sharded_checkpoint import END, SAVE_AT, _build, _save_and_resume_at_the_same_size, _train
from tests.distributed.test_sharding import assert_within_bf16_rounding
from tests.multiprocess import run_workers


def _fp32(wrapped, opt) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in opt.fp32_state_dict(wrapped).values()])


def _exported(model, wrapped, opt) -> torch.Tensor:
    return _fp32(wrapped, opt)


def _resume(rank, world, root, plan):
    from distamp.checkpoint import load_latest_checkpoint

    out = {}
    for saved, stage in plan:
        _, wrapped, opt, scheduler = _build(stage)
        info = load_latest_checkpoint(os.path.join(root, f"stage{saved}"), model=wrapped, optimizer=opt,
                                      scheduler=scheduler)
        assert info.step == SAVE_AT
        assert [g["lr"] for g in opt.param_groups] == [5e-3, 2.5e-3]  # the scheduler's state came back
        _train(rank, world, wrapped, opt, scheduler, SAVE_AT, END)
        out[saved, stage] = _fp32(wrapped, opt)
    return out


@pytest.mark.timeout(300)
def test_stage3_checkpoint_resumes_bitwise_at_two_ranks_and_within_bf16_on_one_and_four(tmp_path):
    saved = run_workers(_save_and_resume_at_the_same_size, 2, str(tmp_path), (0, 2, 3), _exported, timeout=150)
    for stage in (0, 2, 3):
        uninterrupted, resumed = saved[0][stage]
        assert torch.equal(resumed, uninterrupted), stage
        assert torch.equal(saved[1][stage][1], uninterrupted)
    payloads = [n.split(".")[1] for n in sorted(os.listdir(tmp_path / "stage3")) if n.endswith(".pt")]
    assert payloads == ["common", "rank-00000", "rank-00001"]  # each rank writes its own shards

    (one,) = run_workers(_resume, 1, str(tmp_path), [(3, 0), (3, 3)], timeout=120)
    four = run_workers(_resume, 4, str(tmp_path), [(3, 3)], timeout=200)
    two = run_workers(_resume, 2, str(tmp_path), [(0, 3), (2, 3), (3, 2)], timeout=150)
    assert_within_bf16_rounding(one[3, 0], saved[0][3][0])  # 2-rank stage 3 -> 1 rank unsharded
    assert_within_bf16_rounding(one[3, 3], saved[0][3][0])
    for r in four:
        assert_within_bf16_rounding(r[3, 3], saved[0][3][0])
        assert torch.equal(r[3, 3], four[0][3, 3])
    for r in two:
        assert_within_bf16_rounding(r[0, 3], saved[0][0][0])  # unsharded -> stage 3
        assert_within_bf16_rounding(r[2, 3], saved[0][2][0])  # stage 2 -> stage 3
        assert_within_bf16_rounding(r[3, 2], saved[0][3][0])  # stage 3 -> stage 2
