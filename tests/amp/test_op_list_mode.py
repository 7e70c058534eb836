"""OpListMode: custom white/black lists move just the listed ops, only while autocast is on for the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from distamp.amp.op_list_mode import OpListMode, checkpoint_context_fn

BF16 = torch.bfloat16


def _mode(white=(), black=()):
    return OpListMode("cpu", BF16, frozenset(white), frozenset(black))


def test_black_listed_op_runs_in_fp32_and_equals_fp32_reference():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.mm(a, b).dtype == BF16  # torch's own list
        with _mode(black={"mm"}):
            out = torch.mm(a, b)
            other = torch.matmul(a, b)  # not listed: torch decides
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.mm(a, b))
    assert other.dtype == BF16


def test_black_list_casts_16_bit_inputs_up():
    x = torch.randn(8).to(BF16)
    with torch.autocast("cpu", dtype=BF16), _mode(black={"softmax"}):
        out = F.softmax(x, dim=0)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.softmax(x.float(), dim=0))


def test_white_listed_op_runs_in_the_autocast_dtype_and_matches_the_bf16_reference():
    x = torch.randn(8)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.exp(x).dtype == torch.float32
        with _mode(white={"torch.exp"}):
            out = torch.exp(x)
    assert out.dtype == BF16
    assert torch.equal(out, torch.exp(x.to(BF16)))


def test_float64_and_integers_are_not_cast():
    d = torch.randn(3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"exp", "add"}):
        assert torch.exp(d).dtype == torch.float64
        assert torch.add(torch.arange(3), 1).dtype == torch.int64


def test_without_autocast_the_mode_does_nothing():
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    with _mode(white={"mm"}):
        assert torch.mm(a, b).dtype == torch.float32
    with torch.autocast("cpu", dtype=BF16), torch.autocast("cpu", enabled=False), _mode(white={"mm"}):
        assert torch.mm(a, b).dtype == torch.float32


def test_out_argument_is_left_alone():
    a = torch.randn(2, 2)
    out = torch.empty(2, 2)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"exp"}):
        torch.exp(a, out=out)
    assert torch.equal(out, torch.exp(a))


def test_batch_norm_running_stats_are_updated_in_place_not_in_a_copy():
    x = torch.randn(4, 3).to(BF16)
    mean, var = torch.zeros(3), torch.ones(3)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"batch_norm"}):
        F.batch_norm(x, mean, var, training=True)
    assert mean.dtype == torch.float32
    assert not torch.equal(mean, torch.zeros(3))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_white_listed_batch_norm_layer_keeps_its_fp32_weight_and_statistics(training):
    """nn.BatchNorm2d white-listed: a BF16 input with the FP32 weight, bias and statistics, as autocast runs it."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).train(training)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-0.1, 0.1), bn.running_var.uniform_(0.9, 1.1)
    x = torch.randn(2, 3, 4, 4)
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    expected = F.batch_norm(x.to(BF16), mean, var, bn.weight, bn.bias, training=training, momentum=0.1, eps=bn.eps)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"batch_norm"}):
        out = bn(x)
    assert out.dtype == BF16
    assert torch.equal(out, expected)
    assert torch.equal(bn.running_mean, mean)
    assert torch.equal(bn.running_var, var)
    assert bn.running_mean.dtype == bn.weight.dtype == torch.float32


def test_white_listed_batch_norm_with_keyword_and_aten_forms():
    x, weight, bias = torch.randn(4, 3), torch.rand(3) + 0.5, torch.randn(3)
    mean, var = torch.zeros(3), torch.ones(3)
    expected = F.batch_norm(x.to(BF16), mean.clone(), var.clone(), weight, bias, training=True)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"batch_norm"}):
        by_keyword = F.batch_norm(x, running_mean=mean.clone(), running_var=var.clone(), weight=weight, bias=bias,
                                  training=True)
        aten = torch.batch_norm(x, weight, bias, mean.clone(), var.clone(), True, 0.1, 1e-5, False)
    assert torch.equal(by_keyword, expected)
    assert torch.equal(aten, expected)


def test_gradients_reach_each_input_in_its_own_dtype():
    x = torch.randn(4, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16), _mode(white={"exp"}):
        y = torch.exp(x)
    y.sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.exp(x.detach().to(BF16)).float())


def test_aliases_expand_and_overlap_is_refused():
    mode = _mode(black={"conv"})
    assert "conv2d" in mode.black
    assert "conv_transpose1d" in mode.black
    with pytest.raises(ValueError, match=r"^ops \['conv2d'\] are on both the white and the black list; keep each "
                                         r"on one list$"):
        _mode(white={"F.conv2d"}, black={"conv2d"})


def test_copy_and_repr():
    mode = _mode(white={"exp"}, black={"softmax", "mm"})
    twin = mode.copy()
    assert twin is not mode
    assert (twin.white, twin.black, twin.dtype, twin.device_type) == (
        mode.white, mode.black, BF16, "cpu")
    assert repr(mode) == ("OpListMode(device_type='cpu', dtype=torch.bfloat16, white=['exp'], "
                          "black=['mm', 'softmax'])")


def test_checkpoint_context_fn_replays_the_innermost_mode():
    _forward, recompute = checkpoint_context_fn()
    assert not isinstance(recompute, OpListMode)
    with _mode(black={"exp"}) as outer, _mode(black={"mm"}) as inner:
        assert outer is not inner
        _, recompute = checkpoint_context_fn()
        assert isinstance(recompute, OpListMode)
        assert recompute.black == {"mm"}
        assert recompute is not inner
    assert not any(isinstance(m, OpListMode) for m in _get_current_function_mode_stack())


def test_checkpoint_with_the_context_fn_recomputes_in_the_same_dtype():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)

    def block(t):
        return torch.softmax(t @ w, dim=-1)

    with torch.autocast("cpu", dtype=BF16), _mode(black={"softmax"}):
        out = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context_fn)
    out.sum().backward()
    reference_w = w.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=BF16), _mode(black={"softmax"}):
        ref = torch.softmax(x @ reference_w, dim=-1)
    ref.sum().backward()
    assert out.dtype == torch.float32
    assert torch.equal(w.grad, reference_w.grad)
