"""strategy.sharding on real gloo groups: the unsharded numbers, one verdict, 16-bit wires.

Each worker trains the same model from the same data three times (sharding
off, stage 1, stage 2) and returns what the test compares. See
tests/sharding/test_sharded_optimizer.py for one-process checks and
tests/checkpoint/test_sharded_checkpoint.py for checkpoints across world sizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers

STEPS, INJECT_AT, PER_RANK = 5, 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(world: int, steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_RANK * world, 6, generator=g), torch.randn(PER_RANK * world, 3, generator=g))
            for _ in range(steps)]


def _strategy(stage: int, amp: bool = True, k_steps: int = 1, overlap: bool = False, **configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=amp, sharding=stage > 0)
    strategy.amp_configs = configs
    if stage:
        strategy.sharding_configs = {"stage": stage, "overlap_param_gather": overlap}
    if k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": k_steps}
    if stage != 3:  # stage 3 sends one FSDP2 unit at a time and refuses a bucket size
        strategy.fuse_grad_size_in_MB = 0.0005  # several buckets, some cut by the slice boundary
    return strategy


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _run(rank, world, strategy, inject=False, clip=False, minimize=False, inner_type=torch.optim.AdamW):
    """Train; with ``inject``, rank 0 puts an inf into the last bias's gradient, before communication."""
    from distamp import fleet

    fleet.init()
    model = _model()
    inner = inner_type([{"params": list(model.parameters())[:2]},
                               {"params": list(model.parameters())[2:], "lr": 5e-3}], lr=1e-2)
    opt = fleet.distributed_optimizer(inner, strategy)
    wrapped = fleet.distributed_model(model, strategy)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    k = opt.merge.k_steps
    applied, grads_after_backward = [], []
    for step, (x, y) in enumerate(_batches(world, STEPS * k)):
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        # The last bias lies at the end of the flat space: rank 1 owns it; rank 0 poisons its gradient.
        handle = model[3].bias.register_hook(_poison) if inject and rank == 0 and step // k == INJECT_AT else None
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        if minimize:
            done = opt.minimize(loss)
        else:
            opt.backward(loss)
            grads_after_backward.append(_grad_state(model))
            if clip and not opt.is_accumulating:
                opt.clip_grad_norm_(0.05)
            done = opt.step()
        if handle is not None:
            handle.remove()
        if done:
            scheduler.step()
        if not opt.is_accumulating:
            applied.append(done)
    opt.finish_param_gather()  # with overlap_param_gather the last rounds launch (and count) only now
    gather = getattr(opt.master_weights, "gather", None)
    gather_bytes = gather.stats.bytes if gather is not None else None
    exported = opt.fp32_state_dict(wrapped)  # collective under sharding: the FP32 masters all-gathered
    return {
        "params": _flat(model),
        "fp32": torch.cat([v.reshape(-1) for v in exported.values()]),
        "applied": applied,
        "scale": opt.get_loss_scaling(),
        "lr": [g["lr"] for g in opt.param_groups],
        "wire_bytes": wrapped.comm_stats.bytes if wrapped.comm_stats is not None else None,
        "gather_bytes": gather_bytes,
        "grads": grads_after_backward,
        "n16": sum(p.numel() for p in model.parameters() if p.dtype != torch.float32),
        "n32": sum(p.numel() for p in model.parameters() if p.dtype == torch.float32),
    }


def _grad_state(model: nn.Module) -> str:
    """What the model's ``.grad`` holds after backward: "freed" (all None), "zero", or "reduced" (some values)."""
    grads = [p.grad for p in model.parameters()]
    if all(g is None for g in grads):
        return "freed"
    if all(g is not None and bool((g == 0).all()) for g in grads):
        return "zero"
    return "reduced"


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0] = float("inf")
    return grad


def _o2_bf16_three_ways(rank, world):
    out = {}
    for stage in (0, 1, 2):
        out[stage] = _run(rank, world, _strategy(stage, use_pure_fp16=True, dtype="bfloat16"), inject=True)
    return out


