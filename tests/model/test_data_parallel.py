"""Data-parallel AMP on real gloo groups: 16-bit wire, lockstep skipping, merge.

Each test spawns real processes (see tests/multiprocess.py) and checks that
ranks never disagree: same skip decisions, same scale, bitwise-equal
parameters, and results that match a one-process run on the whole batch.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers


def tiny_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def global_batches(steps: int, world_size: int, per_rank: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(per_rank * world_size, 6, generator=g), torch.randn(per_rank * world_size, 3, generator=g))
        for _ in range(steps)
    ]


def shard(batch, rank, world_size):
    x, y = batch
    n = x.shape[0] // world_size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def make_strategy(amp=True, **configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = amp
    strategy.amp_configs = configs
    return strategy


def build(strategy, inner="sgd", seed=0, model_first=False, model=None, **model_kwargs):
    """fleet.distributed_optimizer + fleet.distributed_model, in either order (on ``tiny_mlp(seed)`` by default)."""
    from distamp import fleet

    fleet.init()
    model = tiny_mlp(seed) if model is None else model
    make_inner = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    }[inner]
    if model_first:
        wrapped = fleet.distributed_model(model, **model_kwargs)
        opt = fleet.distributed_optimizer(make_inner(model.parameters()), strategy)
    else:
        opt = fleet.distributed_optimizer(make_inner(model.parameters()), strategy)
        wrapped = fleet.distributed_model(model, **model_kwargs)
    return model, wrapped, opt


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


# --------------------------------------------------------------------------- lockstep skip


def _inf_after_backward_on_last_rank(rank, world_size, sync, pure):
    from distamp import fleet

    strategy = make_strategy(use_pure_fp16=pure, init_loss_scaling=1024.0, decr_every_n_nan_or_inf=1)
    _, wrapped, opt = build(strategy)
    opt.sync_found_inf = sync
    results = []
    for step, batch in enumerate(global_batches(3, world_size)):
        x, y = shard(batch, rank, world_size)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad()
        opt.backward(loss)
        if step == 1 and rank == world_size - 1:
            # after the all-reduce: only this rank sees it
            wrapped.module[0].weight.grad[0, 0] = float("inf")
        results.append(opt.step())
    return results, opt.get_loss_scaling(), flat_params(wrapped.module), flat_params_masters(opt)


def flat_params_masters(opt) -> torch.Tensor:
    return torch.cat([m.detach().reshape(-1) for m in opt.master_weights.masters])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "pure"), [(2, True), (4, False)])
def test_inf_on_one_rank_after_communication_skips_on_every_rank(world_size, pure):
    out = run_workers(_inf_after_backward_on_last_rank, world_size, True, pure, timeout=100)
    for steps, scale, params, masters in out:
        assert steps == [True, False, True]
        assert scale == out[0][1] == 512.0
        assert torch.equal(params, out[0][2])
        assert torch.equal(masters, out[0][3])


@pytest.mark.timeout(120)
def test_without_the_flag_sync_ranks_would_diverge():
    """The same injection with the all-reduce of the flag switched off."""
    out = run_workers(_inf_after_backward_on_last_rank, 2, False, True, timeout=100)
    assert out[0][0] == [True, True, True]
    assert out[1][0] == [True, False, True]
    assert out[0][1] != out[1][1]
    assert not torch.equal(out[0][2], out[1][2])


def _nan_in_forward_on_rank_1(rank, world_size):
    from distamp import fleet

    strategy = make_strategy(use_pure_fp16=True, dtype="bfloat16")
    _, wrapped, opt = build(strategy, inner="adamw")
    results = []
    for step, batch in enumerate(global_batches(3, world_size)):
        x, y = shard(batch, rank, world_size)
        if step == 1 and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad()
        opt.backward(loss)
        results.append(opt.step())
    return results, opt.steps_skipped, flat_params(wrapped.module)


@pytest.mark.timeout(120)
def test_nan_from_the_forward_pass_on_one_rank_skips_everywhere():
    out = run_workers(_nan_in_forward_on_rank_1, 2, timeout=100)
    for steps, skipped, params in out:
        assert steps == [True, False, True]
        assert skipped == 1
        assert torch.equal(params, out[0][2])


# --------------------------------------------------------------------------- numerics vs one process


COMBOS = list(itertools.product([False, True], ["float16", "bfloat16"], ["sgd", "adamw"]))
STEPS = 4


def _train_distributed(rank, world_size, pure, dtype, inner, model_first):
    strategy = make_strategy(use_pure_fp16=pure, dtype=dtype)
    _, wrapped, opt = build(strategy, inner=inner, seed=rank, model_first=model_first)  # seeds differ: broadcast fixes
    _train(wrapped, opt, STEPS, rank, world_size)
    return flat_params(wrapped.module), flat_params_masters(opt)


def _train(wrapped, opt, steps, rank, world_size):
    """``steps`` applied steps of MSE on this rank's shard of the global batches."""
    from distamp import fleet

    for batch in global_batches(steps, world_size):
        x, y = shard(batch, rank, world_size)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()


