"""``check_nan_inf``: the first non-finite forward output or local gradient raises, naming it.

Paddle's ``FLAGS_check_nan_inf`` for PyTorch models. With
``amp_configs["check_nan_inf"] = True`` every module gets a forward hook
and every parameter a gradient hook; the first non-finite value raises
``FloatingPointError`` on the rank where it appeared, naming the module (or
parameter), the rank, the step and the dtype. Gradient hooks run on each
rank's local gradient *before* it is communicated, so the error points at
the rank that produced it; under ``distrun`` that rank's error is the job's
root cause.

Costs: one ``isfinite().all()`` and a host sync per module output and per
parameter gradient. It is a debugging switch, off by default; it also
breaks ``torch.compile`` graphs (the hooks read values on the host).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from distamp.model_views import unwrap_model
from distamp.torch_compat import tree_leaves

__all__ = ["NanInfChecker"]


def _nonfinite_kind(t: torch.Tensor) -> str | None:
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return "NaN" if bool(torch.isnan(t).any()) else "inf"


def _class_name(module: nn.Module) -> str:
    """The module's class name; for a module ``fully_shard`` converted (``FSDPLinear``), the user's (``Linear``)."""
    name = type(module).__name__
    return name.removeprefix("FSDP") if isinstance(module, FSDPModule) else name


class NanInfChecker:
    """Hooks that raise at the first non-finite forward output or gradient of ``model``.

    Args:
        model: the model (root name shown as its class name); inside
            ``torch.compile`` / data-parallel wrappers, the model inside them
            is hooked and named (:func:`~distamp.model_views.unwrap_model`).
        step: returns the number of the step in progress, for messages.
        rank: this process's data-parallel rank, for messages.
    """

    def __init__(self, model: nn.Module, step: Callable[[], int], rank: int = 0) -> None:
        self._step = step
        self._rank = rank
        self._handles: list[Any] = []
        self._watched: set[int] = set()
        self._frozen: dict[int, tuple[str, torch.Tensor]] = {}  # given to watch_grads while requires_grad=False
        model = unwrap_model(model)  # names and the root are the user's, inside torch.compile's wrapper
        root = _class_name(model)
        for name, module in model.named_modules():
            label = f"module {name!r} ({_class_name(module)})" if name else f"the model ({root})"
            check = self._check_root_output if module is model else self._check_output
            self._handles.append(module.register_forward_hook(functools.partial(check, label)))
        # A DTensor parameter (sharding stage 3) never gets a local gradient from autograd: FSDP2 computes it
        # on the unsharded parameter, which fleet.distributed_model hands to watch_grads after its first forward.
        self.watch_grads([(name, p) for name, p in model.named_parameters() if not isinstance(p, DTensor)])

    def watch_grads(self, named_params: list[tuple[str, torch.Tensor]]) -> None:
        """Check the local gradient of each ``(name, parameter)`` (once per tensor).

        A parameter that does not require a gradient yet (a frozen layer) is
        watched from the end of the first forward of the model after it was
        made trainable (gradual unfreezing), before that forward's backward.
        """
        for name, param in named_params:
            if id(param) in self._watched:
                continue
            if not param.requires_grad:
                self._frozen[id(param)] = (name, param)
                continue
            self._frozen.pop(id(param), None)
            self._watched.add(id(param))
            hook = functools.partial(self._check_grad, f"parameter {name!r}")
            self._handles.append(param.register_hook(hook))

    def _fail(self, what: str, kind: str, dtype: torch.dtype) -> None:
        raise FloatingPointError(
            f"check_nan_inf: {kind} in {what} on rank {self._rank} at step {self._step()}, dtype {dtype}. "
            "Look at that layer's inputs and weights; if it overflows only in 16 bits, keep it in FP32 with "
            "custom_black_varnames."
        )

    def _check_output(self, label: str, module: nn.Module, args: Any, output: Any) -> None:
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor):
                kind = _nonfinite_kind(t)
                if kind is not None:
                    self._fail(f"the forward output of {label}", kind, t.dtype)

    def _check_root_output(self, label: str, module: nn.Module, args: Any, output: Any) -> None:
        self._check_output(label, module, args, output)
        if self._frozen:  # some may have been unfrozen since: their gradients come in this forward's backward
            self.watch_grads(list(self._frozen.values()))

    def _check_grad(self, label: str, grad: torch.Tensor | None) -> None:
        if grad is None:  # an output the loss does not use, passed through DDP's find_unused_parameters sink
            return
        kind = _nonfinite_kind(grad)
        if kind is not None:
            self._fail(f"the local gradient of {label} (before communication)", kind, grad.dtype)

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._watched.clear()
        self._frozen.clear()
