"""Sharding stage 3 (FSDP2) on real gloo groups: unsharded numbers, one verdict, the policy's dtypes.

Each worker trains the same model from the same data unsharded (stage 0)
and with stage 3, and returns what the tests compare. An inf is put into
one gradient on one rank *before* communication: under FSDP2 autograd
computes gradients on the unsharded parameters, so the hook goes there.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers
from tests.sharding.test_sharding import assert_within_bf16_rounding

STEPS, PER_RANK = 5, 4


def _ddp_takes(name: str) -> bool:
    """Whether the installed torch's DDP has the keyword argument ``name``."""
    return name in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _strategy(stage: int, amp: bool = True, k_steps: int = 1, units=(), **configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=amp, sharding=stage > 0)
    strategy.amp_configs = configs
    if stage:
        strategy.sharding_configs = {"stage": stage, "units": list(units)}
    if k_steps > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": k_steps}
    return strategy


def _batches(world: int, count: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_RANK * world, 6, generator=g), torch.randn(PER_RANK * world, 3, generator=g))
            for _ in range(count)]


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0] = float("inf")
    return grad


def _local_param(wrapped, name: str) -> torch.Tensor:
    """The tensor autograd computes ``name``'s local gradient for: the unsharded parameter under stage 3."""
    if getattr(wrapped, "ddp", None) is None and hasattr(wrapped, "_unsharded_parameters"):
        return dict(wrapped._unsharded_parameters())[name]
    return dict(wrapped.module.named_parameters())[name]


def _train(rank, world, strategy, inject_at=None, inject_rank=0, clip=True, closure=False):
    """Train STEPS optimizer steps; returns losses, verdicts, scales, attribution and the final FP32 model."""
    from distamp import fleet

    fleet.init()
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    k = opt.merge.k_steps
    out = {"losses": [], "applied": [], "scales": [], "norms": [], "params": []}
    for i, (x, y) in enumerate(_batches(world, STEPS * k)):
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        poisoned = [inject_at is not None and i // k == inject_at and rank == inject_rank]

        def forward_backward(x=x, y=y, poisoned=poisoned):
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
            # Once per batch: a retried closure computes clean gradients.
            handle = _local_param(wrapped, "3.bias").register_hook(_poison) if poisoned.pop() else None
            poisoned.append(False)
            opt.zero_grad()
            opt.backward(loss)
            if handle is not None:
                handle.remove()
            return loss

        if closure:
            loss = opt.step(forward_backward)
            done = not opt.step_was_skipped
        else:
            loss = forward_backward()
            if (i + 1) % k:
                assert opt.step() is False  # inside the merge window
                continue
            if clip:
                out["norms"].append(float(opt.clip_grad_norm_(0.5)))
            done = opt.step()
        out["losses"].append(float(loss.detach()))
        out["applied"].append(done)
        out["scales"].append(opt.get_loss_scaling())
        out["params"].append(_flat(opt.fp32_state_dict(wrapped)))
    out["last_overflow"] = opt.stats()["last_overflow"]
    out["retries"] = opt.stats().get("retries")
    return out


def _flat(state: dict) -> torch.Tensor:
    return torch.cat([v.detach().float().reshape(-1) for k, v in state.items() if "running" not in k])


def _both(rank, world, make_strategy, inject_at=None):
    """The same training unsharded, then with stage 3, in the same processes."""
    return {stage: _train(rank, world, make_strategy(stage), inject_at=inject_at) for stage in (0, 3)}


def _o2_bf16(stage):
    return _strategy(stage, use_pure_fp16=True, dtype="bfloat16")


def _o1_bf16(stage):
    return _strategy(stage, dtype="bfloat16")


def _amp_off(stage):
    return _strategy(stage, amp=False)


def _o2_fp16(stage):
    return _strategy(stage, use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0, decr_every_n_nan_or_inf=1)


def _closure_with_retry(rank, world):
    strategy = _strategy(3, use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0, overflow_retries=1)
    return _train(rank, world, strategy, inject_at=1, inject_rank=1, closure=True)


def _o2_bf16_merge(stage):
    return _strategy(stage, k_steps=2, use_pure_fp16=True, dtype="bfloat16")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("make_strategy", [_o2_bf16, _o1_bf16, _amp_off, _o2_bf16_merge],
                         ids=["O2-bf16", "O1-bf16", "amp-off", "O2-bf16-merge2"])
def test_stage3_trains_like_unsharded_with_one_global_clip_norm(make_strategy):
    ranks = run_workers(_both, 2, make_strategy, timeout=200)
    for run in ranks:
        unsharded, sharded = run[0], run[3]
        assert sharded["applied"] == [True] * STEPS
        # One global norm: the same on every rank, and the unsharded run's up to BF16 rounding.
        assert sharded["norms"] == ranks[0][3]["norms"]
        for a, b in zip(sharded["norms"], unsharded["norms"], strict=True):
            assert a == pytest.approx(b, rel=2e-2)
        if make_strategy is _amp_off:
            torch.testing.assert_close(sharded["params"][-1], unsharded["params"][-1], rtol=1e-5, atol=1e-6)
        else:
            assert_within_bf16_rounding(sharded["params"][-1], unsharded["params"][-1], ulps=8)


@pytest.mark.timeout(240)
def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank_and_names_the_parameter():
    ranks = run_workers(_both, 2, _o2_fp16, 2, timeout=200)
    for run in ranks:
        sharded, unsharded = run[3], run[0]
        assert sharded["applied"] == [True, True, False, True, True]
        assert sharded["scales"] == [1024.0, 1024.0, 512.0, 512.0, 512.0]
        assert sharded["last_overflow"] == {"step": 3, "params": ["3.bias"]}
        assert torch.equal(sharded["params"][2], sharded["params"][1])  # skipped: nothing moved
        assert unsharded["applied"] == sharded["applied"]
        assert sharded["losses"][-1] == pytest.approx(unsharded["losses"][-1], rel=2e-2)
    for step in range(STEPS):  # the full model gathered on each rank: bitwise the same
        assert torch.equal(ranks[0][3]["params"][step], ranks[1][3]["params"][step])


@pytest.mark.timeout(180)
def test_closure_overflow_retries_the_batch_at_a_lower_scale_on_every_rank():
    ranks = run_workers(_closure_with_retry, 2, timeout=150)
    for out in ranks:
        assert out["applied"] == [True] * STEPS  # the poisoned batch was retried, not dropped
        assert out["scales"][1] == 512.0
        assert out["last_overflow"] == {"step": 2, "params": ["3.bias"]}
    assert torch.equal(ranks[0]["params"][-1], ranks[1]["params"][-1])


def _dtypes(rank, world, configs):
    """What stage 3 stores, gathers, reduces and accumulates, per the policy."""
    from distamp import fleet
    from distamp.sharding.fsdp_comms import WireReduceScatter

    fleet.init()
    model = _model()
    strategy = _strategy(3, **configs)
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    seen = {}

    def record(module, args, index):
        seen.setdefault(f"gathered {index}", module.weight.dtype)

    for index in (0, 1):
        model[index].register_forward_pre_hook(lambda m, args, index=index: record(m, args, index))
    wire = []
    original = WireReduceScatter.__call__

    def spy(self, output_tensor, input_tensor, group, op, async_op=False):
        wire.append((input_tensor.dtype, output_tensor.dtype))
        return original(self, output_tensor, input_tensor, group, op, async_op)

    WireReduceScatter.__call__ = spy
    try:
        x, y = _batches(world, 1)[0]
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x[:PER_RANK]).float(), y[:PER_RANK])
        opt.backward(loss)
    finally:
        WireReduceScatter.__call__ = original
    seen["shards"] = sorted({str(p.to_local().dtype) for p in model.parameters()})
    seen["grads"] = sorted({str(p.grad.to_local().dtype) for p in model.parameters()})
    seen["wire"] = sorted({str(d) for pair in wire for d in pair})
    seen["policy"] = model[0]._get_fsdp_state()._mp_policy
    seen["local rows"] = model[0].weight.to_local().shape[0]
    assert opt.step()
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("configs", "gathered", "wire"), [
    ({"use_pure_fp16": True, "dtype": "bfloat16"}, torch.bfloat16, "torch.bfloat16"),
    ({"use_pure_fp16": True, "dtype": "float16", "comm_dtype": "float32"}, torch.float16, "torch.float32"),
    ({"dtype": "bfloat16"}, torch.float32, "torch.bfloat16"),
], ids=["O2-bf16", "O2-fp16-fp32-wire", "O1-bf16"])
def test_shards_gathered_parameters_and_reduction_have_the_policys_dtypes(configs, gathered, wire):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for seen in run_workers(_dtypes, 2, configs, timeout=150):
        assert seen["shards"] == ["torch.float32"]  # the FP32 shard is the master
        assert seen["grads"] == ["torch.float32"]  # reduced gradients accumulate in FP32
        assert seen["gathered 0"] == gathered  # what forward computes with
        assert seen["gathered 1"] == torch.float32  # LayerNorm: kept FP32 in O2 too
        assert seen["wire"] == [wire]
        pure = configs.get("use_pure_fp16", False)
        assert seen["policy"] == MixedPrecisionPolicy(param_dtype=gathered if pure else None,
                                                      reduce_dtype=getattr(torch, wire[6:]),
                                                      cast_forward_inputs=False)
        assert seen["local rows"] == 8  # Linear(6, 16): 16 rows over 2 ranks


