"""O1 with no autocast region: the model trains in FP32 and nothing says so.

In O1 the weights stay FP32 and only ``fleet.auto_cast()`` (``torch.autocast``
underneath) makes ops run in 16 bits. A loop that forgets the region trains
correctly but in FP32, at FP32's speed and memory. :class:`AutocastWatch`
looks, before the first step's backward, at the autograd graph: matrix
products and convolutions (the ops autocast runs in 16 bits) with none of
autocast's casts (``ToCopyBackward0`` nodes: with FP32 weights autocast
casts every matmul's operands, and casting a tensor to its own dtype
records nothing) mean FP32 compute. A compiled region
(``CompiledFunctionBackward``) is opaque and taken on trust, and a graph
without matmuls says nothing. It warns once, when the first step finishes,
and never looks again; nor when the matmuls ran in FP32 because the configuration
switched an enabled autocast off around them (``custom_black_varnames``,
``custom_black_list``, a nested ``fleet.auto_cast(enable=False)``: counted in
:data:`~distamp.amp.fp32_requests.FP32_REQUESTS`). When ``fleet.auto_cast()`` was entered meanwhile but
did nothing (no strategy with ``amp`` on was the latest when it was entered:
e.g. the optimizer was built as ``AmpOptimizer`` directly, not by
``fleet.distributed_optimizer``), the warning says that, not "no region".
"""

from __future__ import annotations

import torch

from distamp.amp.deferred_autocast import INACTIVE_ENTRIES
from distamp.amp.fp32_requests import FP32_REQUESTS
from distamp.user_warning import warn_user

__all__ = ["AutocastWatch"]

_AUTOCAST_TRACES = ("ToCopyBackward0", "CompiledFunctionBackward")
_LOW_PRECISION_OPS = ("MmBackward0", "AddmmBackward0", "BmmBackward0", "BaddbmmBackward0", "ConvolutionBackward0")


def computed_in_fp32(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph has matmuls or convolutions but no dtype cast and no compiled region."""
    pending = [loss.grad_fn] if loss.grad_fn is not None else []
    seen = set(pending)
    found_matmul = False
    while pending:
        name = type(node := pending.pop()).__name__
        if name.startswith(_AUTOCAST_TRACES):
            return False
        found_matmul = found_matmul or name in _LOW_PRECISION_OPS
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                pending.append(child)
    return found_matmul


class AutocastWatch:
    """Warns once when an O1 step finishes without any autocast region in its forward.

    Args:
        active: True for O1 (FP32 weights, 16-bit compute only inside autocast).
        dtype: the strategy's low-precision dtype, for the message.
    """

    def __init__(self, active: bool, dtype: str) -> None:
        self.active = active
        self.dtype = dtype
        self._fp32 = False
        self._inactive_before = INACTIVE_ENTRIES.count
        self._fp32_requests_before = FP32_REQUESTS.count

    def before_backward(self, loss: torch.Tensor) -> None:
        """Look at the graph about to be differentiated (it is freed by the backward)."""
        if self.active and not self._fp32:
            self._fp32 = computed_in_fp32(loss)

    def after_step(self) -> None:
        """The first step finished: warn if its forward computed its matmuls in FP32; then stop looking."""
        if not self.active:
            return
        self.active = False
        if not self._fp32:
            return
        if FP32_REQUESTS.count > self._fp32_requests_before:
            # An autocast region was there; the configuration (custom_black_varnames, custom_black_list,
            # auto_cast(enable=False)) put every matmul of this forward in FP32.
            return
        if INACTIVE_ENTRIES.count > self._inactive_before:
            warn_user(
                f"O1 (use_pure_fp16=False): the forward of this step computed in FP32, not {self.dtype}: it ran "
                f"inside fleet.auto_cast(), which did nothing because, when it was entered, "
                f"{INACTIVE_ENTRIES.reason}. fleet.auto_cast() follows the latest strategy: give this optimizer's "
                "strategy to fleet.init(strategy=...) or build the optimizer with fleet.distributed_optimizer."
            )
            return
        warn_user(
            f"O1 (use_pure_fp16=False): the forward of this step ran with no autocast region, so the model "
            f"computed in FP32, not {self.dtype}. Run the forward and the loss under `with fleet.auto_cast():` "
            "(or torch.autocast)."
        )
