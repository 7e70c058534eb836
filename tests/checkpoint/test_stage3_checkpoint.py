"""Stage 3 checkpoints: each rank writes its own shards, and they resume at any world size and stage.

Two ranks train BF16 (two param groups, a StepLR) unsharded, with stage 2
and with stage 3, save at step 3 and go on to step 6. Two ranks resume each
bitwise at its own stage; one rank unsharded and four ranks at stage 3
resume the stage-3 checkpoint, and two ranks resume unsharded and stage-2
checkpoints at stage 3 and the stage-3 one at stage 2, within BF16 rounding
of the uninterrupted run (the global batch is the same; its gradient is
summed over another number of ranks, or in another order).

A stage-3 save writes one part per rank holding only that rank's rows and
gathers nothing; what any world size and stage loads from it (or from an
unsharded or stage-2 checkpoint into stage 3) is bitwise the saved state,
in O1 and O2, with AdamW and with SGD with momentum.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

import pytest
import torch

from tests.checkpoint.test_sharded_checkpoint import (
    END,
    SAVE_AT,
    _build,
    _save_and_resume_at_the_same_size,
    _train,
    recording_reads,
)
from tests.multiprocess import run_workers
from tests.sharding.test_flat_state import assert_same_state
from tests.sharding.test_sharding import assert_within_bf16_rounding

SHAPES = {"0.weight": [16, 6], "0.bias": [16], "1.weight": [16], "1.bias": [16], "3.weight": [3, 16], "3.bias": [3]}
"""The parameters of ``tests.sharding.test_sharding._model``, in order."""


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


@contextlib.contextmanager
def _counting_gathers():
    """Yields a Counter of the calls that make whole tensors out of shards: DTensor gathers and all-gathers."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor

    calls: Counter = Counter()
    patched = [(DTensor, "full_tensor"), (DTensor, "redistribute"), (dist, "all_gather"),
               (dist, "all_gather_into_tensor"), (funcol, "all_gather_tensor")]
    originals = [getattr(owner, name) for owner, name in patched]

    def counting(name, original):
        def call(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    for (owner, name), original in zip(patched, originals, strict=True):
        setattr(owner, name, counting(name, original))
    try:
        yield calls
    finally:
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)


def _whole_state(opt, stage):
    """The optimizer's state as whole tensors (stages 0 and 3), None at stages 1 and 2 (slices)."""
    return opt.state_dict() if stage in (0, 3) else None


def _save_at(rank, world, root, stages, pure, sgd):
    """Per stage: the FP32 model, the whole optimizer state and the gathers a save at step SAVE_AT made."""
    from distamp.checkpoint import save_checkpoint

    out = {}
    for stage in stages:
        _, wrapped, opt, scheduler = _build(stage, pure, sgd)
        _train(rank, world, wrapped, opt, scheduler, 0, SAVE_AT)
        with _counting_gathers() as during_save:
            save_checkpoint(os.path.join(root, f"stage{stage}"), SAVE_AT, model=wrapped, optimizer=opt,
                            scheduler=scheduler)
        with _counting_gathers() as exporting:
            fp32 = _fp32(wrapped, opt)
        assert stage != 3 or exporting["full_tensor"]  # the spy sees a gather where there is one
        out[stage] = (fp32, _whole_state(opt, stage), dict(during_save))
        if stage == 3:
            _local_state_round_trip(opt)
    return out


def _local_state_round_trip(opt):
    """``local_state_dict()`` loads back on its own rank and is refused, with the fix, on another."""
    whole = opt.state_dict()
    local = opt.local_state_dict()
    opt.load_state_dict(local)
    _assert_same_optimizer_state(opt.state_dict(), whole)
    other = {**local, "sharding": {**local["sharding"], "rank": 1 - local["sharding"]["rank"]}}
    with pytest.raises(ValueError, match=r"not this rank's stage-3 shards .* load_latest_checkpoint, which re-slice"):
        opt.load_state_dict(other)


def _load_from(rank, world, root, plan, pure, sgd):
    """Per (saved stage, stage): the FP32 model and the whole optimizer state right after loading, and the parts
    this rank read."""
    from distamp.checkpoint import load_latest_checkpoint

    out = {}
    with recording_reads() as read:
        for saved, stage in plan:
            read.clear()
            _, wrapped, opt, scheduler = _build(stage, pure, sgd)
            info = load_latest_checkpoint(os.path.join(root, f"stage{saved}"), model=wrapped, optimizer=opt,
                                          scheduler=scheduler)
            assert info.step == SAVE_AT
            out[saved, stage] = (_fp32(wrapped, opt), _whole_state(opt, stage), sorted(read))
    return out


def _rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """The rows of dim 0 that torch.chunk (FSDP2's cut) gives ``rank`` of ``world``."""
    chunks = torch.arange(dim0).chunk(world)
    if rank >= len(chunks):
        return dim0, dim0
    return int(chunks[rank][0]), int(chunks[rank][-1]) + 1


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert_same_state(a, b)
    assert (a["counters"], a["loss_scaler"]) == (b["counters"], b["loss_scaler"])