def _check_nan_inf(rank, world, where):
    from distamp import fleet

    fleet.init()
    model = _model()
    strategy = _strategy(3, use_pure_fp16=True, dtype="bfloat16", check_nan_inf=True)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    x, y = _batches(world, 1)[0]
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(x).float(), y)
    opt.minimize(loss)  # the first step is clean
    if where == "forward":
        model[1].register_forward_pre_hook(lambda m, args: (args[0] * float("inf"),))
    else:
        def poison_output_grad(module, args, out):
            # On the layer's output: its parameters' gradients are computed from it after this hook ran.
            out.register_hook(lambda g: g * float("inf"))

        model[3].register_forward_hook(poison_output_grad)
    try:
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.minimize(loss)
    except FloatingPointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "named"), [
    ("forward", "in the forward output of module '1' (LayerNorm) on rank 0 at step 2"),
    ("gradient", "in the local gradient of parameter '3."),
])
def test_check_nan_inf_names_the_module_or_the_parameter_under_stage3(where, named):
    (message,) = run_workers(_check_nan_inf, 1, where, timeout=100)
    assert message is not None
    assert named in message


def _misuse(rank, world):
    from distamp import fleet

    fleet.init()
    errors = {}
    try:
        fleet.distributed_model(_model(), _strategy(3, units=["blocks.*"]))
    except ValueError as exc:
        errors["units"] = str(exc)
    try:
        fleet.distributed_model(_model(), _strategy(3), find_unused_parameters=True)
    except ValueError as exc:
        errors["kwargs"] = str(exc)
    model = _model()
    wrapped = fleet.distributed_model(model, _strategy(3))
    try:
        fleet.distributed_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1),
                                    _strategy(2, use_pure_fp16=True, dtype="bfloat16"))
    except RuntimeError as exc:
        errors["stage"] = str(exc)
    lone_model = _model()
    lone = fleet.distributed_optimizer(torch.optim.SGD(lone_model.parameters(), lr=0.1), _strategy(3))
    lone.backward(lone_model(torch.ones(2, 6)).sum())
    try:
        lone.step()
    except RuntimeError as exc:
        errors["unsharded"] = str(exc)
    return errors


@pytest.mark.timeout(120)
def test_stage3_misuse_fails_with_the_fix():
    (errors,) = run_workers(_misuse, 1, timeout=100)
    assert re.match(r"sharding_configs\['units'\] pattern 'blocks\.\*' matches no submodule of Sequential\..*"
                    r"the model's modules: '0', '1', '2', '3'\.", errors["units"])
    assert ("find_unused_parameters=...): sharding stage 3 shards with torch's FSDP2 and builds no DDP"
            in errors["kwargs"])
    assert "the optimizer's strategy is not stage 3" in errors["stage"]
    assert "call model = fleet.distributed_model(model)" in errors["unsharded"]


def _units_and_fp32_modules(rank, world):
    from torch.distributed.fsdp import FSDPModule

    from distamp import fleet

    fleet.init()
    out = {}
    for name, configs, units in (
        ("black", {"use_pure_fp16": True, "dtype": "bfloat16", "custom_black_varnames": ["3"]}, ()),
        ("norm_low", {"use_pure_fp16": True, "dtype": "bfloat16", "keep_norm_fp32": False}, ("0",)),
        ("o1", {"dtype": "bfloat16"}, ("3",)),
    ):
        model = _model()
        strategy = _strategy(3, units=units, **configs)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        gathered = {}
        for index in (0, 1, 3):
            model[index].register_forward_pre_hook(
                lambda m, args, index=index, seen=gathered: seen.__setitem__(index, m.weight.dtype))
        x, y = _batches(world, 1)[0]
        with fleet.auto_cast():
            output = wrapped(x[:PER_RANK])
            loss = F.mse_loss(output.float(), y[:PER_RANK])
        out[name] = {"units": [i for i in range(4) if isinstance(model[i], FSDPModule)], "gathered": gathered,
                     "output": output.dtype, "applied": opt.minimize(loss)}
    return out