def _single_process_reference(pure, dtype, inner, world_size):
    from distamp.amp.auto_cast import auto_cast
    from distamp.optim.optimizer import AmpOptimizer

    model = tiny_mlp(0)
    make_inner = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    }[inner]
    opt = AmpOptimizer(make_inner(model.parameters()), make_strategy(use_pure_fp16=pure, dtype=dtype))
    for x, y in global_batches(STEPS, world_size):
        with auto_cast(dtype=dtype):
            loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    return flat_params_masters(opt)


def _all_combos(rank, world_size):
    results = {}
    for i, (pure, dtype, inner) in enumerate(COMBOS):
        params, masters = _train_distributed(rank, world_size, pure, dtype, inner, model_first=i % 2 == 1)
        results[(pure, dtype, inner)] = (params, masters)
    return results


@pytest.mark.timeout(240)
def test_o1_o2_fp16_bf16_sgd_adamw_bitwise_across_ranks_and_close_to_one_process():
    world_size = 2
    out = run_workers(_all_combos, world_size, timeout=220)
    for combo in COMBOS:
        params0, masters0 = out[0][combo]
        for rank in range(1, world_size):
            assert torch.equal(out[rank][combo][0], params0), combo
            assert torch.equal(out[rank][combo][1], masters0), combo
        reference = _single_process_reference(*combo, world_size)
        # Differences come from 16-bit rounding of the all-reduced gradients
        # (the one-process run never rounds its gradient sum to 16 bits) and,
        # in BF16, from its 8-bit mantissa; 2e-2 is a few BF16 ulps at |w| ~ 1.
        tolerance = 2e-2 if combo[1] == "bfloat16" else 2e-3
        torch.testing.assert_close(masters0, reference, rtol=0, atol=tolerance, msg=str(combo))


# --------------------------------------------------------------------------- gradient merge


def _gradient_merge(rank, world_size, k_steps, pure=False):
    from distamp import fleet

    strategy = make_strategy(dtype="bfloat16", use_pure_fp16=pure)
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": k_steps, "avg": True}
    _, wrapped, opt = build(strategy)
    micro = global_batches(k_steps, world_size, per_rank=2)
    calls = []
    results = []
    for batch in micro:
        x, y = shard(batch, rank, world_size)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x), y)
        opt.zero_grad()
        results.append(opt.minimize(loss))
        calls.append(wrapped.comm_stats.calls)
    return results, calls, flat_params_masters(opt)


def _one_big_batch(rank, world_size, k_steps, pure=False):
    from distamp import fleet

    strategy = make_strategy(dtype="bfloat16", use_pure_fp16=pure)
    _, wrapped, opt = build(strategy)
    micro = global_batches(k_steps, world_size, per_rank=2)
    xs, ys = zip(*(shard(b, rank, world_size) for b in micro), strict=True)
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(torch.cat(xs)), torch.cat(ys))
    opt.backward(loss)
    assert opt.step()
    return flat_params_masters(opt)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pure", [False, True])
