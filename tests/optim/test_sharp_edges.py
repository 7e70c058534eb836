"""Habits from plain PyTorch work, or fail loudly with the fix, under every mode."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp import auto_cast
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy

MODES = {
    "off": {},
    "o1_fp16": {"dtype": "float16", "init_loss_scaling": 1024.0},
    "o2_fp16": {"dtype": "float16", "use_pure_fp16": True, "init_loss_scaling": 1024.0},
    "o2_bf16": {"dtype": "bfloat16", "use_pure_fp16": True},
}


def _strategy(mode: str, **extra) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=mode != "off", **extra)
    strategy.amp_configs = MODES[mode]
    return strategy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _forward_loss(model, opt, scale=1.0):
    x, y = torch.full((4, 4), 1.0), torch.full((4, 2), 5.0)
    dtype = opt.strategy.amp_config.dtype
    with auto_cast(enable=opt.amp_enabled, dtype=dtype):
        return F.mse_loss(model(x), y) * scale


@pytest.mark.parametrize("mode", sorted(MODES))
def test_clip_grad_norm_and_unscale_work_in_every_mode(mode):
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy(mode))
    opt.backward(_forward_loss(model, opt))
    norm = opt.clip_grad_norm_(1.0)
    assert torch.isfinite(norm)
    assert norm > 1.0
    assert opt.stats()["grad_norm"] == pytest.approx(float(norm))
    masters = [m for m in opt.master_weights.masters if m.grad is not None]
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    assert clipped == pytest.approx(1.0, rel=1e-4)
    assert opt.step()


@pytest.mark.parametrize("mode", ["o1_fp16", "o2_fp16", "o2_bf16"])
def test_torch_clip_after_unscale_clips_the_applied_update(mode):
    """The GradScaler idiom: optimizer.unscale_(); torch.nn.utils.clip_grad_norm_(model.parameters(), m)."""
    reference, ours = _model(), _model()
    opt_ref = AmpOptimizer(torch.optim.SGD(reference.parameters(), lr=0.01), _strategy(mode))
    opt = AmpOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01), _strategy(mode))
    opt_ref.backward(_forward_loss(reference, opt_ref))
    opt_ref.clip_grad_norm_(0.5)
    opt_ref.step()
    opt.backward(_forward_loss(ours, opt))
    opt.unscale_()
    norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.5)
    assert 1.0 < float(norm) < 1e4  # a true norm, not a scaled one
    opt.step()
    # Same update as optimizer.clip_grad_norm_, up to the 16-bit rounding torch's clip works in.
    tolerance = 0 if mode.startswith("o1") else 1e-2
    for a, b in zip(opt.master_weights.masters, opt_ref.master_weights.masters, strict=True):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance * 1e-2)


@pytest.mark.parametrize("sharding", [False, True], ids=["unsharded", "sharded"])
def test_torch_clip_below_the_limit_leaves_o2_fp16_unscaled_gradients_exact(sharding):
    """torch's clip multiplies by 1.0 below the limit: the FP32 gradients below FP16's range must survive it.

    Was: the moved version counter made the step take the 16-bit ``.grad`` back, flushing
    gradients that loss scaling had kept (an update 10% off, some elements lost).
    """

    def update(clip_with_torch: bool) -> list[torch.Tensor]:
        model = _model()
        strategy = DistributedStrategy(amp=True, sharding=sharding)
        strategy.amp_configs = {"dtype": "float16", "use_pure_fp16": True, "init_loss_scaling": 2.0**20}
        opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), strategy)
        opt.backward(_forward_loss(model, opt, scale=1e-7))
        if clip_with_torch:
            opt.unscale_()
            exposed = [m.grad.clone() for m in opt.master_weights.masters if m.grad is not None]
            assert any(not torch.equal(g, g.half().float()) for g in exposed)  # FP16 cannot hold them
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
        before = [m.detach().clone() for m in opt.master_weights.masters]
        assert opt.step()
        return [m.detach() - b for m, b in zip(opt.master_weights.masters, before, strict=True)]

    for clipped, plain in zip(update(clip_with_torch=True), update(clip_with_torch=False), strict=True):
        assert torch.equal(clipped, plain)


def test_clipping_scaled_gradients_before_unscale_is_reported(caplog):
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy("o1_fp16"))
    opt.backward(_forward_loss(model, opt))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # on scaled gradients
    with caplog.at_level(logging.WARNING, logger="distamp"):
        opt.step()
    assert "call optimizer.unscale_() before clipping" in caplog.text


@pytest.mark.parametrize("mode", ["off", "o1_fp16"])
def test_merged_gradients_are_the_mean_before_step_in_every_mode(mode):
    """torch's clip before step() sees the same (mean) gradient with AMP on or off."""
    model = _model()
    strategy = _strategy(mode, gradient_merge=True, gradient_merge_configs={"k_steps": 4})
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    single = _model()
    loss = F.mse_loss(single(torch.full((4, 4), 1.0)), torch.full((4, 2), 5.0))
    loss.backward()
    for _ in range(4):
        opt.backward(_forward_loss(model, opt))
    opt.unscale_()
    for got, want in zip(model.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=2e-3, atol=1e-3)