@pytest.mark.timeout(120)
def test_units_patterns_and_o2_fp32_modules_decide_what_is_gathered_in_which_dtype():
    (out,) = run_workers(_units_and_fp32_modules, 1, timeout=100)
    f32, bf16 = torch.float32, torch.bfloat16
    # Default units; the black module and the LayerNorm are FP32 units; the black module's output stays FP32.
    assert out["black"] == {"units": [0, 1, 3], "gathered": {0: bf16, 1: f32, 3: f32}, "output": f32, "applied": True}
    # Only the named unit (no FP32 norm unit without keep_norm_fp32): the rest is gathered with the root.
    assert out["norm_low"] == {"units": [0], "gathered": {0: bf16, 1: bf16, 3: bf16}, "output": bf16,
                               "applied": True}
    # O1: FP32 parameters, computed in BF16 under auto_cast.
    assert out["o1"] == {"units": [3], "gathered": {0: f32, 1: f32, 3: f32}, "output": bf16, "applied": True}


def _step(wrapped, opt, x, y):
    from distamp import fleet

    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(x).float(), y)
    opt.zero_grad()
    opt.backward(loss)
    return opt.step()


def _move_after_a_step(rank, world, o2):
    from distamp import fleet

    fleet.init()
    model = _model()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      _strategy(3, use_pure_fp16=o2, dtype="bfloat16"))
    wrapped = fleet.distributed_model(model)
    (x, y), (x2, y2) = [(a[rank * PER_RANK:(rank + 1) * PER_RANK], b[rank * PER_RANK:(rank + 1) * PER_RANK])
                        for a, b in _batches(world, 2)]
    applied = [_step(wrapped, opt, x, y)]
    moved = wrapped.to("cpu")  # the gradients of the step are still there
    applied.append(_step(wrapped, opt, x2, y2))
    return moved is wrapped, applied


@pytest.mark.parametrize("o2", [False, True])
def test_stage3_model_moves_after_a_training_step(o2):
    for same, applied in run_workers(_move_after_a_step, 2, o2, timeout=120):
        assert same
        assert applied == [True, True]


def _cast_after_sharding(rank, world, names):
    from distamp import fleet

    fleet.init()
    model = _model()
    _opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), _strategy(3, dtype="bfloat16"))
    wrapped = fleet.distributed_model(model)
    casts = {"half": wrapped.half, "double": wrapped.double, "to": lambda: wrapped.to("cpu", torch.float16),
             "type": lambda: wrapped.type(torch.bfloat16)}
    messages = []
    for name in names:
        try:
            casts[name]()
        except RuntimeError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    # What keeps the FP32 shards' dtype is no cast and works.
    same = [wrapped.float() is wrapped, wrapped.to(torch.float32) is wrapped, wrapped.to("cpu") is wrapped]
    return messages, same


def test_stage3_refuses_a_cast_after_sharding_with_what_to_do():
    names = ["half", "double", "to", "type"]
    for messages, same in run_workers(_cast_after_sharding, 2, names, timeout=120):
        assert same == [True, True, True]
        for name, message in zip(names, messages, strict=True):
            assert message is not None, name
            assert "FSDP2 cannot cast sharded parameters" in message
            assert "Cast the model before fleet.distributed_model" in message
        assert messages[0].startswith("model.half() after fleet.distributed_model would cast the sharded "
                                      "torch.float32 parameters to torch.float16")


class _WholeStepAdamW(torch.optim.AdamW):
    """AdamW that distamp may not cut (not an exact torch type): stepped once, on whole gradient shards."""


