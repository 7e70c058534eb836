"""auto_cast is torch.autocast; custom op lists move single ops on top of it."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from distamp.amp import (
    AutocastWithOpLists,
    OpListMode,
    auto_cast,
    checkpoint_context_fn,
)

LOW_DTYPES = [torch.bfloat16, torch.float16]


class Block(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear: ops torch's CPU lists treat three ways."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


def test_without_custom_lists_it_is_a_torch_autocast():
    ctx = auto_cast(dtype="bfloat16")
    assert isinstance(ctx, torch.autocast)
    with ctx:
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_forward_and_gradients_are_bitwise_torch_autocast(dtype):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8)
    reference = Block()
    reference.load_state_dict(model.state_dict())
    with auto_cast(dtype=dtype):
        out = model(x)
    with torch.autocast("cpu", dtype=dtype):
        expected = reference(x)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_custom_black_list_moves_an_op_to_fp32_and_gradients_keep_each_dtype(dtype):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8, requires_grad=True)
    seen = {}

    def record(module, args):
        seen["norm_input"] = args[0].dtype

    model.norm.register_forward_pre_hook(record)
    with auto_cast(dtype=dtype, custom_black_list=["gelu"]) as ctx:
        assert isinstance(ctx, AutocastWithOpLists)
        hidden = F.gelu(model.fc1(x))
        out = model(x)
    assert hidden.dtype == torch.float32          # gelu moved to FP32
    assert seen["norm_input"] == torch.float32    # so the LayerNorm saw FP32
    assert out.dtype == dtype                     # fc2 is still low precision
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_custom_white_list_moves_an_fp32_op_to_low_precision():
    pred, target = torch.randn(4, 3), torch.randn(4, 3)
    with auto_cast(dtype="bfloat16"):
        assert F.mse_loss(pred, target).dtype == torch.float32   # torch's CPU list: FP32
    with auto_cast(dtype="bfloat16", custom_white_list=["mse_loss"]):
        assert F.mse_loss(pred, target).dtype == torch.bfloat16


def test_conv_alias_names_every_convolution():
    conv, x = nn.Conv2d(2, 2, 3), torch.randn(1, 2, 5, 5)
    with auto_cast(dtype="bfloat16", custom_black_list=["conv"]):
        assert conv(x).dtype == torch.float32
    with auto_cast(dtype="bfloat16", custom_black_list=["torch.nn.functional.conv2d"]):
        assert conv(x).dtype == torch.float32


def test_lists_act_only_while_autocast_is_enabled():
    x = torch.randn(4, 8).bfloat16()
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        with auto_cast(enable=False):
            assert not torch.is_autocast_enabled("cpu")
            assert F.gelu(x).dtype == torch.bfloat16       # lists are off with autocast
        assert F.gelu(x).dtype == torch.float32


def test_batch_norm_on_a_list_still_updates_its_running_stats_in_place():
    bn = nn.BatchNorm1d(3)
    with auto_cast(dtype="bfloat16", custom_black_list=["batch_norm"]):
        out = bn((torch.randn(8, 3) + 5).bfloat16())
    assert out.dtype == torch.float32
    assert bn.running_mean.dtype == torch.float32
    assert bn.running_mean.abs().sum() > 0


def test_in_place_and_out_calls_are_never_cast():
    a = torch.randn(3)
    with auto_cast(dtype="bfloat16", custom_white_list=["add"]):
        b = a.clone()
        b.add_(1.0)
        assert b.dtype == torch.float32
        out = torch.empty(3)
        torch.add(a, a, out=out)
        assert out.dtype == torch.float32
        assert torch.add(a, a).dtype == torch.bfloat16


def test_nested_regions_decorator_exception_and_threads_restore_state():
    x = torch.randn(2, 8)
    lin = nn.Linear(8, 8)

    @auto_cast(dtype="bfloat16", custom_black_list=["linear"])
    def black_linear():
        return lin(x)

    with auto_cast(dtype="float16"):
        assert black_linear().dtype == torch.float32
        assert lin(x).dtype == torch.float16      # the outer region is back
        with pytest.raises(ZeroDivisionError), auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
            _ = 1 / 0
        assert torch.get_autocast_dtype("cpu") == torch.float16
        assert not any(isinstance(m, OpListMode) for m in torch.overrides._get_current_function_mode_stack())
    results = {}

    def worker():
        results["other thread"] = lin(x).dtype    # autocast state is thread-local
    with auto_cast(dtype="bfloat16"):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert results["other thread"] == torch.float32


def test_custom_fwd_casts_inside_auto_cast():
    class Double(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, a):
            return a * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, grad):
            return grad * 2

    with auto_cast(dtype="bfloat16"):
        assert Double.apply(torch.randn(3).bfloat16()).dtype == torch.float32


def test_activation_checkpointing_recomputes_in_the_same_dtypes():
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8, requires_grad=True)
    with auto_cast(dtype="bfloat16"):
        checkpoint(block, x, use_reentrant=False).float().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with auto_cast(dtype="bfloat16"):
        block(x).float().sum().backward()
    assert torch.equal(x.grad, expected)


def test_checkpointing_with_custom_lists_needs_the_context_fn():
    block, x = Block(), torch.randn(4, 8, requires_grad=True)
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        out = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(CheckpointError, match="different metadata"):
        out.float().sum().backward()
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        out = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context_fn)
    out.float().sum().backward()
    assert x.grad is not None


def test_multihead_attention_runs_in_low_precision():
    mha, x = nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 5, 8)
    with auto_cast(dtype="bfloat16"):
        out, _ = mha(x, x, x)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "fp16"}, ValueError, r"auto_cast\(dtype=\.\.\.\).*Did you mean 'float16'"),
        ({"dtype": torch.float32}, ValueError, r"auto_cast\(dtype=\.\.\.\)"),
        ({"custom_white_list": ["softmx"]}, ValueError, r"'softmx'.*Did you mean 'softmax'"),
        ({"custom_black_list": "gelu"}, ValueError, r"Wrap a single name in a list: \['gelu'\]"),
        ({"custom_black_list": ["add_"]}, ValueError, r"in-place op.*'add'"),
        ({"custom_white_list": ["conv"], "custom_black_list": ["conv2d"]}, ValueError, r"both contain \['conv2d'\]"),
        ({"device_type": "tpu"}, ValueError, r"'cpu' or 'cuda'"),
        ({"enable": 1}, TypeError, r"enable"),
    ],
)
def test_bad_arguments_are_rejected_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        auto_cast(**kwargs)