def test_plain_loss_backward_under_loss_scaling_raises_with_the_fix():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy("o1_fp16"))
    _forward_loss(model, opt).backward()
    with pytest.raises(RuntimeError, match=r"Replace loss.backward\(\) with optimizer.backward\(loss\)"):
        opt.step()


@pytest.mark.parametrize("mode", ["off", "o2_bf16"])
def test_step_with_nothing_new_warns_once_and_is_not_counted(mode):
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy(mode))
    opt.backward(_forward_loss(model, opt))
    assert opt.step()
    with pytest.warns(UserWarning, match="found no new gradients"):
        assert opt.step() is False
    assert opt.steps_applied == 1
    assert opt.steps_skipped == 0


def test_plain_torch_loop_still_works_with_amp_off():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy("off"))
    for _ in range(2):
        opt.zero_grad()
        _forward_loss(model, opt).backward()
        assert opt.step()


def test_fp32_export_of_an_o2_model_is_exact_masters():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy("o2_bf16"))
    opt.backward(_forward_loss(model, opt))
    opt.step()
    exported = opt.fp32_state_dict(model)
    assert all(v.dtype == torch.float32 for v in exported.values())
    for (name, value), master in zip(exported.items(), opt.master_weights.masters, strict=True):
        assert torch.equal(value, master.detach()), name
    assert model[0].weight.dtype == torch.bfloat16   # the model itself is untouched
    fresh = _model()
    fresh.load_state_dict(exported)


def test_an_o2_forward_outside_auto_cast_says_how_to_fix_it():
    from distamp import fleet

    model = _model()
    strategy = _strategy("o2_bf16")
    _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    wrapped = fleet.distributed_model(model, strategy=strategy)   # strategy= is accepted too
    with pytest.raises(RuntimeError, match=r"run the forward under `with fleet.auto_cast\(\):`"):
        wrapped(torch.ones(2, 4))
    with fleet.auto_cast():
        assert wrapped(torch.ones(2, 4)).dtype == torch.bfloat16


class _BilinearHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Bilinear(4, 4, 2)

    def forward(self, x):
        return self.head(x, self.proj(x))


def test_an_o2_op_autocast_does_not_cast_names_both_fixes_and_each_works():
    # CPU autocast has no rule for bilinear: its FP32 input met the 16-bit weight and the user got torch's
    # bare "All tensors must have the same dtype".
    from distamp import fleet

    def forward(**configs):
        torch.manual_seed(0)
        model = _BilinearHead()
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", **configs}
        _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
        wrapped = fleet.distributed_model(model, strategy=strategy)
        with fleet.auto_cast():
            return wrapped(torch.ones(2, 4))

    with pytest.raises(RuntimeError, match=r"custom_white_list.*custom_black_varnames"):
        forward()
    assert forward(custom_white_list=["bilinear"]).dtype == torch.bfloat16
    assert forward(custom_black_varnames=["head"]).dtype == torch.float32


