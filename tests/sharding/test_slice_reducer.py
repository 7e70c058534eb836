"""Sharding stage 2's reducer (no DDP) does for users what DDP did, on real gloo groups.

The reference is the unsharded run with AMP off: on 2 ranks its FP32
all-reduce computes g0/2 + g1/2, exactly what the reduce-scatter sums into
the owners' FP32 slices, so stage 2 must match it bit for bit whatever the
model does: parameters used by one rank only or by none (with
``find_unused_parameters``), frozen parameters, BatchNorm buffers broadcast
from rank 0 at each forward, ``no_sync`` accumulation, activation
checkpointing. ``torch.compile`` of the wrapper is compared with eager
stage 2.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.multiprocess import run_workers

STEPS = 3


class _Branchy(nn.Module):
    """A trunk with BatchNorm, a frozen layer, a head used on rank 0 only and one used by no rank."""

    def __init__(self, checkpointing: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 3)
        self.rank0_only = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3)
        self.checkpointing = checkpointing

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.frozen(self.trunk(x))))

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        if self.checkpointing == "none":
            h = self._block(x)
        else:
            h = checkpoint(self._block, x, use_reentrant=self.checkpointing == "reentrant")
        out = self.head(h)
        return out + self.rank0_only(h) if extra else out


def _strategy(stage: int, amp: bool = False):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=amp, sharding=stage > 0)
    if amp:
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if stage:
        strategy.sharding_configs = {"stage": stage}
    strategy.fuse_grad_size_in_MB = 0.0005  # several buckets, some cut by the slice boundary
    return strategy


def _train(rank, world, stage, checkpointing="none", no_sync=False, compiled=False, amp=False, sgd=False):
    from distamp import fleet

    fleet.init()
    model = _Branchy(checkpointing)
    strategy = _strategy(stage, amp)
    # AdamW (weight decay shows a parameter that wrongly got a zero gradient) for the bitwise checks; SGD for
    # the compiled run, where AdamW would blow the rounding noise of trunk.bias (whose true gradient is zero: a
    # BatchNorm follows) up to whole steps.
    inner = (torch.optim.SGD(model.parameters(), lr=1e-2) if sgd
             else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    opt = fleet.distributed_optimizer(inner, strategy)
    wrapped = fleet.distributed_model(model, strategy, find_unused_parameters=True)
    run = torch.compile(wrapped) if compiled else wrapped
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data: BatchNorm statistics differ
    freed, micro = [], 2 if no_sync else 1
    for _ in range(STEPS):
        opt.zero_grad()
        for i in range(micro):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            with wrapped.no_sync() if i < micro - 1 else contextlib.nullcontext(), fleet.auto_cast():
                loss = F.mse_loss(run(x, rank == 0).float(), y)
                opt.backward(loss)
        freed.append(all(p.grad is None for p in model.parameters()))
        assert opt.step()
    return {
        "params": {name: p.detach().float().clone() for name, p in model.named_parameters()},
        "buffers": {name: b.detach().clone() for name, b in model.named_buffers()},
        "freed": freed,
        "wire_bytes": wrapped.comm_stats.bytes if wrapped.comm_stats is not None else None,
        "ddp": wrapped.ddp is not None,
    }


def _stage_0_and_2(rank, world, checkpointing="none", no_sync=False):
    return {stage: _train(rank, world, stage, checkpointing, no_sync) for stage in (0, 2)}


def _assert_bitwise_like_unsharded(out):
    for rank in (0, 1):
        ref, sharded = out[rank][0], out[rank][2]
        for name, value in ref["params"].items():
            assert torch.equal(sharded["params"][name], value), (rank, name)
        for name, value in ref["buffers"].items():
            assert torch.equal(sharded["buffers"][name], value), (rank, name)
        assert not sharded["ddp"]
        assert all(sharded["freed"])
    init = _Branchy()
    # The head nobody uses got no gradient on any rank: AdamW skipped it (no weight decay), as with DDP.
    assert torch.equal(out[0][2]["params"]["never.weight"], init.never.weight.detach())
    assert not torch.equal(out[0][2]["params"]["rank0_only.weight"], init.rank0_only.weight.detach())
    assert torch.equal(out[0][2]["params"]["frozen.weight"], init.frozen.weight.detach())


@pytest.mark.timeout(180)
def test_unused_frozen_and_batchnorm_train_bitwise_like_unsharded():
    """A head used on rank 0 only (a zero gradient from rank 1), one used by nobody (no gradient: skipped, as
    DDP's find_unused_parameters does), a frozen layer (not bucketed), BatchNorm statistics broadcast from rank 0
    before each forward; .grad is freed after every backward."""
    _assert_bitwise_like_unsharded(run_workers(_stage_0_and_2, 2, timeout=150))


@pytest.mark.timeout(180)
def test_no_sync_accumulates_in_grad_and_reduces_with_the_next_backward():
    _assert_bitwise_like_unsharded(run_workers(_stage_0_and_2, 2, "none", True, timeout=150))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_trains_bitwise_like_unsharded(checkpointing):
    """Reentrant checkpointing runs a nested backward: the end-of-backward flush must still wait for the outer
    one (it is queued from the output's gradient hook, not from the first parameter's)."""
    _assert_bitwise_like_unsharded(run_workers(_stage_0_and_2, 2, checkpointing, timeout=200))


def _eager_and_compiled(rank, world):
    return {compiled: _train(rank, world, 2, compiled=compiled, amp=True, sgd=True) for compiled in (False, True)}


@pytest.mark.timeout(400)
def test_torch_compile_of_the_wrapper_trains_like_eager():
    """O2 BF16: the compiled forward may fuse differently, so parameters agree within BF16 rounding."""
    out = run_workers(_eager_and_compiled, 2, timeout=380)
    for rank in (0, 1):
        eager, compiled = out[rank][False], out[rank][True]
        assert all(compiled["freed"])
        assert not compiled["ddp"]
        assert compiled["wire_bytes"] == eager["wire_bytes"] > 0
        for name, value in eager["params"].items():
            torch.testing.assert_close(compiled["params"][name], value, rtol=2**-7, atol=1e-3)
        assert torch.equal(out[rank][True]["params"]["head.weight"], out[0][True]["params"]["head.weight"])


def _reduce_counts(rank, world):
    """Bytes and calls of one backward: the reducer sends each element once, in the wire dtype."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    strategy = _strategy(2, amp=True)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    with fleet.auto_cast():
        loss = wrapped(torch.randn(4, 32)).float().square().mean()
    opt.backward(loss)
    masters = opt.master_weights
    return wrapped.comm_stats.bytes, wrapped.reducer.bucket_count, masters.grads.reduced, sorted(masters.grads.arrived)


@pytest.mark.timeout(120)
def test_each_gradient_crosses_the_wire_once_in_16_bits():
    for sent, buckets, reduced, arrived in run_workers(_reduce_counts, 2, timeout=100):
        n = 32 * 64 + 64 + 64 * 8 + 8
        assert sent == 2 * n  # every BF16 element goes into one all-to-all, once
        assert buckets == 4  # 262-element buckets in reverse order: [8], [512], [64], [2048]
        assert reduced
        assert arrived == [0, 1, 2, 3]


def test_ddp_options_stage_2_cannot_honour_are_refused_before_anything_runs():
    from distamp.model.data_parallel import DataParallel

    with pytest.raises(ValueError, match=r"\['delay_all_reduce_named_params', 'mixed_precision'\] are DDP "
                                         r"options, but sharding stage 2 replaces DDP by distamp's reducer, which "
                                         r"takes only \['broadcast_buffers', ('forward_sync_buffers', )?"
                                         r"'init_sync', 'static_graph'\]"):
        DataParallel(nn.Linear(2, 2), _strategy(2), mixed_precision=None, delay_all_reduce_named_params=None,
                     static_graph=True)
    DataParallel(nn.Linear(2, 2), _strategy(1), static_graph=True)  # stage 1 still runs on DDP


@pytest.mark.parametrize(("name", "value", "reason"), [
    ("gradient_as_bucket_view", True, r"gradient_as_bucket_view: not needed: stage 2's reducer copies each gradient "
                                      r"into its 16-bit bucket and frees \.grad at once"),
    ("device_ids", [0], r"device_ids: stage 2's reducer works on the device distamp trains on \(fleet\.device\(\)"),
    ("bucket_cap_mb", 50, r"bucket_cap_mb: the bucket size is strategy\.fuse_grad_size_in_MB"),
])
def test_stage_2_refuses_the_ddp_options_distamp_sets_with_its_own_reason_not_ddps(name, value, reason):
    # was: "gradient_as_bucket_view=True is set by distamp: distamp always builds DDP with
    # gradient_as_bucket_view=True", although stage 2 builds no DDP
    from distamp.model.data_parallel import DataParallel

    with pytest.raises(ValueError, match=rf"\['{name}'\] are DDP options, but sharding stage 2 replaces DDP .*"
                                         rf"remove the others \({reason}") as refused:
        DataParallel(nn.Linear(2, 2), _strategy(2), **{name: value})
    assert "builds DDP" not in str(refused.value)
    with pytest.raises(ValueError, match=rf"{name}=.* is set by distamp"):
        DataParallel(nn.Linear(2, 2), _strategy(1), **{name: value})  # stage 1 builds DDP with it


@pytest.mark.parametrize(("name", "stage_2", "stage_3"), [
    ("batched_grad_copy", "copies each gradient into its bucket when autograd has accumulated it",
     "FSDP2 copies each unit's gradients into its reduce-scatter input at once"),
    ("lazy_bucket_allocation", "allocates each bucket at its first gradient and frees it once reduce-scattered",
     "FSDP2 allocates each unit's reduce-scatter buffer"),
])
def test_ddps_newer_bucket_options_are_refused_at_stages_2_and_3_with_why_they_are_not_needed(name, stage_2, stage_3):
    # was: stage 2 named them among "DDP options" with no reason, stage 3 said "not taken at stage 3"
    from distamp.model.data_parallel import DataParallel
    from distamp.model.ddp_preparation import refuse_stage3_kwargs

    if name not in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters:
        pytest.skip(f"this torch's DDP has no {name}")
    with pytest.raises(ValueError, match=rf"\({name}: .*{stage_2}"):
        DataParallel(nn.Linear(2, 2), _strategy(2), **{name: True})
    with pytest.raises(ValueError, match=rf"\({name}: .*{stage_3}"):
        refuse_stage3_kwargs({name: True})
    for stage in (0, 1):  # DDP takes them
        DataParallel(nn.Linear(2, 2), _strategy(stage), **{name: True})


def _reducer_dropped(rank, world):
    import gc

    from distamp.sharding.sharded_masters import ShardedMasters
    from distamp.sharding.slice_reducer import SliceReducer

    model = nn.Linear(4, 2)
    masters = ShardedMasters(model.parameters(), None, None, rank, world)
    reducer = SliceReducer(model, [masters], torch.float32)
    reducer.before_forward(sync=True)
    reducer.watch(model(torch.ones(1, 4))).sum().backward()
    taken = [p.grad for p in model.parameters()]
    del reducer
    gc.collect()
    model(torch.ones(1, 4)).sum().backward()
    return taken, [p.grad for p in model.parameters()], masters.grads.reduced


@pytest.mark.timeout(120)
def test_a_garbage_reducer_leaves_the_models_gradients_alone():
    for taken, kept, reduced in run_workers(_reducer_dropped, 2, timeout=100):
        assert taken == [None, None]
        assert reduced
        assert all(g is not None for g in kept)


def _largest_allocation(fn) -> int:
    """The largest single CPU allocation (bytes) ``fn`` makes, from torch.profiler's allocation events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    return max([e.nbytes() for e in events if e.name() == "[memory]"], default=0)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_a_gradient_is_divided_before_the_wire_cast_without_a_temporary_of_its_size(wire):
    # Stage 2 divides each FP32 (O1) gradient by the world size as it copies it into its 16-bit bucket, so a
    # value that only fits FP16 once divided survives; torch.div(grad, W, out=bucket) would compute in an FP32
    # temporary as large as the gradient, raising stage 2's peak by the largest gradient.
    from distamp.sharding.slice_reducer import DIVIDE_SLAB, _divide_into

    grad = torch.randn(8 * DIVIDE_SLAB + 5, generator=torch.Generator().manual_seed(0)) * 1e3
    grad[0] = 3.0 * 2**15  # beyond FP16, half of it fits
    target = torch.zeros(grad.numel(), dtype=wire)
    largest = _largest_allocation(lambda: _divide_into(target, grad, 2))
    assert largest <= DIVIDE_SLAB * 4, largest
    assert torch.equal(target, (grad / 2).to(wire))
    assert torch.isfinite(target).all()
    _divide_into(target, grad, 2, accumulate=True)
    assert torch.equal(target, (grad / 2).to(wire) + (grad / 2).to(wire))