def test_gradient_merge_communicates_once_per_window_and_equals_one_big_batch(pure):
    """O1, and O2 where the comm hook adds the FP32 sum of the earlier micro-batches before the wire cast."""
    k = 4
    merged = run_workers(_gradient_merge, 2, k, pure, timeout=100)
    big = run_workers(_one_big_batch, 2, k, pure, timeout=100)
    for results, calls, masters in merged:
        assert results == [False, False, False, True]
        n_buckets = calls[-1]
        assert n_buckets >= 1
        assert calls == [0, 0, 0, n_buckets]  # nothing sent until the K-th micro-batch
        assert torch.equal(masters, merged[0][2])
        # BF16 micro-batch gradients summed in a different order than one big batch
        torch.testing.assert_close(masters, big[0], rtol=0, atol=1e-2)


# --------------------------------------------------------------------------- odd shapes


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, use_branch: bool):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + self.sometimes(h)
        return self.head(h)


def _uneven_and_unused(rank, world_size):
    from distamp import fleet

    fleet.init()
    model = Branchy()
    strategy = make_strategy(use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, find_unused_parameters=True)
    branch_before = flat_params(model.sometimes)
    for step, batch in enumerate(global_batches(4, world_size, per_rank=4)):
        x, y = shard(batch, rank, world_size)
        if step == 3 and rank == 1:
            x, y = x[:1], y[:1]  # the uneven last batch
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x, use_branch=step == 2), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
        if step == 1:
            unused_so_far = torch.equal(flat_params(model.sometimes), branch_before)
    return flat_params(model), flat_params_masters(opt), unused_so_far


@pytest.mark.timeout(120)
def test_uneven_last_batch_and_parameters_without_gradients():
    out = run_workers(_uneven_and_unused, 2, timeout=100)
    for params, masters, unused_so_far in out:
        assert unused_so_far  # no gradient, no update (SGD without momentum)
        assert torch.equal(params, out[0][0])
        assert torch.equal(masters, out[0][1])


# --------------------------------------------------------------------------- wire and FP32 modules


def _wire_bytes(rank, world_size):
    from distamp import fleet

    out = {}
    for name, configs in {
        "o1_fp16": {},
        "o2_bf16": {"use_pure_fp16": True, "dtype": "bfloat16"},
        "o1_fp32_wire": {"comm_dtype": "float32"},
    }.items():
        strategy = make_strategy(**configs)
        model, wrapped, opt = build(strategy)
        x, y = shard(global_batches(1, world_size)[0], rank, world_size)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x), y)
        opt.backward(loss)
        opt.step()
        out[name] = wrapped.comm_stats.bytes
    out["n_params"] = sum(p.numel() for p in model.parameters())
    return out


@pytest.mark.timeout(120)
def test_gradients_cross_the_wire_in_16_bits():
    out = run_workers(_wire_bytes, 2, timeout=100)[0]
    assert out["o1_fp16"] == 2 * out["n_params"]
    assert out["o2_bf16"] == 2 * out["n_params"]
    assert out["o1_fp32_wire"] == 4 * out["n_params"]


class WithHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _black_varnames(rank, world_size, model_first):
    from distamp import fleet

    fleet.init()
    model = WithHead()
    original_head = [p.detach().clone() for p in model.head.parameters()]
    strategy = make_strategy(use_pure_fp16=True, custom_black_varnames=["head"])
    if model_first:
        fleet.init(strategy=strategy)
        wrapped = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    else:
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        wrapped = fleet.distributed_model(model)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    exact = all(torch.equal(p.detach(), o) for p, o in zip(model.head.parameters(), original_head, strict=True))
    x, y = shard(global_batches(1, world_size)[0], rank, world_size)
    with fleet.auto_cast():
        out = wrapped(x)
        loss = F.mse_loss(out, y)
    opt.backward(loss)
    assert opt.step()
    return dtypes, exact, out.dtype, flat_params(model)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_first", [False, True])
def test_black_varnames_modules_stay_fp32_in_o2_whichever_call_comes_first(model_first):
    out = run_workers(_black_varnames, 2, model_first, timeout=100)
    for dtypes, exact, out_dtype, params in out:
        assert dtypes == {
            "body.weight": torch.float16,
            "body.bias": torch.float16,
            "head.weight": torch.float32,
            "head.bias": torch.float32,
        }
        assert exact  # restored from the exact FP32 master, not from FP16
        assert out_dtype == torch.float32
        assert torch.equal(params, out[0][3])