class _WeightedBag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 4, mode="sum")
        self.head = torch.nn.Linear(4, 2)

    def forward(self, tokens, weights):
        return self.head(self.bag(tokens, per_sample_weights=weights))


def test_an_o2_embedding_bag_with_fp32_per_sample_weights_names_both_fixes_and_each_works():
    # Was: torch's bare "Expected tensor for argument #1 'weight' to have the same type as tensor for argument #1
    # 'per_sample_weights'", with no hint: the message says "type", not "dtype", and the hint was not added.
    from distamp import fleet

    def forward(**configs):
        torch.manual_seed(0)
        model = _WeightedBag()
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", **configs}
        _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
        wrapped = fleet.distributed_model(model, strategy=strategy)
        with fleet.auto_cast():
            return wrapped(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.full((2, 3), 0.5))

    with pytest.raises(RuntimeError, match=r"(?s)per_sample_weights.*custom_white_list.*custom_black_varnames"):
        forward()
    assert forward(custom_white_list=["embedding_bag"]).dtype == torch.bfloat16
    assert forward(custom_black_varnames=["bag"]).dtype == torch.bfloat16  # the bag in FP32, the head in 16 bits


@pytest.mark.parametrize("mode", sorted(MODES))
def test_add_param_group_refuses_a_parameter_of_another_group_as_torch_does(mode):
    # It was dropped from the new group without a word: the group's lr never applied to it.
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.01), _strategy(mode))
    with pytest.raises(ValueError, match=re.escape(
            "some parameters appear in more than one parameter group: ['params[0]'] are in this optimizer "
            "already. Give each parameter to one group only (torch's optimizers refuse it too).")):
        opt.add_param_group({"params": [model[0].weight, model[2].weight], "lr": 0.5})
    assert [len(g["params"]) for g in opt.param_groups] == [2]
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.5})  # new ones only: added
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]


class _FP32Block(torch.nn.Module):
    """A block the forward runs with autocast switched off, as mixed-precision code does for a sensitive part."""

    def __init__(self, switch_off: str) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.sensitive = torch.nn.Linear(4, 2)
        self.switch_off = switch_off

    def forward(self, x):
        from distamp import fleet

        h = self.proj(x)
        region = torch.autocast("cpu", enabled=False) if self.switch_off == "torch" else fleet.auto_cast(enable=False)
        with region:
            return self.sensitive(h.float())


@pytest.mark.parametrize("switch_off", ["torch", "fleet"])
def test_an_o2_module_run_with_autocast_switched_off_gets_the_fix_that_works(switch_off):
    # The hint said only that the op was outside torch's lists and to white-list it: F.linear is on them, and a
    # white-listed op does nothing where autocast is off, so that fix failed the same way.
    from distamp import fleet

    def forward(**configs):
        torch.manual_seed(0)
        model = _FP32Block(switch_off)
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16", **configs}
        _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
        wrapped = fleet.distributed_model(model, strategy=strategy)
        with fleet.auto_cast():
            return wrapped(torch.ones(2, 4))

    with pytest.raises(RuntimeError, match=re.escape(
            "Or the forward switched autocast off around a module with 16-bit weights (torch.autocast(..., "
            "enabled=False), fleet.auto_cast(enable=False), a torch.amp.custom_fwd(cast_inputs=torch.float32) "
            "function): to run that module in FP32, list it in amp_configs['custom_black_varnames']")):
        forward()
    with pytest.raises(RuntimeError):
        forward(custom_white_list=["linear"])
    assert forward(custom_black_varnames=["sensitive"]).dtype == torch.float32


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_zero_grad_between_backward_and_step_is_refused_in_every_mode(mode, set_to_none):
    # Was: step() returned True and counted an applied step; with set_to_none=False SGD's momentum moved the
    # parameters on zeros. torch's GradScaler refuses the order ("No inf checks were recorded").
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), _strategy(mode))
    opt.backward(_forward_loss(model, opt))
    assert opt.step()
    opt.backward(_forward_loss(model, opt))
    opt.zero_grad(set_to_none=set_to_none)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=re.escape("optimizer.step() after optimizer.zero_grad()")):
        opt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert (opt.steps_applied, opt.steps_skipped) == (1, 0)
    opt.backward(_forward_loss(model, opt))  # the loop goes on once a backward follows the zero_grad
    assert opt.step()
    assert opt.steps_applied == 2