def _bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap between adjacent BF16 numbers around ``x`` (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def assert_within_bf16_rounding(actual: torch.Tensor, expected: torch.Tensor, ulps: int = 2) -> None:
    """Every element within ``ulps`` BF16 spacings of the reference, measured at its size or at 1/64.

    Near zero the spacing shrinks without bound while the runs' last AdamW
    updates (1e-2 and below here) still differ by their gradients' rounding,
    so below 1/64 the spacing at 1/64 (2**-13) is the unit.
    """
    gap = (actual - expected).abs()
    size = torch.maximum(torch.maximum(actual.abs(), expected.abs()), torch.tensor(2.0**-6))
    allowed = ulps * _bf16_spacing(size)
    worst = (gap / allowed).max().item()
    assert worst <= 1.0, f"off by up to {worst * ulps:.2f} BF16 spacings (max abs {gap.max().item():.3g})"


@pytest.mark.timeout(180)
def test_two_ranks_o2_bf16_adamw_sharded_like_unsharded_and_one_inf_skips_everywhere():
    """O2 BF16 AdamW on 2 ranks, sharding off / stage 1 / stage 2; step 3 has an inf put, on rank 0 before
    communication, into the last bias's gradient, which rank 1 owns.

    - Stages 1 and 2 both reduce-scatter: each rank's 16-bit gradients are divided by 2 and summed in FP32, and
      the sum is rounded once into the owners' BF16 slices, whatever the buckets (DDP's for stage 1, the
      reducer's for stage 2). The unsharded all-reduce sums the same halves (exact in BF16) on 2 ranks once, in
      FP32 arithmetic rounded to BF16 (gloo's BF16 sum): the same reduced gradients, bit for bit. The update
      (unscale and AdamW, one FP32 chunk at a time) is elementwise, so the FP32 masters and the model of all
      three runs are bitwise equal.
    - Every rank ends bitwise equal: each slice is applied once and all-gathered.
    - The inf reaches only rank 1's slice (only rank 1 receives it), yet every rank skips step 3, because the
      verdict is all-reduced before anyone decides.
    """
    out = run_workers(_o2_bf16_three_ways, 2, timeout=150)
    for stage in (0, 1, 2):
        for rank in (0, 1):
            result = out[rank][stage]
            assert result["applied"] == [True, True, False, True, True], (stage, rank)
            assert torch.equal(result["params"], out[0][stage]["params"]), (stage, rank)
            assert result["lr"] == out[0][0]["lr"]  # the scheduler stepped on applied steps only
    assert torch.equal(out[0][1]["params"], out[0][2]["params"])
    assert torch.equal(out[1][1]["fp32"], out[0][2]["fp32"])  # whole FP32 masters, gathered from the slices
    for stage in (1, 2):
        assert torch.equal(out[0][stage]["params"], out[0][0]["params"]), stage
        assert torch.equal(out[0][stage]["fp32"], out[0][0]["fp32"]), stage
    assert not torch.equal(out[0][0]["fp32"], _flat(_model()))  # it trained

    # The wire: both stages send each gradient once, in BF16, as many bytes as the all-reduce hook of stage 0;
    # the parameter all-gather sends BF16 (FP32 for the LayerNorm kept in FP32): less than FP32 would.
    for stage in (1, 2):
        r0 = out[0][stage]
        assert r0["wire_bytes"] == out[0][0]["wire_bytes"] == 2 * (r0["n16"] + r0["n32"]) * STEPS, stage
        per_step = r0["gather_bytes"] / 4  # four applied steps
        assert 2 * r0["n16"] / 2 <= per_step < 4 * (r0["n16"] + r0["n32"]) / 2
    # What .grad holds after backward: the reduced gradient unsharded; stage 1's DDP buckets are handed back
    # zeroed; stage 2 frees every .grad as soon as it is in a bucket.
    assert set(out[0][0]["grads"]) == {"reduced"}
    assert set(out[0][1]["grads"]) == {"zero"}
    assert set(out[0][2]["grads"]) == {"freed"}


def _o2_fp16_three_ways(rank, world):
    fp16 = {"use_pure_fp16": True, "dtype": "float16", "init_loss_scaling": 2.0**16}
    return {stage: _run(rank, world, _strategy(stage, **fp16), inject=True) for stage in (0, 1, 2)}


@pytest.mark.timeout(180)
def test_two_ranks_o2_fp16_sharded_bitwise_like_unsharded_with_the_same_skips():
    """FP16 as BF16 above: the 16-bit slice holds the FP32 mean rounded once, as the unsharded FP16 all-reduce
    leaves it (these gradients are far above FP16's subnormals, where pre-dividing in FP16 could lose bits),
    so the runs skip the same steps (the first overflows at 2**16, the third holds rank 0's inf) and end equal."""
    out = run_workers(_o2_fp16_three_ways, 2, timeout=150)
    for stage in (0, 1, 2):
        for rank in (0, 1):
            assert out[rank][stage]["applied"] == [False, True, False, True, True], (stage, rank)
            assert out[rank][stage]["scale"] == out[0][0]["scale"]
            assert torch.equal(out[rank][stage]["params"], out[0][0]["params"]), (stage, rank)
            assert torch.equal(out[rank][stage]["fp32"], out[0][0]["fp32"]), (stage, rank)


class _UnslicedAdamW(torch.optim.AdamW):
    """AdamW under another type: the update is never cut into chunks for it (only the listed types are)."""


def _o2_clipped_and_unsliced(rank, world):
    bf16 = {"use_pure_fp16": True, "dtype": "bfloat16"}
    out = {("clip", stage): _run(rank, world, _strategy(stage, **bf16), clip=True) for stage in (0, 1, 2)}
    for stage in (1, 2):
        out["chunks", stage] = _run(rank, world, _strategy(stage, **bf16))
        out["whole", stage] = _run(rank, world, _strategy(stage, **bf16), inner_type=_UnslicedAdamW)
    return out


@pytest.mark.timeout(180)
def test_o2_bf16_clipping_and_an_optimizer_that_is_not_cut_step_on_the_whole_fp32_slice():
    """A 16-bit gradient slice is stepped one FP32 chunk at a time; clipping (which changes the whole unscaled
    gradient) and an inner optimizer that may not be cut into slices get the whole FP32 slice for that step,
    built with the chunks' kernels: the latter trains bitwise like the chunked update. Clipped, stages 1 and 2
    train bitwise alike (one global norm from the slices) and within BF16 rounding of the unsharded clip, whose
    norm sums the squares in another order."""
    out = run_workers(_o2_clipped_and_unsliced, 2, timeout=150)
    for key, result in out[0].items():
        assert result["applied"] == [True] * STEPS, key
        assert torch.equal(out[1][key]["params"], result["params"]), key
    assert torch.equal(out[0]["clip", 1]["fp32"], out[0]["clip", 2]["fp32"])
    assert_within_bf16_rounding(out[0]["clip", 2]["params"], out[0]["clip", 0]["params"])
    assert not torch.equal(out[0]["clip", 2]["fp32"], out[0]["chunks", 2]["fp32"])  # the clip did clip
    for stage in (1, 2):
        assert torch.equal(out[0]["whole", stage]["fp32"], out[0]["chunks", stage]["fp32"]), stage


def _modes(rank, world):
    configs = {
        "O1 fp16, clip, scaler skips": {"kw": {"dtype": "float16", "init_loss_scaling": 2.0**40,
                                                    "max_loss_scaling": 2.0**40}, "clip": True},
        "O2 fp16, gradient merge K=3": {"kw": {"use_pure_fp16": True, "dtype": "float16", "k_steps": 3}},
        "AMP off, minimize": {"kw": {"amp": False}, "minimize": True},
    }
    out = {}
    for name, config in configs.items():
        for stage in (0, 1, 2):
            strategy = _strategy(stage, **config["kw"])
            out[name, stage] = _run(rank, world, strategy, clip=config.get("clip", False),
                                    minimize=config.get("minimize", False))
    return out


@pytest.mark.timeout(240)
def test_o1_fp16_o2_merge_and_amp_off_match_unsharded_on_two_ranks():
    """FP16 with loss scaling (the first steps overflow at 2**40 and are skipped alike), clip_grad_norm_ (one
    global norm from the slices), gradient merge (stages 1 and 2 reduce-scatter every micro-batch into FP32
    slices; stage 0 adds the FP32 sum of the earlier micro-batches in the comm hook), AMP off with minimize().
    Stages 1 and 2 match each other bitwise (the same FP32 sums of the same 16-bit gradients). With AMP off they
    match the unsharded run bitwise too: on 2 ranks g0/2 + g1/2 in FP32 is what DDP's FP32 all-reduce
    computes. With 16 bits on the wire they agree with it within 16-bit rounding of the gradients (the
    all-reduce sums in 16 bits)."""
    out = run_workers(_modes, 2, timeout=220)
    names = {name for name, _ in out[0]}
    for name in names:
        reference = out[0][name, 0]
        for stage in (0, 1, 2):
            for rank in (0, 1):
                result = out[rank][name, stage]
                assert torch.equal(result["params"], out[0][name, stage]["params"]), (name, stage, rank)
                assert result["applied"] == reference["applied"]
                assert result["scale"] == reference["scale"]
        stage1, stage2 = out[0][name, 1]["params"], out[0][name, 2]["params"]
        assert torch.equal(stage1, stage2), name
        if "clip" in name:
            assert reference["applied"][:2] == [False, False]
            assert reference["scale"] < 2.0**40
        if "off" in name:
            assert torch.equal(stage1, reference["params"]), name
        else:
            torch.testing.assert_close(stage2, reference["params"], rtol=0, atol=2e-3)
        assert math.isfinite(stage2.abs().max().item())


def _mismatch(rank, world, model_stage, unowned):
    from distamp import fleet

    fleet.init()
    model = _model()
    params = list(model.parameters())
    opt = fleet.distributed_optimizer(torch.optim.SGD(params[:-1] if unowned else params, lr=0.1), _strategy(2))
    try:  # the model is prepared when the second of the two fleet calls attaches the optimizer
        fleet.distributed_model(model, _strategy(model_stage))(torch.ones(2, 6))
    except RuntimeError as error:
        return str(error), opt.steps_applied
    return None, opt.steps_applied


@pytest.mark.timeout(120)
def test_stage_2_mismatches_raise_before_any_collective():
    message, _ = run_workers(_mismatch, 2, 1, False, timeout=100)[0]
    assert "the optimizer's strategy has sharding stage 2 but the model's (fleet.distributed_model) has " \
           "stage 1" in message
    message, _ = run_workers(_mismatch, 2, 2, True, timeout=100)[1]
    assert "['3.bias'] (of 1) belong to no optimizer built with fleet.distributed_optimizer" in message


def _attributed(rank, world, stage):
    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.sharding = True
    strategy.sharding_configs = {"stage": stage}
    fleet.init(strategy=strategy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    x = torch.randn(3, 4)
    if rank == 1:
        x[0, 0] = float("inf")  # only rank 1's input: non-finite gradients after the reduction
    with fleet.auto_cast():
        loss = wrapped(x).float().sum()
    opt.backward(loss)
    return opt.step(), opt.stats()["last_overflow"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_skipped_step_names_the_overflowing_parameters_from_the_slices(stage):
    # Stage 1 hands .grad back zeroed, stage 2 frees it: the names come from each rank's FP32 slice, agreed
    # over ranks.
    for applied, overflow in run_workers(_attributed, 2, stage, timeout=100):
        assert not applied
        assert overflow == {"step": 1, "params": ["0.weight", "1.weight"]}


def _overlapped(rank, world):
    from distamp import fleet

    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
            strategy.fuse_grad_size_in_MB = 0.0002  # the gather runs in several rounds of 200 bytes
            out[stage, overlap] = _run(rank, world, strategy, inject=True, clip=True)
    # What is left running between step() and the next forward, and what finishes it.
    fleet.init()
    model = _model()
    strategy = _strategy(1, use_pure_fp16=True, dtype="bfloat16", overlap=True)
    strategy.fuse_grad_size_in_MB = 0.0002
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    masters = opt.master_weights
    x = torch.randn(PER_RANK, 6, generator=torch.Generator().manual_seed(rank))
    seen = []
    for _ in range(2):
        before = _flat(model)
        with fleet.auto_cast():
            loss = wrapped(x).float().square().mean()
        seen.append(("after forward", masters._refreshing is None))
        opt.backward(loss)
        opt.step()
        seen.append(("after step", masters._refreshing is None))
        # The first layer lies in rank 0's slice, the last in rank 1's: each rank has its own slice only.
        # On gloo the messages write into the parameters as they arrive: compare with the finished values.
        model[0](x.bfloat16())  # the pre-hook of the first Linear finishes the messages it needs
        first = model[0].weight.detach().clone()
        seen.append(("first layer's messages", masters._refreshing is None))
        opt.finish_param_gather()
        seen.append(("finished", masters._refreshing is None, torch.equal(first, model[0].weight),
                     not torch.equal(before, _flat(model))))
    stale = model[3].weight.detach().clone()
    with fleet.auto_cast():
        loss = wrapped(x).float().square().mean()
    opt.backward(loss)
    opt.step()
    pending = masters._refreshing is not None
    state = wrapped.state_dict()  # the model's state_dict finishes the gather before reading
    seen.append(("state_dict", pending, masters._refreshing is None, not torch.equal(state["module.3.weight"], stale)
                 and torch.equal(state["module.3.weight"], model[3].weight)))
    return out, seen


@pytest.mark.timeout(240)
def test_overlap_param_gather_trains_bitwise_as_without_and_finishes_in_forward():
    results = run_workers(_overlapped, 2, timeout=220)
    for rank, (out, seen) in enumerate(results):
        for stage in (1, 2):
            plain, overlapped = out[stage, False], out[stage, True]
            assert plain["applied"] == overlapped["applied"] == [True, True, False, True, True]
            assert torch.equal(plain["params"], overlapped["params"]), (rank, stage)
            assert torch.equal(plain["fp32"], overlapped["fp32"]), (rank, stage)
            assert plain["gather_bytes"] == overlapped["gather_bytes"]
            assert torch.equal(overlapped["params"], results[0][0][stage, True]["params"])  # every rank alike
        # The step leaves the gather running. The first Linear's pre-hook brings in its new weights (what the
        # finished gather holds), not the last layer's; finish does.
        assert seen[0] == ("after forward", True)
        assert seen[1] == ("after step", False)
        # Rank 0's slice is the first Linear (and 2 bias elements): rank 1 has then received all it waits for.
        assert seen[2] == ("first layer's messages", rank == 1)
        assert seen[3] == ("finished", True, True, True)
        assert seen[4] == ("after forward", True)
        assert seen[-1] == ("state_dict", True, True, True)


def _three_ranks(rank, world):
    out = {}
    for stage in (1, 2):
        for overlap in (False, True):
            strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
            out[stage, overlap] = _run(rank, world, strategy, inject=True, clip=True)
    return out


@pytest.mark.timeout(300)
def test_three_ranks_gather_every_slice_into_every_rank():
    # 3 ranks: each rank sends its slice to two peers and receives two (gloo: pairwise messages, all posted at
    # once); the 195 elements divide by nothing, so slices end inside parameters.
    results = run_workers(_three_ranks, 3, timeout=280)
    for rank, out in enumerate(results):
        for stage in (1, 2):
            for overlap in (False, True):
                got = out[stage, overlap]
                assert got["applied"] == [True, True, False, True, True]
                assert torch.equal(got["params"], results[0][1, False]["params"]), (rank, stage, overlap)
                assert torch.equal(got["fp32"], results[0][1, False]["fp32"]), (rank, stage, overlap)


def _o2_sgd(stage, dtype, **amp):
    """``(model, wrapped model, optimizer)``: O2 SGD at ``stage``, the model and optimizer built by fleet."""
    from distamp import fleet

    fleet.init()
    model = _model()
    strategy = _strategy(stage, dtype=dtype, use_pure_fp16=True, **amp)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    return model, fleet.distributed_model(model, strategy), opt


def _rank_loss(wrapped, rank, x, y):
    """This rank's share of the batch through the model, under fleet.auto_cast()."""
    from distamp import fleet

    x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    with fleet.auto_cast():
        return F.mse_loss(wrapped(x).float(), y)


def _plain_backward(rank, world, stage, dtype):
    """``loss.backward()`` + ``step()`` (no optimizer.backward): what a torch loop does unchanged."""
    model, wrapped, opt = _o2_sgd(stage, dtype, init_loss_scaling=1024.0)
    applied = []
    for x, y in _batches(world, 3):
        opt.zero_grad()
        _rank_loss(wrapped, rank, x, y).backward()
        try:
            applied.append(opt.step())
        except RuntimeError as exc:
            return {"error": str(exc)}
    return {"applied": applied, "params": _flat(model)}


@pytest.mark.parametrize("stage", [1, 2])
def test_a_plain_backward_is_applied_at_scale_1_and_refused_under_fp16_scaling(stage):
    # Stage 2 frees every .grad: the optimizer learns of the backward from its gradient slice, so a plain
    # loss.backward() is neither taken for "no new gradients" (BF16) nor applied unscaled (FP16).
    plain = run_workers(_plain_backward, 2, stage, "bfloat16", timeout=120)
    assert [r["applied"] for r in plain] == [[True] * 3] * 2
    assert torch.equal(plain[0]["params"], plain[1]["params"])
    assert not torch.equal(plain[0]["params"], _flat(_model()).bfloat16().float())  # it trained
    scaled = run_workers(_plain_backward, 2, stage, "float16", timeout=120)
    assert all("optimizer.backward(loss)" in r["error"] for r in scaled), scaled


def _unscale_then_clip(rank, world, stage):
    import warnings

    _, wrapped, opt = _o2_sgd(stage, "bfloat16")
    caught = []
    for x, y in _batches(world, 2):
        opt.zero_grad()
        opt.backward(_rank_loss(wrapped, rank, x, y))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.clip_grad_norm_(1.0)  # the global norm: nothing to warn about
            opt.step()
            opt.zero_grad()
            opt.backward(_rank_loss(wrapped, rank, x, y))
            opt.unscale_()  # a loop about to clip .grad with torch's own tools
            opt.step()
        caught.append([str(w.message) for w in seen])
    return caught


@pytest.mark.parametrize("stage", [1, 2])
def test_unscale_under_sharding_warns_once_that_grad_holds_a_slice(stage):
    for caught in run_workers(_unscale_then_clip, 2, stage, timeout=120):
        first, second = caught
        assert len(first) == 1, caught
        assert "optimizer.clip_grad_norm_(max_norm)" in first[0]
        assert "slice" in first[0]
        assert second == [], caught


def _static_graph(rank, world, static_graph):
    """Stage 1 (DDP with the reduce-scatter hook) over several buckets, with or without DDP's static_graph."""
    from distamp import fleet

    fleet.init()
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      _strategy(1, use_pure_fp16=True, dtype="bfloat16"))
    wrapped = fleet.distributed_model(model, static_graph=static_graph)
    for x, y in _batches(world, 3):
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    return _flat(model)


@pytest.mark.timeout(200)
def test_stage_1_with_static_graph_trains_as_without():
    # DDP's first static-graph backward hands every bucket to the hook at the end under index 0, so
    # bucket.is_last() was never true: the last bucket's exchange never went out and backward hung.
    out = run_workers(_static_graph, 2, True, timeout=120)
    reference = run_workers(_static_graph, 2, False, timeout=120)
    for rank in range(2):
        assert torch.equal(out[rank], reference[rank])


class _Gain(nn.Module):
    """``x * weight``: a product autocast leaves in FP32, so the weight's gradient is FP32 in O1 (and ``x``, cast
    to 16 bits, in O2). ``weight``: its initial value (default four ones), any shape and memory format."""

    def __init__(self, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4) if weight is None else weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _fp32_gradient_beyond_fp16(rank, world, stage):
    """One O1 FP16 step at a fixed scale of 1 where rank 0's FP32 gradient is 3 * 2**15 (beyond FP16's 65504) and
    rank 1's is 0: the mean, 3 * 2**14, fits FP16 exactly."""
    from distamp import fleet

    fleet.init()
    model = _Gain()
    strategy = _strategy(stage, use_dynamic_loss_scaling=False, init_loss_scaling=1.0)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1e-5), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    x = torch.full((1, 4), 3.0 * 2**15 if rank == 0 else 0.0)
    with fleet.auto_cast():
        loss = wrapped(x).sum()
    opt.backward(loss)
    return opt.step(), model.weight.detach().clone()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 2])
def test_an_fp32_gradient_beyond_fp16_whose_mean_fits_is_applied_as_unsharded(stage):
    # Unsharded O1 divides each rank's FP32 gradient by the world size before the FP16 wire cast; stages 1
    # and 2 cast first and divided after, so 3 * 2**15 became inf on the wire and every rank skipped the step.
    reference = run_workers(_fp32_gradient_beyond_fp16, 2, 0, timeout=120)
    out = run_workers(_fp32_gradient_beyond_fp16, 2, stage, timeout=120)
    for rank in range(2):
        assert reference[rank][0] is True
        assert torch.equal(reference[rank][1], torch.ones(4).add_(torch.full((4,), 3.0 * 2**14), alpha=-1e-5))
        applied, weight = out[rank]
        assert applied is True, (stage, rank)
        assert torch.equal(weight, reference[rank][1]), (stage, rank, weight)
