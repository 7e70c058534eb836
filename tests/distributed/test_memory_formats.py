"""Training without sharding is the same in any memory format: a ``channels_last`` and a transposed weight
train bitwise as their contiguous copies do, on 2 gloo ranks.

Every place that moves a parameter's values or gradient between a flat buffer and the parameter (the FP32
masters and their copy back, the chunked update, DDP's buckets and the 16-bit and PowerSGD comm hooks,
gradient merge's FP32 sum, clipping, checkpoints) must pair elements by index, not by memory order. The
model multiplies its inputs by its weights (``x * weight``), so each gradient is its input whatever the
layout and every comparison can be bitwise. Stages 1 to 3 refuse non-contiguous parameters
(tests/sharding/test_sharding_model_shapes.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.multiprocess import run_workers

LR = 2.0**-4
STEPS = 4


class _Gains(nn.Module):
    """``sum(x_i * w_i)`` over a 4-d, a 2-d and a 1-d weight; ``strided``: the 4-d one ``channels_last``, the 2-d
    one a transposed view."""

    def __init__(self, strided: bool) -> None:
        super().__init__()
        conv, proj = torch.ones(2, 3, 2, 2), torch.ones(3, 2).t()
        if strided:
            conv = conv.to(memory_format=torch.channels_last)
        else:
            proj = proj.contiguous()
        self.conv = nn.Parameter(conv)
        self.proj = nn.Parameter(proj)
        self.bias = nn.Parameter(torch.ones(5))

    def forward(self, xs: list[torch.Tensor]) -> torch.Tensor:
        return sum(((x * w).sum() for x, w in zip(xs, self.parameters(), strict=True)), torch.zeros(()))


def _inputs(rank: int, step: int) -> list[torch.Tensor]:
    """Distinct small integers per element, rank and step (exact in FP16, and their squares and sums in FP32)."""
    return [(torch.arange(n, dtype=torch.float32).view(shape) + 1 + step) * (rank + 1)
            for n, shape in ((24, (2, 3, 2, 2)), (6, (2, 3)), (5, (5,)))]


def _build(strided, pure, powersgd, merge, model=None):
    """``fleet``'s optimizer (AdamW) and wrapper for ``model`` (default: :class:`_Gains`)."""
    from distamp import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True, gradient_merge=merge > 1, powersgd=powersgd)
    strategy.amp_configs = {"use_pure_fp16": pure, "init_loss_scaling": 8.0}
    if merge > 1:
        strategy.gradient_merge_configs = {"k_steps": merge}
    if powersgd:  # compresses the 2 x 12 and 2 x 3 matrices, with error feedback and warm start
        strategy.powersgd_configs = {"rank": 1, "start_step": 0, "min_compression_rate": 1.0}
    model = _Gains(strided) if model is None else model
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=LR), strategy)
    return model, opt, fleet.distributed_model(model, strategy)


def _train(rank, opt, wrapped, steps, clip=None, merge=1):
    """Returns each step's (clipped gradient norm, applied)."""
    from distamp import fleet

    out = []
    for step in steps:
        opt.zero_grad()
        for _ in range(merge):
            with fleet.auto_cast():
                loss = wrapped(_inputs(rank, step))
            opt.backward(loss)
        norm = None if clip is None else float(opt.clip_grad_norm_(clip))
        out.append((norm, opt.step()))
    return out


def _state(model, opt, wrapped):
    """The FP32 weights, the inner optimizer's moments (in index order) and the model's (16-bit in O2) weights."""
    moments = {f"{i}.{k}": v.contiguous() for i, p in enumerate(opt.inner_opt.param_groups[0]["params"])
               for k, v in opt.inner_opt.state[p].items() if k != "step"}
    model_weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    return opt.fp32_state_dict(wrapped), moments, model_weights


def _run(rank, world, strided, pure, powersgd, merge, clip):
    model, opt, wrapped = _build(strided, pure, powersgd, merge)
    steps = _train(rank, opt, wrapped, range(STEPS), clip, merge)
    kept = model.conv.is_contiguous(memory_format=torch.channels_last) and not model.proj.is_contiguous()
    return steps, _state(model, opt, wrapped), kept == strided


def _assert_same_state(expected, got):
    for want, have in zip(expected, got, strict=True):
        assert want.keys() == have.keys()
        for key in want:
            assert torch.equal(want[key], have[key]), (key, (want[key].float() - have[key].float()).abs().max())


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("pure", "powersgd", "merge", "clip"), [
    (True, False, 1, 1.0),  # O2: masters, chunked update, 16-bit hook, clipping
    (False, False, 1, 1.0),  # O1
    (True, False, 2, None),  # O2 gradient merge: the window's FP32 sum in the hook
    (True, True, 1, 1.0),  # PowerSGD: error feedback and Q across steps
    (False, True, 2, None),
], ids=["o2-clip", "o1-clip", "o2-merge", "o2-powersgd-clip", "o1-powersgd-merge"])
def test_strided_weights_train_bitwise_as_contiguous_ones(pure, powersgd, merge, clip):
    contiguous = run_workers(_run, 2, False, pure, powersgd, merge, clip, timeout=100)
    strided = run_workers(_run, 2, True, pure, powersgd, merge, clip, timeout=100)
    for rank in (0, 1):
        assert strided[rank][2], "the model must keep its memory formats"
        assert strided[rank][0] == contiguous[rank][0], rank
        assert all(applied for _, applied in strided[rank][0])
        _assert_same_state(contiguous[rank][1], strided[rank][1])


def _resume(rank, world, strided, pure, powersgd, directory, phase):
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    model, opt, wrapped = _build(strided if phase == "save" else not strided, pure, powersgd, 1)
    if phase == "save":
        _train(0, opt, wrapped, range(2))
        save_checkpoint(directory, 2, model=wrapped, optimizer=opt)
        return None
    info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
    assert info is not None
    assert info.step == 2
    _train(0, opt, wrapped, range(2, STEPS))
    return _state(model, opt, wrapped)


def _uninterrupted(rank, world, strided, pure, powersgd):
    model, opt, wrapped = _build(strided, pure, powersgd, 1)
    _train(0, opt, wrapped, range(STEPS))
    return _state(model, opt, wrapped)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("saved_strided", "pure", "powersgd", "resumed_on"), [
    (True, True, True, 2),  # channels_last -> contiguous, PowerSGD's state included
    (False, True, False, 1),  # contiguous -> channels_last, on another world size
    (True, False, False, 1),
], ids=["o2-powersgd-strided-to-contiguous", "o2-contiguous-to-strided-1-rank", "o1-strided-to-contiguous-1-rank"])
def test_a_checkpoint_resumes_bitwise_in_the_other_memory_format(tmp_path, saved_strided, pure, powersgd,
                                                                 resumed_on):
    """Every rank sees the same inputs, so the run resumed on 1 rank continues the 2-rank one exactly."""
    run_workers(_resume, 2, saved_strided, pure, powersgd, str(tmp_path), "save", timeout=100)
    resumed = run_workers(_resume, resumed_on, saved_strided, pure, powersgd, str(tmp_path), "load", timeout=100)
    expected = run_workers(_uninterrupted, 2, not saved_strided, pure, powersgd, timeout=100)
    for rank in range(resumed_on):
        _assert_same_state(expected[rank], resumed[rank])