def _cleared_on_two_ranks(rank, world_size, extra):
    from distamp import fleet

    fleet.init()
    model = _model()
    strategy = _strategy("o1_fp16", **extra)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), strategy)
    model = fleet.distributed_model(model)
    opt.backward(_forward_loss(model, opt))
    assert opt.step()
    opt.backward(_forward_loss(model, opt))
    opt.zero_grad()
    try:
        opt.step()
    except RuntimeError as exc:
        refused = str(exc)
    else:
        refused = ""
    opt.zero_grad()
    opt.backward(_forward_loss(model, opt))
    applied = opt.step()
    whole = [getattr(p, "full_tensor", lambda p=p: p)() for p in model.parameters()]  # stage 3: DTensor shards
    return refused, applied, opt.steps_applied, [p.detach().float().sum().item() for p in whole]


@pytest.mark.parametrize("extra", [
    {"sharding": True, "sharding_configs": {"stage": 2}},
    {"sharding": True, "sharding_configs": {"stage": 3}},
    {"powersgd": True, "powersgd_configs": {"start_step": 0, "min_compression_rate": 1.0}},
], ids=["stage2", "stage3", "powersgd"])
def test_zero_grad_between_backward_and_step_is_refused_on_every_rank_and_the_loop_goes_on(extra):
    from tests.multiprocess import run_workers

    results = run_workers(_cleared_on_two_ranks, 2, extra, timeout=120)
    for refused, applied, steps_applied, _ in results:
        assert refused.startswith("optimizer.step() after optimizer.zero_grad()")
        assert applied
        assert steps_applied == 2
    assert results[0][3] == results[1][3]


@pytest.mark.parametrize("mode", ["o1_fp16", "o2_fp16", "o2_bf16"])
def test_a_grad_scaler_kept_from_a_torch_amp_loop_is_named_in_every_amp_mode(mode):
    # Was, in O2: GradScaler.step found no gradient on the FP32 masters and failed inside torch with
    # "No inf checks were recorded for this optimizer", which says nothing of the fix; O1 named it through the
    # gradients changed behind distamp's back (at FP16 scaling only).
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), _strategy(mode))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_forward_loss(model, opt)).backward()
    with pytest.raises(RuntimeError, match=re.escape(
        "optimizer.step() was called by a torch.amp.GradScaler (scaler.step(optimizer)), but with strategy.amp on "
        "distamp scales the loss itself. Drop the GradScaler"
    )):
        scaler.step(opt)
    assert opt.steps_applied == 0
    assert not hasattr(opt, "grad_scale")


def test_amp_off_with_the_loops_own_grad_scaler_steps_as_the_inner_optimizer_does():
    # With AMP off distamp leaves scaling to the loop: GradScaler unscales, skips and steps as for torch's optimizer.
    model, reference = _model(), _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), _strategy("off"))
    plain = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16), torch.amp.GradScaler("cpu", init_scale=2.0**16)]
    for step in range(3):
        for net, optimizer, scaler in zip((model, reference), (opt, plain), scalers, strict=True):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(net(torch.full((4, 4), 1.0 + step)), torch.full((4, 2), 5.0))
            scaler.scale(loss * (float("inf") if step == 1 else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