def _no_sync_accumulation(rank, world_size):
    from distamp import fleet

    _, wrapped, opt = build(make_strategy(dtype="bfloat16"))
    micro = global_batches(3, world_size, per_rank=2)
    opt.zero_grad()
    calls = []
    for i, batch in enumerate(micro):
        x, y = shard(batch, rank, world_size)
        context = wrapped.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
        with context:
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x), y)
            opt.backward(loss)
        calls.append(wrapped.comm_stats.calls)
    scale_updates_before = opt.steps_applied + opt.steps_skipped
    assert opt.step()
    return calls, opt.steps_applied + opt.steps_skipped - scale_updates_before, flat_params_masters(opt)


@pytest.mark.timeout(120)
def test_no_sync_accumulation_communicates_once_and_steps_once():
    out = run_workers(_no_sync_accumulation, 2, timeout=100)
    for calls, updates, masters in out:
        n_buckets = calls[-1]
        assert n_buckets >= 1
        assert calls == [0, 0, n_buckets]
        assert updates == 1  # one inf/NaN check and one scale update for the whole window
        assert torch.equal(masters, out[0][2])


def _accumulate(rank, world_size, stage, switch):
    """nanoGPT's loop: 2 steps of 2 micro-batches, the sync switched per micro-batch by `switch`."""
    from distamp import fleet

    strategy = make_strategy(dtype="bfloat16", use_pure_fp16=True)
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    fleet.init()
    model = tiny_mlp()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model)
    ctx = fleet.auto_cast()
    calls, updates = [], []
    batches = global_batches(4, world_size, per_rank=2)
    for step in range(2):
        for micro_step in range(2):
            x, y = shard(batches[2 * step + micro_step], rank, world_size)
            last = micro_step == 1
            if switch == "attribute":
                wrapped.require_backward_grad_sync = last
            with contextlib.nullcontext() if switch == "attribute" or last else wrapped.no_sync():
                with ctx:
                    loss = F.mse_loss(wrapped(x), y) / 2
                opt.backward(loss)
            calls.append(wrapped.comm_stats.calls)
        before = opt.steps_applied + opt.steps_skipped
        assert opt.step()
        updates.append(opt.steps_applied + opt.steps_skipped - before)
        opt.zero_grad(set_to_none=True)
    state = opt.fp32_state_dict(wrapped)
    return calls, updates, torch.cat([state[k].reshape(-1) for k in sorted(state)])


def _attribute_and_no_sync(rank, world_size, stage):
    return {switch: _accumulate(rank, world_size, stage, switch) for switch in ("attribute", "no_sync")}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_require_backward_grad_sync_false_accumulates_locally_as_ddp_does(stage):
    """DDP's attribute, set as nanoGPT and Accelerate set it, communicates once per optimizer step."""
    out = run_workers(_attribute_and_no_sync, 2, stage, timeout=130)
    for runs in out:
        calls, updates, params = runs["attribute"]
        per_step = calls[1]
        assert per_step >= 1
        assert calls == [0, per_step, per_step, 2 * per_step]  # nothing on the accumulating micro-batches
        assert updates == [1, 1]  # one inf/NaN check and one scale update per optimizer step
        assert runs["no_sync"][:2] == (calls, updates)
        assert torch.equal(params, runs["no_sync"][2])  # the same sums as under no_sync()
        assert torch.equal(params, out[0]["attribute"][2])  # and the ranks agree


