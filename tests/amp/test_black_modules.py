"""Black-listed modules: found by pattern, computed in FP32 with autocast off, undone by remove()."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp.auto_cast import auto_cast
from distamp.amp.black_modules import FP32Forward, find_black_modules, keep_in_fp32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x):
        h = self.body(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _net():
    torch.manual_seed(0)
    return Net()


def _record_dtypes(module, seen):
    return module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))


def test_find_black_modules_returns_topmost_matches_in_order():
    net = _net()
    found = find_black_modules(net, ["head.0", "blocks.*.norm", "head"])
    assert [name for name, _ in found] == ["blocks.0.norm", "blocks.1.norm", "head"]
    assert found[2][1] is net.head
    assert [name for name, _ in find_black_modules(net, ["blocks.1"])] == ["blocks.1"]
    assert [name for name, _ in find_black_modules(net, ["*"])] == [""]
    assert find_black_modules(net, []) == []


def test_shared_module_is_returned_once():
    net = _net()
    net.alias = net.head  # the same module under two names
    found = find_black_modules(net, ["alias", "head"])
    assert [module for _, module in found] == [net.head]


def test_unmatched_pattern_names_it_and_suggests():
    with pytest.raises(ValueError, match=r"'hed' matches no submodule of Net\. Did you mean 'head'\?"):
        find_black_modules(_net(), ["head", "hed"])
    with pytest.raises(ValueError, match=r"available: 'body', 'blocks', 'blocks\.0'.* and \d+ more"):
        find_black_modules(_net(), ["decoder.*"])
    with pytest.raises(TypeError, match="non-empty strings"):
        find_black_modules(_net(), [None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_black_submodule_computes_in_fp32(dtype):
    net = _net()
    x = torch.randn(5, 3)
    head_linears: list[torch.dtype] = []
    body: list[torch.dtype] = []
    hooks = [_record_dtypes(net.head[0], head_linears), _record_dtypes(net.head[2], head_linears)]
    hooks.append(_record_dtypes(net.blocks[1].fc, body))
    with keep_in_fp32(net, ["head"]), auto_cast(dtype=dtype):
        out = net(x)
        h = net.blocks[1](net.blocks[0](net.body(x)))  # the head's input, as it arrives
    assert body == [dtype, dtype]  # the rest of the model is untouched
    assert head_linears == [torch.float32, torch.float32]
    assert h.dtype == dtype  # torch's CPU autocast keeps LayerNorm in its input dtype
    assert out.dtype == torch.float32
    # Bitwise the FP32 head on the FP32 upcast of what reached it.
    assert torch.equal(out, net.head(h.float()))
    for hook in hooks:
        hook.remove()


def test_without_the_hooks_the_head_runs_in_low_precision():
    net = _net()
    with auto_cast(dtype="bfloat16"):
        assert net(torch.randn(2, 3)).dtype == torch.bfloat16


def test_inputs_are_cast_up_also_outside_auto_cast_and_in_kwargs():
    class Takes(nn.Module):
        def forward(self, xs, scale=None, extra=None):
            self.seen = ([x.dtype for x in xs], scale.dtype, extra["t"].dtype, extra["i"].dtype)
            return xs[0] * scale

    net = nn.Sequential()
    net.add_module("takes", Takes())
    handle = keep_in_fp32(net, ["takes"])
    low = torch.ones(2, dtype=torch.float16)
    ints = torch.arange(2)
    out = net.takes([low, low.bfloat16()], scale=low, extra={"t": low, "i": ints})
    assert net.takes.seen == ([torch.float32, torch.float32], torch.float32, torch.float32, torch.int64)
    assert out.dtype == torch.float32
    handle.remove()


def test_gradients_reach_both_parts_in_fp32():
    net = _net()
    with keep_in_fp32(net, ["head"]):
        with auto_cast(dtype="bfloat16"):
            loss = F.mse_loss(net(torch.randn(4, 3)), torch.zeros(4, 2))
        loss.backward()
    for name, p in net.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_autocast_is_restored_after_an_exception_inside_the_module():
    class Boom(nn.Module):
        def forward(self, x):
            assert not torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    net = nn.Sequential()
    net.add_module("boom", Boom())
    handle = keep_in_fp32(net, ["boom"])
    a = torch.ones(2, 2)
    with auto_cast(dtype="bfloat16"):
        with pytest.raises(RuntimeError, match="boom"):
            net(a)
        assert torch.is_autocast_enabled("cpu")
        assert (a @ a).dtype == torch.bfloat16
    handle.remove()


def test_custom_op_lists_are_off_inside_a_black_module():
    net = _net()
    with keep_in_fp32(net, ["head"]), auto_cast(dtype="bfloat16", custom_white_list=["linear"]):
        assert net(torch.randn(2, 3)).dtype == torch.float32


def test_an_lstm_runs_as_a_black_module():
    # torch's CPU autocast cannot run nn.LSTM in 16 bits on every CPU (oneDNN has no primitive for it):
    # listing it in custom_black_varnames runs it in FP32.
    model = nn.Sequential(nn.Linear(8, 8))
    model.add_module("rnn", nn.LSTM(8, 8, batch_first=True))
    with keep_in_fp32(model, ["rnn"]), auto_cast(dtype="bfloat16"):
        seq, _ = model.rnn(model[0](torch.randn(2, 5, 8)))
    assert seq.dtype == torch.float32


def test_deepcopy_gives_the_copy_its_own_fp32_forward():
    net = _net()
    keep_in_fp32(net, ["head"])
    clone = copy.deepcopy(net)
    assert isinstance(clone.head.forward, FP32Forward)
    assert clone.head.forward.module is clone.head
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(1.0)
    x = torch.randn(2, 3)
    with auto_cast(dtype="bfloat16"):
        assert not torch.equal(clone(x), net(x))


def test_remove_undoes_everything():
    net = _net()
    original = nn.Sequential.forward
    handle = keep_in_fp32(net, ["head", "blocks.0"])
    assert handle.names == ["blocks.0", "head"]
    handle.remove()
    handle.remove()  # idempotent
    for module in (net.head, net.blocks[0]):
        assert "forward" not in module.__dict__
    assert net.head.forward.__func__ is original
    with auto_cast(dtype="bfloat16"):
        assert net(torch.randn(2, 3)).dtype == torch.bfloat16


def test_an_earlier_instance_forward_is_kept_and_restored():
    net = _net()
    calls = []

    def traced(x):
        calls.append(x.dtype)
        return nn.Sequential.forward(net.head, x)

    net.head.forward = traced
    handle = keep_in_fp32(net, ["head"])
    with auto_cast(dtype="bfloat16"):
        assert net(torch.randn(2, 3)).dtype == torch.float32
    assert calls == [torch.float32]
    handle.remove()
    assert net.head.forward is traced


def test_a_compiled_model_is_matched_by_the_names_of_the_model_inside():
    """torch.compile's wrapper spells every name with "_orig_mod."; the patterns and results use the model's."""
    net = _net()
    compiled = torch.compile(net, backend="eager")  # nothing is compiled: only names are read
    patterns = ["head.0", "blocks.*.norm", "head"]
    eager = find_black_modules(net, patterns)
    found = find_black_modules(compiled, patterns)
    assert [(name, id(m)) for name, m in found] == [(name, id(m)) for name, m in eager]
    assert [name for name, _ in found] == ["blocks.0.norm", "blocks.1.norm", "head"]
    assert find_black_modules(compiled, ["*"]) == [("", net)]
    with pytest.raises(ValueError, match=r"'hed' matches no submodule of Net\. Did you mean 'head'\?.* "
                                         r"available: 'body', 'blocks', 'blocks\.0'"):
        find_black_modules(compiled, ["hed"])


def test_patterns_spelled_with_the_compile_wrapper_still_match_and_are_named_as_the_model_names_them():
    net = _net()
    compiled = torch.compile(net, backend="eager")
    assert find_black_modules(compiled, ["_orig_mod.head"]) == [("head", net.head)]
    assert find_black_modules(compiled, ["_orig_mod.blocks.*.norm", "body"]) == [
        ("body", net.body), ("blocks.0.norm", net.blocks[0].norm), ("blocks.1.norm", net.blocks[1].norm)]
    assert find_black_modules(compiled, ["_orig_mod"]) == [("", net)]


def test_the_models_own_names_win_over_the_wrapper_spelling():
    """A model whose own child is called _orig_mod: "_orig_mod.fc" is that child's fc, never the model's fc."""
    inner = nn.Module()
    inner.fc = nn.Linear(2, 2)
    model = nn.Module()
    model.fc = nn.Linear(2, 2)
    model._orig_mod = inner
    compiled = torch.compile(model, backend="eager")
    assert find_black_modules(compiled, ["_orig_mod.fc"]) == [("_orig_mod.fc", inner.fc)]
    assert find_black_modules(compiled, ["fc"]) == [("fc", model.fc)]


def test_keep_in_fp32_of_a_compiled_model_runs_the_named_module_in_fp32():
    net = _net()
    compiled = torch.compile(net, backend="eager")
    handle = keep_in_fp32(compiled, ["head"])
    assert handle.names == ["head"]
    with auto_cast(dtype="bfloat16"):
        assert compiled(torch.randn(2, 3)).dtype == torch.float32
    handle.remove()
