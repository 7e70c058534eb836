"""O1 with no autocast region: the model trains in FP32 and nothing says so.

In O1 the weights stay FP32 and only ``fleet.auto_cast()`` (``torch.autocast``
underneath) makes ops run in 16 bits. A loop that forgets the region trains
correctly but in FP32, at FP32's speed and memory. :class:`AutocastWatch`
looks, before each backward, for what autocast leaves in the autograd graph:
its casts (``ToCopyBackward0`` nodes; an all-FP32 model has none, since
casting a tensor to its own dtype records nothing) or a compiled region
(``CompiledFunctionBackward``, opaque, taken on trust). Once a step finishes
with none seen since the last step, it warns once; once autocast is seen,
it stops looking. Either way the walk over the graph happens for the first
step only.
"""

from __future__ import annotations

import torch

from distamp.user_warning import warn_user

__all__ = ["AutocastWatch"]

_AUTOCAST_TRACES = ("ToCopyBackward0", "CompiledFunctionBackward")


def graph_shows_autocast(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s autograd graph holds a dtype cast or a compiled region."""
    pending = [loss.grad_fn] if loss.grad_fn is not None else []
    seen = set()
    while pending:
        node = pending.pop()
        if type(node).__name__.startswith(_AUTOCAST_TRACES):
            return True
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                pending.append(child)
    return False


class AutocastWatch:
    """Warns once when an O1 step finishes without any autocast region in its forward.

    Args:
        active: True for O1 (FP32 weights, 16-bit compute only inside autocast).
        dtype: the strategy's low-precision dtype, for the message.
    """

    def __init__(self, active: bool, dtype: str) -> None:
        self.active = active
        self.dtype = dtype
        self._seen = False

    def before_backward(self, loss: torch.Tensor) -> None:
        """Look at the graph about to be differentiated (it is freed by the backward)."""
        if self.active and not self._seen:
            self._seen = graph_shows_autocast(loss)

    def after_step(self) -> None:
        """A step finished: warn if no forward since the last one ran under autocast; then stop looking."""
        if not self.active:
            return
        self.active = False
        if not self._seen:
            warn_user(
                f"O1 (use_pure_fp16=False): the forward of this step ran with no autocast region, so the model "
                f"computed in FP32, not {self.dtype}. Run the forward and the loss under `with fleet.auto_cast():` "
                "(or torch.autocast)."
            )