def _chunked_and_whole_steps(rank, world):
    """Stage 3 O2 BF16 with AdamW (stepped a chunk at a time: the 512 x 512 weight's 131072-element shard is cut
    in slices) and with an AdamW distamp steps whole, on the same data; an inf on rank 1 at the second step."""
    from distamp import fleet

    fleet.init()
    out = {}
    for name, optimizer_type in (("chunked", torch.optim.AdamW), ("whole", _WholeStepAdamW)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
        strategy = _strategy(3, use_pure_fp16=True, dtype="bfloat16")
        opt = fleet.distributed_optimizer(optimizer_type(model.parameters(), lr=1e-2, weight_decay=0.1), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        g = torch.Generator().manual_seed(rank)
        grads_after_step, applied = [], []
        for step in range(4):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            if rank == 1 and step == 1:
                x[0, 0] = float("inf")
            with fleet.auto_cast():
                loss = F.mse_loss(wrapped(x).float(), y)
            opt.zero_grad()
            opt.backward(loss)
            assert all(p.grad is not None for p in wrapped.module.parameters())  # the shards, until the step
            applied.append(opt.step())
            grads_after_step.append(sum(p.grad is not None for p in wrapped.module.parameters()))
        out[name] = {"params": _flat(opt.fp32_state_dict(wrapped)), "applied": applied,
                     "grads_after_step": grads_after_step,
                     # DTensors, as AdamW makes them for DTensor parameters (full_tensor fails on a plain one).
                     "moments": [opt.inner_opt.state[p][k].full_tensor() for group in opt.inner_opt.param_groups
                                 for p in group["params"] for k in ("exp_avg", "exp_avg_sq")],
                     "steps": [float(s["step"]) for s in opt.inner_opt.state.values()]}
    return out


@pytest.mark.timeout(120)
def test_stage3_steps_in_chunks_bitwise_like_one_step_and_frees_the_gradient_shards_after_every_step():
    for out in run_workers(_chunked_and_whole_steps, 2, timeout=100):
        chunked, whole = out["chunked"], out["whole"]
        assert chunked["applied"] == whole["applied"] == [True, False, True, True]
        assert torch.equal(chunked["params"], whole["params"])
        assert len(chunked["moments"]) == len(whole["moments"]) == 12
        assert all(torch.equal(a, b) for a, b in zip(chunked["moments"], whole["moments"], strict=True))
        assert chunked["steps"] == whole["steps"] == [3.0] * 6
        # Applied or skipped, the step ends the gradient shards (a loop that zeroes late holds nothing through
        # the next forward).
        assert chunked["grads_after_step"] == whole["grads_after_step"] == [0, 0, 0, 0]


class _Attention(nn.Module):
    """No ModuleList or Sequential: the default units are the modules holding parameters of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)  # reads out_proj.weight in its forward
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).unsqueeze(0)
        return self.head(self.attn(h, h, h, need_weights=False)[0].squeeze(0))


def _train_o2_bf16_sgd(rank, world, stage, make_model):
    """Three O2 BF16 SGD steps on this rank's batches: the wrapped model, the optimizer, the losses and the
    last batch's input."""
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = make_model()
    strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    losses = []
    for x, y in _batches(world, 3):
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
        losses.append(loss.item())
    return wrapped, opt, losses, x


def _train_attention(rank, world, stage):
    # SGD, not AdamW: the key bias's gradient is zero up to rounding (softmax ignores it), which AdamW would
    # turn into full-size steps of either sign.
    wrapped, opt, _, _ = _train_o2_bf16_sgd(rank, world, stage, _Attention)
    return _flat(opt.fp32_state_dict(wrapped))


@pytest.mark.timeout(120)
def test_default_units_keep_multihead_attention_whole_and_train_like_unsharded():
    # out_proj as a unit of its own would stay sharded when nn.MultiheadAttention reads its weight.
    for unsharded, sharded in zip(run_workers(_train_attention, 2, 0, timeout=100),
                                  run_workers(_train_attention, 2, 3, timeout=100), strict=True):
        assert_within_bf16_rounding(sharded, unsharded, ulps=8)


class _FloatFeatures(nn.Module):
    """A forward that computes from its FP32 input outside autocast's ops (as a timestep embedding does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.cos(x[:, :3] * 100.0)


def _train_float_features(rank, world, stage):
    wrapped, opt, losses, x = _train_o2_bf16_sgd(rank, world, stage, _FloatFeatures)
    hint = ""
    try:
        wrapped(x)  # outside fleet.auto_cast()
    except RuntimeError as error:
        hint = str(error)
    return losses, _flat(opt.fp32_state_dict(wrapped)), hint


@pytest.mark.timeout(120)
def test_o2_forward_gets_its_fp32_inputs_as_unsharded_o2_does():
    """Stage 3 O2 leaves the model's inputs FP32, as unsharded O2 (was: FSDP2 cast every input to BF16 first)."""
    unsharded = run_workers(_train_float_features, 2, 0, timeout=100)
    sharded = run_workers(_train_float_features, 2, 3, timeout=100)
    for (losses0, params0, hint0), (losses3, params3, hint3) in zip(unsharded, sharded, strict=True):
        assert losses3 == losses0
        assert torch.equal(params3, params0)
        assert "run the forward under `with fleet.auto_cast():`" in hint0
        assert "run the forward under `with fleet.auto_cast():`" in hint3


class _TiedOutsideItsUnit(nn.Module):
    """The forward reads the embedding's weight itself (a tied output head): outside the embedding's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(31, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(x)) @ self.embed.weight.t()


def _train_tied(rank, world, units):
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = _TiedOutsideItsUnit()
    strategy = _strategy(3, units=units, use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    x = torch.randint(0, 31, (2, 5), generator=torch.Generator().manual_seed(rank))
    try:
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x).float().flatten(0, 1), x.flatten())
    except RuntimeError as error:
        return str(error)
    opt.backward(loss)
    return opt.step()


@pytest.mark.timeout(120)
def test_a_parameter_read_outside_its_unit_fails_naming_the_units_and_the_named_units_train():
    for message in run_workers(_train_tied, 2, (), timeout=100):
        assert "used a parameter outside the forward of the unit that holds it" in message
        assert "sharding_configs['units']" in message
        assert "Units now: ['embed', 'proj']" in message
    assert run_workers(_train_tied, 2, ["proj"], timeout=100) == [True, True]  # the embedding stays in the root


class _TiedHead(nn.Module):
    """A small GPT's tied weights without a ModuleList: the head's weight is the embedding's Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(31, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 31, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.proj(self.embed(x))))


def _train_tied_head(rank, world, stage, units):
    from distamp import fleet

    fleet.init()
    torch.manual_seed(0)
    model = _TiedHead()
    strategy = _strategy(stage, units=units, use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    try:
        wrapped = fleet.distributed_model(model, strategy)
    except ValueError as error:
        return str(error)
    for step in range(3):
        x = torch.randint(0, 31, (2 * world, 5), generator=torch.Generator().manual_seed(step))[2 * rank:2 * rank + 2]
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x).float().flatten(0, 1), x.flatten())
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()
    assert model.head.weight is model.embed.weight
    return _flat(opt.fp32_state_dict(wrapped))


@pytest.mark.timeout(200)
def test_default_units_keep_tied_weights_in_the_root_and_units_sharing_a_parameter_are_refused():
    # Default units were 'embed', 'proj' and 'head': FSDP2 refused the tied weight in a second unit.
    unsharded = run_workers(_train_tied_head, 2, 0, (), timeout=100)
    sharded = run_workers(_train_tied_head, 2, 3, (), timeout=100)
    for a, b in zip(sharded, unsharded, strict=True):
        assert_within_bf16_rounding(a, b, ulps=8)
    for message in run_workers(_train_tied_head, 2, 3, ["embed", "head"], timeout=100):
        assert message == (
            "sharding stage 3: parameter 'embed.weight' is held by 'embed' and 'head', but FSDP2 shards a "
            "parameter in one unit only (tied weights, one Parameter set on two modules). Name units in "
            "sharding_configs['units'] that leave every module holding it in one unit, or in the root; units now: "
            "['embed', 'head'].")


def _empty_shard(rank, world, algorithm, pure, head_only=False):
    """A head of one output row: its weight and bias shards are empty on rank 1 (with ``head_only`` rank 1
    holds nothing at all)."""
    from distamp import fleet

    torch.manual_seed(0)
    model = nn.Sequential(*([] if head_only else [nn.Linear(6, 32), nn.ReLU()]), nn.Linear(32, 1))
    fp16 = {"dtype": "float16", "init_loss_scaling": 256.0} if algorithm == "lognormal" else {"dtype": "bfloat16"}
    strategy = _strategy(3, use_pure_fp16=pure, loss_scaling_algorithm=algorithm, **fp16)
    fleet.init()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model)
    g = torch.Generator().manual_seed(rank)
    applied, norms = [], []
    for i in range(3):
        with fleet.auto_cast():
            x = torch.randn(4, 32 if head_only else 6, generator=g)
            loss = F.mse_loss(wrapped(x).float(), torch.randn(4, 1, generator=g))
        if i == 1 and rank == 0:
            loss = loss * float("inf")
        opt.zero_grad()
        opt.backward(loss)
        if i != 1:
            norms.append(float(opt.clip_grad_norm_(1.0, norm_type=float("inf"))))
        applied.append(opt.step())
    state = opt.state_dict()["inner"]["state"]
    return {"applied": applied, "norms": norms, "overflow": opt.stats()["last_overflow"],
            "state": {i: {k: v.clone() for k, v in entry.items()} for i, entry in state.items()}}


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("algorithm", "pure"), [("backoff", True), ("backoff", False), ("lognormal", True)])
def test_a_parameter_with_fewer_rows_than_ranks_skips_clips_and_gathers_its_state_on_every_rank(algorithm, pure):
    # Rank 1's shards of the 1x32 weight and the 1-element bias are empty: the skipped step's names, the
    # infinity-norm clip and the lognormal scaler's max |g| used to fail on the empty shard, and
    # state_dict() gathered the state in the order each rank first stepped it (smallest shard first), which
    # differs between the ranks: gloo aborted on the mismatched sizes.
    out = run_workers(_empty_shard, 2, algorithm, pure, timeout=180)
    for rank in (0, 1):
        assert out[rank]["applied"] == [True, False, True]
        assert out[rank]["overflow"]["step"] == 2
        assert out[rank]["norms"] == out[0]["norms"]
        assert list(out[rank]["state"]) == [0, 1, 2, 3]
        for i in range(4):
            for key, value in out[rank]["state"][i].items():
                assert torch.equal(value, out[0]["state"][i][key]), (rank, i, key)
    assert out[0]["state"][2]["exp_avg"].shape == (1, 32)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algorithm", ["backoff", "lognormal"])
