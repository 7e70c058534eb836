"""optim.sharded_precision.ShardedPrecision on one rank and on a real 2-rank gloo group (O1, stage 1).

Parameters of 5 and 4 elements: on 2 ranks rank 0's slice is [0, 4), rank 1's [4, 9).
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_workers

FULL = torch.linspace(-3.0, 5.0, 9) * 1024 + 0.125


def _precision(world):
    import torch.distributed as dist
    from torch import nn

    from distamp import fleet
    from distamp.sharding.sharded_precision import ShardedPrecision

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"init_loss_scaling": 1024.0}
    strategy.sharding_configs = {"stage": 1}
    params = [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2, 2))]
    group = dist.group.WORLD if world > 1 else None
    return params, ShardedPrecision(params, strategy, group)


def _unscale(rank, world, full, inf_at):
    params, precision = _precision(world)
    full = full.clone()
    if inf_at is not None:
        full[inf_at] = float("inf")
    params[0].grad, params[1].grad = full[:5].clone(), full[5:].view(2, 2).clone()
    found, grad_max = precision.unscale_and_check(precision.group)
    return found, grad_max, precision.master_weights.grads.buffer.clone(), precision.loss_scale


def _reference(values, scale):
    values = values.clone()
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_([values], found, torch.full((1,), 1.0 / scale))
    return values, bool(found.item())


def test_unscale_on_one_rank_equals_torch():
    import torch.distributed

    found, grad_max, slice_, scale = _unscale(0, 1, FULL, None)
    expected, expected_found = _reference(FULL, scale)
    assert scale == 1024.0
    assert found is expected_found
    assert torch.equal(slice_, expected)
    assert grad_max is None  # the default scaler does not ask for the gradient maximum


def test_inf_on_one_rank_is_found_and_matches_torch():
    found, _, slice_, _ = _unscale(0, 1, FULL, 2)
    bad = FULL.clone()
    bad[2] = float("inf")
    expected, expected_found = _reference(bad, 1024.0)
    assert found is True
    assert expected_found is True
    assert torch.equal(slice_, expected)


@pytest.mark.timeout(120)
def test_unscale_on_two_ranks_equals_torch_per_slice():
    out = run_workers(_unscale, 2, FULL, None, timeout=100)
    expected, _ = _reference(FULL, 1024.0)
    assert torch.equal(out[0][2], expected[:4])
    assert torch.equal(out[1][2], expected[4:])
    assert [o[0] for o in out] == [False, False]


@pytest.mark.timeout(120)
def test_inf_only_in_the_other_slice_is_found_on_both_ranks():
    out = run_workers(_unscale, 2, FULL, 7, timeout=100)  # element 7 belongs to rank 1's slice
    assert [o[0] for o in out] == [True, True]
    assert torch.isfinite(out[0][2]).all()


def _clip(rank, world, max_norm, norm_type):
    params, precision = _precision(world)
    params[0].grad, params[1].grad = FULL[:5].clone(), FULL[5:].view(2, 2).clone()
    precision.master_weights.grads.collect()
    total = precision.clip_grad_norm_([], max_norm, norm_type)
    return total, precision.master_weights.grads.buffer.clone()


def _torch_clip(max_norm, norm_type):
    grads = [FULL[:5].clone(), FULL[5:].clone()]
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g
    total = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type)
    return total, torch.cat([p.grad for p in ps])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_from_slices_equals_torch_on_the_full_gradient(norm_type):
    out = run_workers(_clip, 2, 100.0, norm_type, timeout=100)
    total, clipped = _torch_clip(100.0, norm_type)
    for rank, (norm, _) in enumerate(out):
        assert torch.allclose(norm, total.reshape(1) if norm.dim() else total, rtol=1e-6), rank
    assert torch.equal(out[0][0], out[1][0])  # bitwise the same on both ranks
    assert torch.allclose(torch.cat([out[0][1], out[1][1]]), clipped, rtol=1e-6, atol=0)


def _layout_mismatch(rank, world):
    _, precision = _precision(world)
    state = precision.state_dict()
    messages = []
    for bad in ({**state, "sharding": {**state["sharding"], "rank": 1 - rank}}, {"loss_scaler_type": ""}):
        try:
            precision.load_state_dict(bad)
        except ValueError as exc:
            messages.append(str(exc))
    precision.load_state_dict(state)
    return messages, state["sharding"]["stage"], state["sharding"]["mode"]


@pytest.mark.timeout(120)
def test_state_dict_of_another_layout_is_refused():
    out = run_workers(_layout_mismatch, 2, timeout=100)
    tail = ("; a sharded optimizer loads only its own slice. To resume at another world size or with other "
            "sharding, save and load with distamp.checkpoint.save_checkpoint / load_latest_checkpoint, which re-slice")
    for rank, (messages, stage, mode) in enumerate(out):
        assert (stage, mode) == (1, "O1")
        assert messages == [
            f"this state_dict was saved by an optimizer with another layout ({{'world_size': 2, 'rank': {1 - rank}}}) "
            f"than this one (world_size 2, rank {rank})" + tail,
            f"this state_dict was saved by an optimizer with another layout (unsharded) than this one "
            f"(world_size 2, rank {rank})" + tail,
        ]
