"""Re-slicing optimizer state: unsharded -> any number of slices -> unsharded gives back every tensor."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.checkpoint import flat_state
from distamp.core.flat_layout import FlatLayout
from distamp.optim.optimizer import AmpOptimizer
from distamp.sharding.dtensor_state import stage3_ranges
from distamp.strategy import DistributedStrategy


def _trained(pure: bool = True) -> AmpOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    frozen_unused = nn.Parameter(torch.ones(3))  # never gets a gradient: no optimizer state
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": pure, "dtype": "bfloat16"}
    groups = [{"params": list(model[0].parameters())}, {"params": [*model[2].parameters(), frozen_unused],
                                                         "lr": 1e-3}]
    opt = AmpOptimizer(torch.optim.AdamW(groups, lr=1e-2), strategy)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(torch.randn(4, 5).to(next(model.parameters()).dtype)).float(),
                                torch.zeros(4, 2)))
        opt.step()
    return opt


def _target(unsharded: flat_state.Target, world: int, rank: int, stage: int = 1) -> flat_state.Target:
    """A stage-1 (one slice) or stage-3 (each parameter's dim-0 rows) target of ``world`` ranks."""
    shapes = [list(s) for s in unsharded.shapes]
    layout = {"bounds": list(FlatLayout(unsharded.numels, world).bounds)} if stage < 3 else {
        "ranges": stage3_ranges(shapes, world)}
    sharding = {"world_size": world, "rank": rank, "numels": list(unsharded.numels), "shapes": shapes, **layout,
                "groups": [list(g) for g in unsharded.groups], "stage": stage, "mode": "O2" if unsharded.pure else "O1"}
    return flat_state.Target(unsharded.numels, unsharded.shapes, unsharded.groups, unsharded.pure, sharding)


def assert_same_state(a: dict, b: dict) -> None:
    """Two AmpOptimizer state dicts hold the same inner state and FP32 masters, bit for bit."""
    assert a["inner"]["param_groups"] == b["inner"]["param_groups"]
    assert a["inner"]["state"].keys() == b["inner"]["state"].keys()
    for index, state in a["inner"]["state"].items():
        assert state.keys() == b["inner"]["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, b["inner"]["state"][index][key]), (index, key)
    assert len(a["master_weights"]) == len(b["master_weights"])
    assert all(torch.equal(x, y) for x, y in zip(a["master_weights"], b["master_weights"], strict=True))


@pytest.mark.parametrize("pure", [True, False])
@pytest.mark.parametrize("worlds", [(3,), (2, 5), (4, 1)])
def test_unsharded_state_survives_any_chain_of_re_slicing(pure, worlds):
    opt = _trained(pure)
    original = opt.state_dict()
    unsharded = flat_state.describe(opt)
    assert unsharded.sharding is None
    assert unsharded.groups == ((0, 1), (2, 3, 4))
    common, parts = original, {}
    for world in worlds:
        saved = [flat_state.split(flat_state.join(common, parts, _target(unsharded, world, r))) for r in range(world)]
        common, parts = saved[0][0], {r: shard for r, (_, shard) in enumerate(saved)}
        assert common["inner"]["state"] == {}
        assert common["master_weights"] == []
        assert [(p["lo"], p["hi"]) for p in parts.values()] == [
            FlatLayout(unsharded.numels, world).range_of(r) for r in range(world)]
        for rank in range(world):
            needed = flat_state.parts_needed(common, _target(unsharded, 2, rank % 2))
            lo, hi = _target(unsharded, 2, rank % 2).range()
            assert all(parts[r]["lo"] < hi and parts[r]["hi"] > lo for r in needed)
    back = flat_state.join(common, parts, unsharded)
    assert "sharding" not in back
    assert_same_state(back, original)


def _rows(dim0: int, world: int, rank: int) -> int:
    """How many rows of dim 0 torch.chunk (FSDP2's cut) gives ``rank`` of ``world``."""
    chunks = torch.arange(dim0).chunk(world)
    return len(chunks[rank]) if rank < len(chunks) else 0


@pytest.mark.parametrize("pure", [True, False])
@pytest.mark.parametrize("chain", [((3, 3),), ((2, 3), (3, 1), (4, 3)), ((5, 1), (2, 3), (1, 3))])
def test_stage3_parts_of_several_ranges_per_rank_re_slice_into_any_layout(pure, chain):
    opt = _trained(pure)
    original = opt.state_dict()
    unsharded = flat_state.describe(opt)
    shapes = unsharded.shapes  # [7, 5], [7], [2, 7], [2], [3]
    common, parts = original, {}
    for world, stage in chain:
        targets = [_target(unsharded, world, r, stage) for r in range(world)]
        joined = [flat_state.join(common, parts, t) for t in targets]
        if stage == 3:  # each rank's local shards: its dim-0 rows of every parameter
            for rank, state in enumerate(joined):
                rows = [_rows(s[0], world, rank) for s in shapes]
                assert [tuple(m.shape) for m in state["master_weights"]] == (
                    [(n, *s[1:]) for n, s in zip(rows, shapes, strict=True)] if pure else [])
                assert tuple(state["inner"]["state"][0]["exp_avg"].shape) == (rows[0], 5)
                assert state["inner"]["state"][3]["step"] == original["inner"]["state"][3]["step"]  # empty too
        saved = [flat_state.split(state) for state in joined]
        common, parts = saved[0][0], {r: shard for r, (_, shard) in enumerate(saved)}
        if stage == 3:
            assert [p["ranges"] for p in parts.values()] == common["sharding"]["ranges"]
            for target in targets:  # exactly the parts holding elements this rank needs
                wanted = {i for lo, hi in target.needs() for i in range(lo, hi)}
                holding = [r for r, p in parts.items() if wanted & {i for lo, hi in p["ranges"] for i in range(lo, hi)}]
                assert flat_state.parts_needed(common, target) == holding
    back = flat_state.join(common, parts, unsharded)
    assert_same_state(back, original)


def test_join_refuses_other_parameters_other_groups_and_another_mode():
    opt = _trained()
    target = flat_state.describe(opt)
    common, shard = flat_state.split(flat_state.join(opt.state_dict(), {}, _target(target, 1, 0)))
    other = flat_state.Target((35, 7, 14, 2, 4), (*target.shapes[:4], (4,)), target.groups, True, None)
    with pytest.raises(ValueError, match=r"manages 5 parameters of shapes .* this one 5"):
        flat_state.parts_needed(common, other)
    regrouped = flat_state.Target(target.numels, target.shapes, ((0,), (1, 2, 3, 4)), True, None)
    with pytest.raises(ValueError, match=r"2 param groups of sizes \[2, 3\], this one 2 of sizes \[1, 4\]"):
        flat_state.join(common, {0: shard}, regrouped)
    o1 = flat_state.Target(target.numels, target.shapes, target.groups, False, None)
    with pytest.raises(ValueError, match="disagree on use_pure_fp16"):
        flat_state.join(common, {0: shard}, o1)
    with pytest.raises(ValueError, match=r"load it into fleet\.distributed_optimizer\'s optimizer"):
        flat_state.parts_needed(common, None)


def test_state_that_is_not_per_element_cannot_be_re_sliced():
    opt = _trained()
    target = flat_state.describe(opt)
    state = copy.deepcopy(opt.state_dict())  # the inner state dicts are the optimizer's own
    state["inner"]["state"][2]["factored"] = torch.ones(2)  # e.g. Adafactor's row statistics of the 2x7 weight
    whole = flat_state.join(state, {}, _target(target, 2, 1))  # rank 1 holds that weight whole: kept as it is
    assert torch.equal(whole["inner"]["state"][2]["factored"], torch.ones(2))  # rank 1's third piece
    state = copy.deepcopy(opt.state_dict())
    state["inner"]["state"][0]["factored"] = torch.ones(7)  # the 7x5 weight, cut between ranks 0 and 1
    with pytest.raises(ValueError, match=r"\['factored'\] of flat elements \[0, 35\) is neither per-element nor a "
                                         r"scalar, so it cannot be re-sliced to \[0, 30\)"):
        flat_state.join(state, {}, _target(target, 2, 0))