def test_a_rank_whose_shards_are_all_empty_skips_clips_and_gathers_alike(algorithm):
    out = run_workers(_empty_shard, 2, algorithm, True, True, timeout=180)
    for rank in (0, 1):
        assert out[rank]["applied"] == [True, False, True]
        assert out[rank]["overflow"]["step"] == 2
        assert out[rank]["norms"] == out[0]["norms"]
        assert list(out[rank]["state"]) == [0, 1]
        for i in range(2):
            for key, value in out[rank]["state"][i].items():
                assert torch.equal(value, out[0]["state"][i][key]), (rank, i, key)


def _batch_norm(rank, world, stage, **ddp_kwargs):
    from distamp import fleet

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    fleet.init()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      _strategy(stage, use_pure_fp16=True, dtype="bfloat16"))
    wrapped = fleet.distributed_model(model, **ddp_kwargs)
    g = torch.Generator().manual_seed(rank)  # each rank its own data: its own batch statistics
    for _ in range(3):
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(torch.randn(8, 6, generator=g)).float(), torch.randn(8, 3, generator=g))
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    with torch.no_grad(), fleet.auto_cast():  # an evaluation forward: it reads rank 0's buffers already
        wrapped.eval()
        wrapped(torch.randn(8, 6, generator=g))
    bn = model[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [2, 3])
def test_buffers_follow_rank_zero_before_each_training_forward_as_ddp_broadcasts_them(stage):
    # Stage 3 (FSDP2) synced no buffer: each rank kept its own BatchNorm statistics, and a checkpoint,
    # which keeps rank 0's, resumed rank 1 with other values than it trained with.
    out = run_workers(_batch_norm, 2, stage, timeout=180)
    for a, b in zip(out[0], out[1], strict=True):
        assert torch.equal(a, b)
    assert int(out[0][2]) == 3
    if stage == 3:
        reference = run_workers(_batch_norm, 2, 2, timeout=180)  # stage 2 broadcasts as DDP does
        for a, b in zip(out[0], reference[0], strict=True):
            assert torch.equal(a, b)


def _batch_norm_unbroadcast(rank, world, stage):
    """The buffers of ``_batch_norm`` with ``broadcast_buffers=False``; at stage 3 also the refusal of DDP's other
    options, given before (and instead of) the model's sharding."""
    from distamp import fleet

    refused = None
    if stage == 3:
        fleet.init()
        fleet.distributed_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters()), _strategy(3))
        try:
            fleet.distributed_model(nn.Linear(2, 2), broadcast_buffers=False, find_unused_parameters=True,
                                    static_graph=True, bucket_cap_mb=1)
        except ValueError as exc:
            refused = str(exc)
    return _batch_norm(rank, world, stage, broadcast_buffers=False), refused


@pytest.mark.timeout(200)
def test_stage_3_keeps_each_ranks_buffers_with_broadcast_buffers_false_and_names_the_ddp_options_it_refuses():
    # was: stage 3 refused broadcast_buffers=False with every DDP option ("remove them"), so BatchNorm statistics
    # could only follow rank 0's there, and the refusal said nothing of why each option was not needed
    out = run_workers(_batch_norm_unbroadcast, 2, 3, timeout=180)
    reference = run_workers(_batch_norm_unbroadcast, 2, 2, timeout=180)  # stage 2 honours it as DDP does
    assert not torch.equal(out[0][0][0], out[1][0][0])  # each rank its own statistics
    for rank in (0, 1):
        for a, b in zip(out[rank][0], reference[rank][0], strict=True):
            assert torch.equal(a, b)
        message = out[rank][1]
        assert "find_unused_parameters=..., static_graph=..., bucket_cap_mb=...)" in message
        assert "broadcast_buffers=..." not in message
        assert "find_unused_parameters: not needed" in message
        assert "static_graph: not needed" in message
        assert "sharding_configs['units']" in message
        assert re.search(r"takes only \['broadcast_buffers'(, 'forward_sync_buffers')?\]$", message)


def _start_buffers(rank, world):
    """BatchNorm's running mean, rank + 1 on each rank before the wrap, after the wrappers of stages 0, 2 and 3
    are built and ran an evaluation forward, with and without broadcast_buffers."""
    from distamp import fleet

    fleet.init()
    out = {}
    kept = []  # fleet holds optimizers weakly; stage 2 needs each attached at its model's forward
    for stage in (0, 2, 3):
        for broadcast in (True, False):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            model[1].running_mean.fill_(rank + 1.0)
            strategy = _strategy(stage)
            kept.append(fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy))
            wrapped = fleet.distributed_model(model, strategy, **({} if broadcast else {"broadcast_buffers": False}))
            with torch.no_grad():
                wrapped.eval()(torch.randn(2, 4))
            out[stage, broadcast] = model[1].running_mean.clone()
    return out