def _payloads(directory) -> dict[str, dict]:
    return {n.split(".")[1]: torch.load(directory / n, weights_only=True)
            for n in sorted(os.listdir(directory)) if n.endswith(".pt")}


@pytest.mark.timeout(200)
def test_a_stage3_save_writes_each_ranks_own_rows_and_gathers_nothing(tmp_path):
    saved = run_workers(_save_at, 2, str(tmp_path), (3,), True, False, timeout=120)
    assert [s[3][2] for s in saved] == [{}, {}]  # no full_tensor, redistribute or all-gather during the save
    payloads = _payloads(tmp_path / "stage3")
    assert sorted(payloads) == ["common", "rank-00000", "rank-00001"]
    common = payloads["common"]
    assert not set(common["model"]) & set(SHAPES)  # no parameter is in the common part
    assert {k: v["shape"] for k, v in common["model_shards"].items()} == SHAPES
    assert common["optimizer"]["inner"]["state"] == {}
    assert common["optimizer"]["master_weights"] == []
    offsets = [0]
    for shape in SHAPES.values():
        offsets.append(offsets[-1] + torch.Size(shape).numel())
    for rank in (0, 1):
        part = payloads[f"rank-0000{rank}"]
        expected = {}
        for name, shape in SHAPES.items():
            start, stop = _rows(shape[0], 2, rank)
            expected[name] = [stop - start, *shape[1:]]
        assert {k: list(v.shape) for k, v in part["model_shard"].items()} == expected
        assert all(v.dtype == torch.float32 for v in part["model_shard"].values())
        shard = part["optimizer_shard"]
        ranges = []
        for i, shape in enumerate(SHAPES.values()):
            start, stop = _rows(shape[0], 2, rank)
            row = torch.Size(shape[1:]).numel()
            ranges.append([offsets[i] + start * row, offsets[i] + stop * row])
        assert shard["ranges"] == ranges
        held = sum(hi - lo for lo, hi in ranges)
        assert held < offsets[-1]
        assert shard["masters"].numel() == held
        assert {k: v.numel() for k, v in shard["elementwise"].items()} == {"exp_avg": held, "exp_avg_sq": held}
        assert all(s["scalars"]["step"] == SAVE_AT for s in shard["piece_state"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("pure", "sgd"), [(True, False), (False, False), (True, True), (False, True)],
                         ids=["O2-AdamW", "O1-AdamW", "O2-SGD-momentum", "O1-SGD-momentum"])
def test_c_d_stage3_checkpoints_load_bitwise_at_any_size_and_stage(tmp_path, pure, sgd):
    saved = run_workers(_save_at, 2, str(tmp_path), (0, 2, 3), pure, sgd, timeout=150)
    assert saved[0][3][2] == {}
    payloads = _payloads(tmp_path / "stage3")
    assert sorted(payloads) == ["common", "rank-00000", "rank-00001"]
    assert bool(payloads["rank-00000"]["optimizer_shard"]["masters"] is not None) == pure
    (one,) = run_workers(_load_from, 1, str(tmp_path), [(3, 0), (3, 3)], pure, sgd, timeout=120)
    three = run_workers(_load_from, 3, str(tmp_path), [(3, 3), (0, 3), (2, 3), (3, 2)], pure, sgd, timeout=200)
    for results in (one, *three):
        for (source, stage), (fp32, whole, _) in results.items():
            assert torch.equal(fp32, saved[0][source][0]), (source, stage)
            if whole is not None and saved[0][source][1] is not None:
                _assert_same_optimizer_state(whole, saved[0][source][1])
    assert one[3, 0][2] == ["common", "rank-00000", "rank-00001"]  # an unsharded model needs every row
    # At stage 3 each rank reads only the parts holding its rows: 16-row parameters cut 6/6/4 against 8/8.
    assert [r[3, 3][2] for r in three] == [["common", "rank-00000"], ["common", "rank-00000", "rank-00001"],
                                           ["common", "rank-00001"]]


def _load_before_sharding(rank, world, root):
    import torch.nn.functional as F
    from torch import nn

    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.sharding_configs = {"stage": 3}
    fleet.init(strategy=strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    errors = []
    for load in (lambda: load_latest_checkpoint(root, model=model, optimizer=opt),
                 lambda: opt.load_state_dict(opt.state_dict())):
        try:
            load()
        except RuntimeError as exc:
            errors.append(str(exc))
    wrapped = fleet.distributed_model(model, strategy)  # the fix: shard first, then load
    assert load_latest_checkpoint(root, model=wrapped, optimizer=opt) is None  # nothing saved yet
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(torch.randn(4, 6)).float(), torch.zeros(4, 3))
    opt.backward(loss)
    return errors, opt.step()


@pytest.mark.timeout(120)
def test_loading_before_the_model_is_sharded_is_refused_with_the_fix(tmp_path):
    # It used to be taken and then fail at the first step with torch's "mixed torch.Tensor and DTensor".
    for errors, stepped in run_workers(_load_before_sharding, 2, str(tmp_path), timeout=100):
        assert len(errors) == 2
        for message in errors:
            assert "not sharded yet: call model = fleet.distributed_model(model) first" in message
        assert "loading a checkpoint needs the shards" in errors[0]
        assert "then load it" in errors[0]
        assert stepped
