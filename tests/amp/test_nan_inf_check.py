"""NanInfChecker: the first non-finite forward output or local gradient raises FloatingPointError naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.amp.nan_inf_check import NanInfChecker, _nonfinite_kind


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), Scale(1.0))


def test_nonfinite_kind():
    assert _nonfinite_kind(torch.tensor([1.0, 2.0])) is None
    assert _nonfinite_kind(torch.tensor([1.0, float("inf")])) == "inf"
    assert _nonfinite_kind(torch.tensor([-float("inf")], dtype=torch.bfloat16)) == "inf"
    assert _nonfinite_kind(torch.tensor([float("inf"), float("nan")])) == "NaN"  # NaN wins
    assert _nonfinite_kind(torch.tensor([1, 2])) is None  # integers are never checked
    assert _nonfinite_kind(torch.empty(0)) is None


def test_finite_run_passes_and_output_is_unchanged():
    model = _model()
    x = torch.randn(2, 3)
    expected = model(x)
    checker = NanInfChecker(model, step=lambda: 1)
    out = model(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    checker.remove()


def test_forward_output_names_the_innermost_module_first():
    model = _model()
    model[1].factor = float("inf")
    NanInfChecker(model, step=lambda: 7)
    with pytest.raises(
        FloatingPointError,
        match=r"^check_nan_inf: (inf|NaN) in the forward output of module '1' \(Scale\) on rank 0 at step 7, "
              r"dtype torch.float32\. Look at that layer's inputs and weights; .*custom_black_varnames\.$",
    ):
        model(torch.ones(1, 3))


def test_the_root_is_named_by_its_class():
    model = Scale(float("nan"))
    NanInfChecker(model, step=lambda: 3)
    with pytest.raises(FloatingPointError,
                       match=r"NaN in the forward output of the model \(Scale\) on rank 0 at step 3"):
        model(torch.ones(2))


def test_tuple_and_dict_outputs_are_searched():
    class Pair(nn.Module):
        def forward(self, x):
            return {"a": x, "b": (x, x / 0)}

    model = Pair()
    NanInfChecker(model, step=lambda: 0)
    with pytest.raises(FloatingPointError, match=r"inf in the forward output of the model \(Pair\)"):
        model(torch.ones(2))


def test_gradient_hook_names_the_parameter_before_communication():
    model = _model()
    checker = NanInfChecker(model, step=lambda: 2)
    out = model(torch.ones(1, 3))
    with pytest.raises(
        FloatingPointError,
        match=r"^check_nan_inf: inf in the local gradient of parameter '0\.(weight|bias)' "
              r"\(before communication\) on rank 0 at step 2, dtype torch.float32\.",
    ):
        (out.sum() * torch.tensor(float("inf"))).backward()
    checker.remove()


def test_frozen_parameters_get_no_gradient_hook_and_step_is_read_lazily():
    model = _model()
    model[0].bias.requires_grad_(False)
    steps = iter([11, 12])
    checker = NanInfChecker(model, step=lambda: next(steps))
    # one forward hook per module (3) + one gradient hook for the weight only
    assert len(checker._handles) == 3 + 1
    model[1].factor = float("nan")
    with pytest.raises(FloatingPointError, match="at step 11"):
        model(torch.ones(1, 3))
    with pytest.raises(FloatingPointError, match="at step 12"):
        model(torch.ones(1, 3))


def test_remove_takes_every_hook_off():
    model = _model()
    checker = NanInfChecker(model, step=lambda: 0)
    checker.remove()
    assert checker._handles == []
    model[1].factor = float("inf")
    out = model(torch.ones(1, 3))  # no raise
    assert not torch.isfinite(out).all()
    out.sum().backward()
    checker.remove()  # idempotent


def test_the_module_imports_first_in_a_fresh_interpreter():
    """Regression: importing it before anything else in distamp was a circular import."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import distamp.amp.nan_inf_check"], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr


class _PassThrough(torch.autograd.Function):
    """Outputs pass through; an output the loss does not use sends back None (as DDP's find_unused_parameters
    sink does), which reaches the gradient hooks of the parameters behind it."""

    @staticmethod
    def forward(ctx, *xs):
        ctx.set_materialize_grads(False)
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return grads


def test_a_gradient_hook_given_none_checks_nothing():
    # Was: AttributeError 'NoneType' object has no attribute 'is_floating_point' from inside backward.
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    checker = NanInfChecker(model, step=lambda: 1)
    x = torch.randn(2, 3)
    used, _ = _PassThrough.apply(model["used"](x), model["unused"](x))
    used.sum().backward()
    assert model["unused"].weight.grad is None
    assert model["used"].weight.grad is not None
    checker.remove()


def test_a_parameter_unfrozen_after_the_checker_was_built_is_checked_from_its_next_forward():
    # Was: a layer frozen when the model was adopted (gradual unfreezing; one process, or sharding stage 3)
    # never got a gradient hook, so its non-finite gradient was only a skipped step.
    model = _model()
    model[0].bias.requires_grad_(False)
    checker = NanInfChecker(model, step=lambda: 4)
    model(torch.ones(1, 3)).sum().backward()
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(True)
    out = model(torch.ones(1, 3))
    with pytest.raises(FloatingPointError,
                       match=r"inf in the local gradient of parameter '0\.bias' \(before communication\) on rank 0 "
                             r"at step 4"):
        (out.sum() * torch.tensor(float("inf"))).backward()
    checker.remove()
    assert checker._frozen == {}


def test_a_compiled_model_is_named_as_the_model_inside_it():
    """Modules and parameters of torch.compile(model) are named as in model, its root by model's class."""
    model = _model()
    model[1].factor = float("inf")
    compiled = torch.compile(model, backend="eager")
    checker = NanInfChecker(compiled, step=lambda: 7)
    with pytest.raises(FloatingPointError, match=r"inf in the forward output of module '1' \(Scale\) on rank 0"):
        compiled(torch.ones(1, 3))
    checker.remove()
    model[1].factor = 1.0
    checker = NanInfChecker(compiled, step=lambda: 2)
    out = compiled(torch.ones(1, 3))
    with pytest.raises(FloatingPointError, match=r"inf in the local gradient of parameter '0\.(weight|bias)' "):
        (out.sum() * torch.tensor(float("inf"))).backward()
    checker.remove()
    compiled_root = torch.compile(Scale(float("nan")), backend="eager")
    NanInfChecker(compiled_root, step=lambda: 3)
    with pytest.raises(FloatingPointError, match=r"NaN in the forward output of the model \(Scale\) on rank 0"):
        compiled_root(torch.ones(2))