@pytest.mark.timeout(120)
def test_broadcast_buffers_false_keeps_each_ranks_buffers_from_the_start_as_ddp_does():
    # was: stages 2 and 3 broadcast rank 0's buffers when the model was built even with broadcast_buffers=False,
    # which DDP (stages 0 and 1) leaves each rank's own from the start (rank-local buffers)
    for rank, out in enumerate(run_workers(_start_buffers, 2, timeout=100)):
        for stage in (0, 2, 3):
            assert torch.equal(out[stage, True], torch.full((4,), 1.0)), (rank, stage)
            assert torch.equal(out[stage, False], torch.full((4,), rank + 1.0)), (rank, stage)


_BUFFER_OPTIONS = [
    {},
    {"forward_sync_buffers": False},
    {"forward_sync_buffers": True, "broadcast_buffers": False},
    {"forward_sync_buffers": False, "broadcast_buffers": True},
    {"broadcast_buffers": False},
]
"""DDP's buffer options as torch 2.13+ takes them: forward_sync_buffers alone, with broadcast_buffers (ignored)."""


def _buffer_options(rank, world):
    """Per stage (0: DDP) and per option set of _BUFFER_OPTIONS: the FP32 model and BatchNorm buffers after three
    steps on each rank's own data, its running mean rank + 1 before the wrap, and the FutureWarnings the wrap gave."""
    import warnings

    from distamp import fleet

    fleet.init()
    out = {}
    for stage in (0, 2, 3):
        for i, options in enumerate(_BUFFER_OPTIONS):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
            model[1].running_mean.fill_(rank + 1.0)
            strategy = _strategy(stage, amp=False)  # FP32: every stage sums g0/2 + g1/2, bit for bit
            opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrapped = fleet.distributed_model(model, strategy, **options)
                g = torch.Generator().manual_seed(rank)  # each rank its own data: its own batch statistics
                for _ in range(3):
                    loss = F.mse_loss(wrapped(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g))
                    opt.zero_grad()
                    opt.backward(loss)
                    opt.step()
            state = {k: v.clone() for k, v in wrapped.fp32_state_dict().items()}
            future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
            out[stage, i] = state, future
    return out


@pytest.mark.timeout(200)
@pytest.mark.skipif(not _ddp_takes("forward_sync_buffers"), reason="torch's DDP has no forward_sync_buffers")
def test_forward_sync_buffers_is_honoured_at_stages_2_and_3_as_ddp_does():
    # was: stages 2 and 3 refused torch 2.13's forward_sync_buffers (DDP's replacement of broadcast_buffers), so a
    # user following torch's deprecation could not shard; DDP broadcasts the buffers at build whatever its value
    results = run_workers(_buffer_options, 2, timeout=180)
    for rank, out in enumerate(results):
        for i, options in enumerate(_BUFFER_OPTIONS):
            ddp_state, ddp_warnings = out[0, i]
            for stage in (2, 3):
                state, stage_warnings = out[stage, i]
                assert state.keys() == ddp_state.keys()
                for key, value in ddp_state.items():
                    assert torch.equal(state[key], value), (rank, stage, options, key)
                # Where DDP warns of broadcast_buffers (deprecated, or ignored beside forward_sync_buffers), so do they.
                assert bool(stage_warnings) == bool(ddp_warnings), (stage, options, stage_warnings)
            assert bool(ddp_warnings) == ("broadcast_buffers" in options), (options, ddp_warnings)
    # The options differ where DDP says: forward_sync_buffers=False broadcasts at build, broadcast_buffers=False not;
    # given both, forward_sync_buffers decides.
    means = {i: [out[0, i][0]["1.running_mean"] for out in results] for i in range(len(_BUFFER_OPTIONS))}
    for rank in (0, 1):
        assert torch.equal(means[2][rank], means[0][rank])
        assert torch.equal(means[3][rank], means[1][rank])
    assert not torch.equal(means[1][1], means[4][1])  # rank 1 started from rank 0's statistics, or from its own
    assert not torch.equal(means[1][0], means[1][1])  # no forward broadcast: each rank its own statistics


def _one_process_warnings(rank, world):
    """Per option set of _BUFFER_OPTIONS the installed DDP takes: whether a one-process DDP gives a FutureWarning,
    and whether each stage's fleet.distributed_model (and a training forward) does."""
    import warnings

    from distamp import fleet

    fleet.init()
    out = {}
    kept = []  # fleet holds optimizers weakly; stage 2 needs each attached at its model's forward
    elsewhere = []
    for options in _BUFFER_OPTIONS:
        if not all(_ddp_takes(name) for name in options):
            continue
        runs = {}
        for stage in ("ddp", 0, 1, 2, 3):
            model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
            if stage != "ddp":
                strategy = _strategy(stage)
                kept.append(fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if stage == "ddp":
                    nn.parallel.DistributedDataParallel(model, **options)
                else:
                    with fleet.auto_cast():
                        fleet.distributed_model(model, strategy, **options)(torch.randn(4, 2))
            future = [w for w in caught if issubclass(w.category, FutureWarning)]
            runs[stage] = bool(future)
            if stage != "ddp":  # distamp's warning names the user's line (was, at stage 3: inside FullyShardedModel)
                elsewhere += [(stage, w.filename, w.lineno) for w in future if w.filename != __file__]
        out[str(options)] = runs
    out["elsewhere"] = elsewhere
    return out


@pytest.mark.timeout(120)
def test_a_one_process_world_warns_of_broadcast_buffers_at_every_stage_as_ddp_does():
    # was: stage 3 warned in a one-process world and stages 0-2, which build nothing there, stayed silent;
    # torch's DDP warns when built in a one-process world too
    (out,) = run_workers(_one_process_warnings, 1, timeout=100)
    assert out.pop("elsewhere") == []
    assert "{}" in out
    assert "{'broadcast_buffers': False}" in out
    for options, runs in out.items():
        assert runs == dict.fromkeys(runs, runs["ddp"]), options
    assert out["{'broadcast_buffers': False}"]["ddp"] == _ddp_takes("forward_sync_buffers")
    assert not out["{}"]["ddp"]


@pytest.mark.parametrize("name", ["forward_sync_buffers", "batched_grad_copy", "lazy_bucket_allocation"])
def test_ddp_options_of_a_later_torch_are_refused_at_every_stage_naming_the_torch_version(name):
    # was: "not keyword arguments of fleet.distributed_model" (stage 3: "not taken at stage 3"), not saying why
    from distamp.model.data_parallel import DataParallel
    from distamp.model.ddp_preparation import refuse_stage3_kwargs

    if _ddp_takes(name):
        pytest.skip(f"this torch's DDP has {name}")
    why = rf"{name}: DDP in the installed torch {re.escape(torch.__version__)} has no such argument \(torch 2\.1\d's"
    for stage in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"\['{name}'\] are not keyword arguments of .*\({why}"):
            DataParallel(nn.Linear(2, 2), _strategy(stage), **{name: True})
    with pytest.raises(ValueError, match=rf"stage 3 .*\({why}"):
        refuse_stage3_kwargs({name: True})