def _stage1_across_the_bucket_rebuild(rank, world_size, touch):
    """Stage 1 without zero_grad: step, then a no_sync micro-batch (DDP rebuilds its buckets in its forward)."""
    from distamp import fleet

    strategy = make_strategy(dtype="bfloat16", use_pure_fp16=True)
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 1}
    fleet.init()
    model = tiny_mlp()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model)
    batches = [shard(b, rank, world_size) for b in global_batches(3, world_size, per_rank=2)]
    with fleet.auto_cast():
        opt.backward(F.mse_loss(wrapped(batches[0][0]), batches[0][1]))
    assert opt.step()
    zeroed = all(p.grad is not None and not p.grad.any() for p in model.parameters())
    if touch:
        model[0].bias.grad.fill_(1.0)  # a value the user left in .grad: DDP's rebuild carries it over
    with wrapped.no_sync():
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(batches[1][0]), batches[1][1])
        freed = [p.grad is None for p in model.parameters()]
        opt.backward(loss)
    with fleet.auto_cast():
        opt.backward(F.mse_loss(wrapped(batches[2][0]), batches[2][1]))
    assert opt.step()
    state = opt.fp32_state_dict(wrapped)
    return zeroed, freed, torch.cat([state[k].reshape(-1) for k in sorted(state)])


def _stage1_rebuild_runs(rank, world_size):
    return {touch: _stage1_across_the_bucket_rebuild(rank, world_size, touch) for touch in (False, True)}


@pytest.mark.timeout(120)
def test_stage_1_frees_the_zeroed_grads_before_ddp_rebuilds_its_buckets_and_keeps_any_other():
    """After a reduce-scatter every .grad is a zeroed view of a DDP bucket; freeing them before the forward in
    which DDP rebuilds its buckets lets the old buckets go before the new ones are allocated. The next backward
    makes them again, so training is unchanged; a .grad holding anything else is kept and accumulated into."""
    out = run_workers(_stage1_rebuild_runs, 2, timeout=100)
    for runs in out:
        zeroed, freed, masters = runs[False]
        assert zeroed
        assert freed == [True] * 4
        _, touched_freed, touched = runs[True]
        assert touched_freed == [True, False, True, True]  # 0.weight, 0.bias (kept), 2.weight, 2.bias
        assert not torch.equal(touched, masters)  # the kept 1.0 was reduced with the next gradients
        assert torch.equal(masters, out[0][False][2])  # the ranks agree