def test_every_ddp_option_stages_2_and_3_refuse_is_named_with_its_own_reason():
    # was: stage 3 said "not taken at stage 3" for dim, check_reduction, device_mesh, mixed_precision, ... and
    # stage 2 listed dim, check_reduction, device_mesh, ... among the refused with no reason at all
    from distamp.model.data_parallel import DataParallel
    from distamp.model.ddp_preparation import STAGE2_DDP_KWARGS, STAGE3_DDP_KWARGS, refuse_stage3_kwargs

    names = [name for name in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
             if name not in ("self", "module")]
    for name in names:
        if name not in STAGE3_DDP_KWARGS:
            with pytest.raises(ValueError, match=rf"sharding stage 3 .*\({name}: \w") as stage_3:
                refuse_stage3_kwargs({name: None})
            assert "not taken at stage 3" not in str(stage_3.value), name
        if name not in (*STAGE2_DDP_KWARGS, "process_group", "find_unused_parameters"):  # the last two it takes
            with pytest.raises(ValueError, match=rf"sharding stage 2 .* remove the others \({name}: \w"):
                DataParallel(nn.Linear(2, 2), _strategy(2), **{name: None})


def _rank_seeded_start(rank, world):
    from distamp import fleet

    torch.manual_seed(rank)  # each rank its own initial weights and statistics, as an unseeded script has
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    model[1].running_mean.normal_()
    fleet.init()
    _opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(3))
    wrapped = fleet.distributed_model(model)
    return {"state": {k: v.clone() for k, v in wrapped.fp32_state_dict().items()},
            "buffer": model[1].running_mean.clone()}


@pytest.mark.timeout(200)
def test_stage3_starts_every_rank_from_rank_zero_weights_and_buffers():
    out = run_workers(_rank_seeded_start, 2, timeout=180)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    reference[1].running_mean.normal_()
    for rank in range(2):
        assert out[rank]["state"].keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            assert torch.equal(out[rank]["state"][key], value), (rank, key)
        assert torch.equal(out[rank]["buffer"], reference[1].running_mean)


class _Blocks(nn.Module):
    """Four blocks of one size (stage 3's default units) and a head; ``skip`` names a block the forward leaves out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(8, 2)
        self.skip: int | None = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = block(x)
        return self.head(x)


def _skipped_blocks(rank, world, amp, skips, compiled=False):
    """One step with every block, then one where rank r skips block ``skips[r]``: its error, and the FP32 model
    after each."""
    from distamp import fleet

    strategy = _strategy(3, amp=amp, **({"dtype": "bfloat16", "use_pure_fp16": True} if amp else {}))
    fleet.init()
    model = _Blocks()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    forward = torch.compile(wrapped) if compiled else wrapped
    g = torch.Generator().manual_seed(rank)
    states, error = [], None
    for skip in (None, skips[rank]):
        model.skip = skip
        with fleet.auto_cast():
            loss = forward(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        opt.zero_grad()
        opt.backward(loss)
        try:
            assert opt.step() is True
        except RuntimeError as exc:
            error = str(exc)
        states.append(_flat(opt.fp32_state_dict(wrapped)))
    return error, states


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("amp", "compiled"), [(True, False), (False, False), (True, True)])
def test_ranks_that_ran_different_units_of_one_size_stop_at_the_step_and_apply_nothing(amp, compiled):
    # Rank 0 skips block 1, rank 1 block 2: the same number of equal-sized gathers, which FSDP2 paired silently.
    for error, (after_first, after_second) in run_workers(_skipped_blocks, 2, amp, [1, 2], compiled, timeout=280):
        assert error is not None
        assert "the ranks ran different units" in error
        assert "'blocks.1' ran 0x on rank 0, 1x on rank 1; 'blocks.2' ran 1x on rank 0, 0x on rank 1" in error
        assert "'blocks.0'" not in error
        assert "find_unused_parameters=True" in error
        assert torch.equal(after_second, after_first)


@pytest.mark.timeout(180)
def test_a_unit_skipped_on_every_rank_alike_trains():
    (error0, states0), (error1, states1) = run_workers(_skipped_blocks, 2, True, [1, 1], timeout=170)
    assert error0 is None
    assert error1 is None
    assert not torch.equal(states0[1], states0[0])
    assert torch.equal(states0[1], states1[1])


def _state_not_made_by_sharded_steps(rank, world):
    """Adagrad (its sums made at construction) and a bare torch optimizer's state loaded into ``inner_opt``."""
    from distamp import fleet

    fleet.init()
    batches = [(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
               for x, y in _batches(world, 3)]
    bare = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    for p in bare.param_groups[0]["params"]:
        bare.state[p]["momentum_buffer"] = torch.full_like(p, 0.25)
    saved = bare.state_dict()  # as a script saved it before it adopted distamp

    def run(make_inner, stage, order, load=False):
        model = _model()
        strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16")
        wrapped = fleet.distributed_model(model, strategy) if order == "model first" else None
        opt = fleet.distributed_optimizer(make_inner(model.parameters()), strategy)
        if load:
            opt.inner_opt.load_state_dict(copy.deepcopy(saved))
        wrapped = wrapped or fleet.distributed_model(model, strategy)
        for x, y in batches:
            _step(wrapped, opt, x, y)
        return opt.fp32_state_dict(model)

    adagrad = lambda params: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.5)  # noqa: E731
    momentum = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    return {f"{name}, {order}": (run(make, 0, "optimizer first", load), run(make, 3, order, load))
            for name, make, load in (("Adagrad", adagrad, False), ("loaded SGD", momentum, True))
            for order in ("optimizer first", "model first")}


def test_state_the_optimizer_did_not_make_on_the_shards_is_cut_into_each_ranks_shards():
    """Adagrad's sums come from its constructor, before ``fleet.distributed_model`` shards the parameters;
    ``inner_opt.load_state_dict`` of a bare torch optimizer's state (what distamp's own load asks for) holds
    whole tensors. Both used to stay whole, plain tensors beside DTensor parameters, and the first step raised
    DTensor's "got mixed torch.Tensor and DTensor"."""
    for out in run_workers(_state_not_made_by_sharded_steps, 2, timeout=200):
        for case, (unsharded, sharded) in out.items():
            for name, value in unsharded.items():
                assert torch.equal(sharded[name], value), (case, name)


class _SharedBlock(nn.Module):
    """One block run three times (ALBERT's shared layers), each run in its own activation checkpoint."""

    def __init__(self, use_reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
        self.head = nn.Linear(16, 3)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x = self.embed(x)
        for _ in range(3):
            if self.use_reentrant is None:
                x = self.block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _shared_block_steps(rank, world, use_reentrant, units, amp):
    """Two steps of stage 3 on :class:`_SharedBlock`: the first step's error (if any), and the FP32 model before
    and after."""
    from distamp import fleet

    fleet.init()
    strategy = _strategy(3, amp=amp, units=units, **({"dtype": "bfloat16"} if amp else {}))
    model = _SharedBlock(use_reentrant)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    states, error = [_flat(opt.fp32_state_dict(wrapped))], None
    for x, y in _batches(world, 2):
        try:
            _step(wrapped, opt, x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        except RuntimeError as exc:
            error = str(exc)
            break
        states.append(_flat(opt.fp32_state_dict(wrapped)))
    return error, states


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "amp"), [(2, True), (2, False), (1, True)])
def test_a_unit_run_again_under_reentrant_checkpointing_stops_the_step_on_every_rank(world, amp):
    """FSDP2 does not finish the backward of a unit run several times in one forward when a run is inside a
    reentrant checkpoint: the unit's parameters stay unsharded and only part of its gradient reaches the
    shards (measured: the update of the block 76% off, silently). The step says so and applies nothing."""
    for error, states in run_workers(_shared_block_steps, world, True, [], amp, timeout=280):
        assert error is not None
        assert "FSDP2 did not finish the backward of ['block.0', 'block.1']" in error
        assert "use_reentrant=False" in error
        assert "sharding_configs['units']" in error
        assert len(states) == 1  # the step raised before applying anything


def _shared_block_fixes(rank, world):
    """Each fix, and the same units without checkpointing (AMP off: the same FP32 sums, bit for bit)."""
    cases = {"non-reentrant": (False, []), "block in the root": (True, ["embed", "head"])}
    return {case: (_shared_block_steps(rank, world, use_reentrant, units, False),
                   _shared_block_steps(rank, world, None, units, False))
            for case, (use_reentrant, units) in cases.items()}


@pytest.mark.timeout(300)
def test_the_fixes_the_error_names_train_the_shared_unit_as_without_checkpointing():
    for out in run_workers(_shared_block_fixes, 2, timeout=280):
        for case, ((error, states), (plain_error, plain)) in out.items():
            assert error is None, case
            assert plain_error is None, case
            assert len(states) == len(plain) == 3, case
            for got, expected in zip(states, plain, strict=True):
                assert torch.equal(got, expected), case


class _Float64Tail(nn.Module):
    """An FP32 unit, then a float64 one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.tail = nn.Linear(16, 3).double()

    def forward(self, x):
        return self.tail(self.body(x).double())


def _float64_worker(rank, world):
    import torch.distributed as dist

    from distamp import fleet

    fleet.init()
    x, y = (t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in _batches(world, 1)[0])
    local = _Float64Tail()
    F.mse_loss(local(x), y.double()).backward()
    want = local.tail.weight.grad.clone()
    dist.all_reduce(want)
    want = local.tail.weight.detach() - want / world
    model = _Float64Tail()
    strategy = _strategy(3, amp=False, units=["body", "tail"])
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1.0), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    opt.backward(F.mse_loss(wrapped(x), y.double()))
    assert opt.step()
    got = model.tail.weight.full_tensor()
    exported = opt.fp32_state_dict(wrapped)["tail.weight"]
    return got.dtype, torch.equal(got, want), exported.dtype, torch.equal(exported, want)


def test_amp_off_reduces_a_float64_unit_in_float64_and_exports_it_whole():
    # Was: the policy's reduce_dtype was FP32 with AMP off, so FSDP2 rounded the float64 gradients to FP32 for the
    # reduce-scatter (the update was off by ~1e-7 where unsharded AMP-off training is exact), and fp32_state_dict
    # rounded the float64 parameter to FP32.
    assert run_workers(_float64_worker, 2, timeout=100) == [(torch.float64, True, torch.float64, True)] * 2


def _unfreeze_at_step_two(rank, world):
    """Layer 0 frozen, then made trainable before the third step (gradual unfreezing), unsharded and at stage 3."""
    from distamp import fleet

    fleet.init()
    finals = {}
    for mode, configs in {"O2-fp16": {"use_pure_fp16": True, "init_loss_scaling": 1024.0},
                          "O2-bf16": {"use_pure_fp16": True, "dtype": "bfloat16"},
                          "O1-fp16": {"init_loss_scaling": 1024.0}}.items():
        for stage in (0, 3):
            model = _model()
            if stage == 3:  # FSDP2's lazy init, at the first forward, sees the unit frozen
                model[0].requires_grad_(False)
            strategy = _strategy(stage, **configs)
            strategy.find_unused_parameters = stage == 0
            opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
            wrapped = fleet.distributed_model(model, strategy)
            if stage == 0:  # unsharded, parameters are frozen after distributed_model (its own refusal's fix)
                model[0].requires_grad_(False)
            for i, (x, y) in enumerate(_batches(world, 4)):
                if i == 2:
                    for p in wrapped.module[0].parameters():
                        p.requires_grad_(True)
                assert _step(wrapped, opt, x[rank * PER_RANK:(rank + 1) * PER_RANK],
                             y[rank * PER_RANK:(rank + 1) * PER_RANK])
            finals[mode, stage] = opt.fp32_state_dict(wrapped)
    return finals


@pytest.mark.timeout(240)
def test_a_unit_frozen_at_the_first_forward_trains_like_unsharded_once_unfrozen():
    """FSDP2 fixes a unit's gradient dtypes at its first forward from the parameters trainable then. Was: a unit
    unfrozen later failed in backward in O2 ("attempting to assign a gradient with dtype 'c10::Half' to a tensor
    with grad_dtype 'Float'"), and in O1 reduced in FP32 instead of FP16 (its parameters off the unsharded run's)."""
    for finals in run_workers(_unfreeze_at_step_two, 2, timeout=200):
        for mode in ("O2-fp16", "O2-bf16", "O1-fp16"):
            unsharded, sharded = finals[mode, 0], finals[mode, 3]
            assert not torch.equal(sharded["0.weight"], _model()[0].weight.detach()), mode  # it trained
            for name, value in unsharded.items():
                assert torch.equal(sharded[name], value), (mode, name)