class Scale(nn.Module):
    """loss = sum(weight * x): the weight's gradient is the input, chosen per rank."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return (self.weight * x).sum()


def _large_opposite_gradients(rank, world_size):
    from distamp import fleet

    fleet.init()
    model = Scale()
    strategy = make_strategy(dtype="float16", init_loss_scaling=1.0)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4), strategy)
    wrapped = fleet.distributed_model(model)
    x = torch.tensor([70000.0 if rank == 0 else -60000.0])
    with fleet.auto_cast():
        loss = wrapped(x)
    opt.backward(loss)
    grad = model.weight.grad.clone()
    applied = opt.step()
    return applied, grad, model.weight.detach().clone()


@pytest.mark.timeout(120)
def test_fp32_gradients_beyond_fp16_range_per_rank_are_averaged_not_overflowed():
    """O1 FP16: per-rank gradients +70000 and -60000 average to 5000 without overflowing the wire."""
    out = run_workers(_large_opposite_gradients, 2, timeout=100)
    # Each half is rounded to FP16 on the wire: 35000 -> 35008, -30000 exactly.
    expected = torch.tensor([35000.0]).half().float() + torch.tensor([-30000.0])
    for applied, grad, weight in out:
        assert applied is True
        assert torch.equal(grad, expected)
        assert abs(grad.item() - 5000.0) <= 8
        assert torch.equal(weight, torch.ones(1).add_(expected, alpha=-1e-4))  # what SGD computes


def _add_param_group_after_the_wrapper(rank, world_size, mode):
    """A head trained from step 2 on (torch's idiom for a layer unfrozen later), in a group of its own."""
    from distamp import fleet

    configs = {"off": {}, "o1": {"dtype": "bfloat16"}, "o2": {"dtype": "bfloat16", "use_pure_fp16": True}}[mode]
    fleet.init()
    model = tiny_mlp()
    head = list(model[2].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = fleet.distributed_optimizer(torch.optim.SGD(body, lr=0.05), make_strategy(mode != "off", **configs))
    wrapped = fleet.distributed_model(model)
    out = {}
    for step, batch in enumerate(global_batches(3, world_size)):
        if step == 1:
            try:
                opt.add_param_group({"params": head, "lr": 0.1})
            except RuntimeError as error:
                out["error"] = str(error)
                out["dtypes"] = [str(p.dtype) for p in model.parameters()]
                return out
        x, y = shard(batch, rank, world_size)
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    out["params"] = flat_params(model)
    return out


@pytest.mark.timeout(200)
def test_add_param_group_after_the_wrapper_trains_or_refuses_o2_with_the_fix():
    # O2 stored the new group in 16 bits under DDP's FP32 buckets: DDP then failed in the next backward
    # with "Expected to have finished reduction in the prior iteration" (parameter indices 2 3).
    for mode in ("off", "o1"):
        out = run_workers(_add_param_group_after_the_wrapper, 2, mode, timeout=100)
        assert torch.equal(out[0]["params"], out[1]["params"])
    for out in run_workers(_add_param_group_after_the_wrapper, 2, "o2", timeout=100):
        assert out["error"] == (
            "add_param_group() with use_pure_fp16 after the model's data-parallel wrapper was built: "
            "['2.weight', '2.bias'] would be stored in bfloat16, but the wrapper reduces their gradients in FP32 "
            "buckets it built on the parameters' dtypes. Give every param group to the inner optimizer's "
            "constructor (or add it) before fleet.distributed_model.")
        assert out["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]


def _unfrozen_after_the_wrapper(rank, world_size, stage, late_freeze, compiled=False):
    """Gradual unfreezing: the first layer trains from step 2 on; frozen before the wrapper, or after it.
    ``compiled``: the model is compiled (the eager backend) before fleet's calls."""
    from distamp import fleet

    fleet.init()
    model = tiny_mlp()
    strategy = make_strategy(dtype="bfloat16", use_pure_fp16=True)
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    strategy.find_unused_parameters = late_freeze
    first = list(model[0].parameters())
    if not late_freeze:
        for p in first:
            p.requires_grad_(False)
    given = torch.compile(model, backend="eager") if compiled else model
    opt = fleet.distributed_optimizer(torch.optim.SGD(given.parameters(), lr=0.05), strategy)
    wrapped = fleet.distributed_model(given, strategy)
    if late_freeze:
        for p in first:
            p.requires_grad_(False)
    for step, batch in enumerate(global_batches(3, world_size)):
        if step == 1:
            for p in first:
                p.requires_grad_(True)
        x, y = shard(batch, rank, world_size)
        try:
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
        except RuntimeError as error:
            return str(error), opt.fp32_state_dict(wrapped)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    return None, opt.fp32_state_dict(wrapped)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_unfrozen_after_the_wrapper_was_built_is_refused_and_the_late_freeze_trains(stage):
    # Nothing reduced the unfrozen layer's gradients: the ranks drifted apart without sharding, and at stages 1
    # and 2 each slice's owner applied its own gradient (the ranks stayed equal, on the wrong update).
    refused = run_workers(_unfrozen_after_the_wrapper, 2, stage, False, timeout=100)
    for message, _ in refused:
        assert message.startswith("['0.weight', '0.bias'] had requires_grad=False when fleet.distributed_model "
                                  "built its gradient reducer")
        assert "strategy.find_unused_parameters = True" in message
    # Frozen after the wrapper was built, with find_unused_parameters: the unfrozen layer's gradients are
    # averaged, so every stage trains it alike (stages 1 and 2 bitwise like sharding off in O2 on 2 ranks).
    trained = run_workers(_unfrozen_after_the_wrapper, 2, stage, True, timeout=100)
    unsharded = trained if stage == 0 else run_workers(_unfrozen_after_the_wrapper, 2, 0, True, timeout=100)
    for (message, state), (_, expected) in zip(trained, unsharded, strict=True):
        assert message is None
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
    assert not torch.equal(trained[0][1]["0.weight"], refused[0][1]["0.weight"])  # it trained from step 2 on


def test_static_graph_with_gradient_merge_on_ddp_is_refused_before_anything_runs():
    # Each window's first K-1 micro-batches do not communicate, and DDP's static graph is recorded on the first
    # backward, which must: every run failed at its first backward with torch's "expect_autograd_hooks_ INTERNAL
    # ASSERT FAILED ... please report a bug to PyTorch". Sharding stage 1 communicates every micro-batch.
    import re

    from distamp.model.data_parallel import DataParallel
    from distamp.strategy import DistributedStrategy

    strategy = DistributedStrategy(amp=True, gradient_merge=True)
    strategy.gradient_merge_configs = {"k_steps": 2}
    with pytest.raises(ValueError, match=re.escape(
            "fleet.distributed_model(..., static_graph=True) with strategy.gradient_merge (k_steps=2): DDP records "
            "its static graph on the first backward, which must communicate")):
        DataParallel(nn.Linear(2, 2), strategy, static_graph=True)
    DataParallel(nn.Linear(2, 2), strategy)
    strategy.sharding = True
    DataParallel(nn.Linear(2, 2), strategy, static_graph=True)


def test_ddps_own_mixed_precision_is_refused_before_anything_runs_where_distamp_hooks_ddp():
    # was: accepted, then DDP's __init__ registered its mixed-precision hook and distamp's registration failed at the
    # first forward, after the start-up broadcast, with torch's "register_comm_hook ... can only be called once"
    from torch.nn.parallel.distributed import _MixedPrecision

    from distamp.model.data_parallel import DataParallel
    from distamp.strategy import DistributedStrategy

    ddp_precision = _MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
    for strategy, named in ((DistributedStrategy(amp=True), "strategy.amp"),
                            (DistributedStrategy(powersgd=True), "strategy.powersgd"),
                            (DistributedStrategy(sharding=True), "sharding stage 1")):
        with pytest.raises(ValueError, match=rf"mixed_precision=\.\.\.\): DDP's own mixed precision .* for {named};"):
            DataParallel(nn.Linear(2, 2), strategy, mixed_precision=ddp_precision)
    DataParallel(nn.Linear(2, 2), DistributedStrategy(), mixed_precision=ddp_precision)  # no distamp hook: DDP's


def _model_first_without_a_strategy(rank, world_size, model_first, custom_black):
    strategy = make_strategy(use_pure_fp16=True, dtype="bfloat16",
                             custom_black_varnames=["head"] if custom_black else [])
    # model_first: no strategy given to init or distributed_model, the optimizer's comes later
    model, wrapped, opt = build(strategy, model_first=model_first, model=WithHead())
    _train(wrapped, opt, 3, rank, world_size)
    return flat_params(model), model.head.weight.dtype, wrapped.comm_stats.bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("custom_black", [False, True])
def test_a_model_wrapped_before_any_strategy_takes_its_optimizers(custom_black):
    # The model-first order of the README's loop, strategy given to distributed_optimizer only: the wrapper was built
    # on a default strategy, and the new check refused the optimizer's as "different strategies".
    first = run_workers(_model_first_without_a_strategy, 2, True, custom_black, timeout=100)
    second = run_workers(_model_first_without_a_strategy, 2, False, custom_black, timeout=100)
    for (params, head_dtype, sent), (ref_params, ref_head_dtype, ref_sent) in zip(first, second, strict=True):
        assert torch.equal(params, ref_params)
        assert head_dtype == ref_head_dtype == (torch.float32 if custom_black else torch.bfloat16)
        assert sent == ref_sent  # the 16-bit wire of the optimizer's strategy


def _converted_after_the_wrapper(rank, world_size, stage, o2, convert_wrapper):
    """Train 3 steps; after the first, convert the model to FP16 (the wrapper's or the inner model's ``half()``)."""
    from distamp import fleet

    fleet.init()
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
    strategy = make_strategy(dtype="float16", use_pure_fp16=o2)
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.05), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    for step, batch in enumerate(global_batches(3, world_size)):
        x, y = shard(batch, rank, world_size)
        if step == 1:
            (wrapped if convert_wrapper else model).half()
            with torch.no_grad():  # evaluating the converted model reduces nothing: allowed
                wrapped(x.half())
        try:
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
        except RuntimeError as error:
            return step, str(error)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return None, [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(200)
def test_a_compiled_models_unfrozen_parameters_are_named_as_in_the_model():
    for message, _ in run_workers(_unfrozen_after_the_wrapper, 2, 0, False, True, timeout=100):
        assert message.startswith("['0.weight', '0.bias'] had requires_grad=False when fleet.distributed_model ")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "o2", "convert_wrapper"),
                         [(0, False, True), (0, False, False), (0, True, True), (2, False, True)])
def test_a_model_converted_to_another_dtype_after_the_wrapper_was_built_is_refused(stage, o2, convert_wrapper):
    # model.half() gives each parameter a new gradient accumulator, which DDP's hooks are not on: in O1 the
    # ranks applied their own gradients and drifted apart silently (the second step's FP16 gradients differed
    # on the two ranks); in O2 only the FP32 LayerNorm changed and DDP failed with "Expected to have finished
    # reduction in the prior iteration", which names neither the cause nor the fix.
    for step, message in run_workers(_converted_after_the_wrapper, 2, stage, o2, convert_wrapper, timeout=100):
        assert step == 1, message
        first = "1" if o2 else "0"  # O2 keeps only the LayerNorm in FP32
        converted = "(torch.float32 on cpu -> torch.float16 on cpu)"
        assert message.startswith(f"parameters {first}.weight {converted}, {first}.bias {converted}")
        assert "changed dtype or device after fleet.distributed_model built its gradient reducer" in message
        assert "use_pure_fp16" in message


class _Depthwise(nn.Module):
    """``x * weight`` with a (4, 1, 3, 3) weight: channels_last changes only the stride of its size-1 dim."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 1, 3, 3))

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return (xs[0] * self.weight).sum()


def _relaid_after_the_wrapper(rank, world_size, pure, merge, powersgd, depthwise):
    """Train 3 steps; before the second, move the model to channels_last. Returns (the step refused, its message)
    or (None, the FP32 weights)."""
    from distamp import fleet
    from tests.distributed.test_memory_formats import _build, _inputs

    model, opt, wrapped = _build(False, pure, powersgd, merge, _Depthwise() if depthwise else None)
    for step in range(3):
        if step == 1:
            model.to(memory_format=torch.channels_last)
        opt.zero_grad()
        for _ in range(merge):
            try:
                with fleet.auto_cast():
                    loss = wrapped([torch.arange(36.0).view(4, 1, 3, 3) + rank] if depthwise else _inputs(rank, step))
            except RuntimeError as error:
                return step, str(error)
            opt.backward(loss)
        opt.step()
    return None, opt.fp32_state_dict(wrapped)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("pure", "merge", "powersgd"), [(True, 2, False), (False, 1, True), (True, 1, False)],
                         ids=["o2-merge", "o1-powersgd", "o2"])
def test_a_model_moved_to_channels_last_after_the_wrapper_was_built_is_refused(pure, merge, powersgd):
    """DDP keeps each gradient in its bucket with the strides its parameter had when the buckets were built
    (again at its rebuild after the first backward): a weight made channels_last after that had its reduced
    gradient on other elements (torch's DDP only warns), and the comm hooks added the merge sum and compressed
    onto others too. The next forward with gradients now refuses, before DDP's."""
    for step, message in run_workers(_relaid_after_the_wrapper, 2, pure, merge, powersgd, False, timeout=100):
        assert step == 1, message
        assert message == (
            "parameters conv (strides (12, 4, 2, 1) -> (12, 1, 6, 3)) changed memory format after "
            "fleet.distributed_model built its gradient reducer (when the first optimizer was attached, or at the "
            "first forward): DDP keeps each gradient in its bucket in the layout its parameter had then, so the "
            "reduced gradient would land on other elements (torch's DDP warns 'Grad strides do not match bucket "
            "view strides'). Change the memory format before fleet.distributed_model "
            "(model.to(memory_format=torch.channels_last) right after building the model)")


@pytest.mark.timeout(120)
def test_a_channels_last_move_that_keeps_the_memory_order_trains_on():
    """A (4, 1, 3, 3) depthwise weight in channels_last changes only its size-1 dim's stride: the same memory
    order, so DDP's buckets still match it and training goes on, as without the move."""
    moved = run_workers(_relaid_after_the_wrapper, 2, True, 2, False, True, timeout=100)
    for step, weights in moved:
        assert step is None, weights
        assert torch.equal(weights["weight"], moved[0][1]["weight"])
