"""Let autograd sum the gradients of a parameter used twice (a tied embedding) in place.

When a leaf feeds several nodes of the graph, autograd's input buffer for its
``AccumulateGrad`` adds the contributions as they arrive: into the first one
in place when nothing else holds that tensor's storage, else into a new
tensor. A language model whose head is tied to its embedding
(``F.linear(h, embedding.weight)``) hits the second case in O2: the head's
gradient arrives first, and ``mm``'s backward returns it as a view of the
matrix product (transposed twice, contiguous), so the view and its base both
hold the storage and the embedding's gradient is added out of place. For a
moment the head's gradient, the embedding's and their sum are alive: three
copies of the largest gradient, where two suffice. (Under torch's autocast,
with FP32 weights, the head's gradient leaves through the cast's backward as
a fresh tensor and is added into in place.)

:func:`accumulate_reused_leaf_grads_in_place` walks the graph before
``backward()`` and gives each node feeding such a leaf a post-hook that hands
on its gradient as a plain tensor over the same storage, with no link to a
base. The hook copies nothing and leaves autograd's check alone: the sum is
still made in place only when no one else holds the storage, and it is the
same addition either way, so the gradients are bitwise those of before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import Node

__all__ = ["accumulate_reused_leaf_grads_in_place"]


def accumulate_reused_leaf_grads_in_place(loss: torch.Tensor) -> int:
    """Before ``loss.backward()``: hook the nodes that feed a leaf used more than once; how many were hooked.

    Costs one walk over the graph's nodes (Python), each backward. Hooks
    live on this graph's nodes and go with it.
    """
    root = loss.grad_fn
    if root is None:
        return 0
    into_leaf: dict[Node, list[tuple[Node, int]]] = {}  # AccumulateGrad -> (producer, output index)
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        for index, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                into_leaf.setdefault(nxt, []).append((node, index))
            elif nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    positions: dict[Node, list[int]] = {}
    for producers in into_leaf.values():
        if len(producers) > 1:
            for node, index in producers:
                positions.setdefault(node, []).append(index)
    for node, indices in positions.items():
        node.register_hook(_unlink_from_base(tuple(indices)))
    return len(positions)


def _unlink_from_base(indices: Sequence[int]) -> Callable[[tuple, tuple], tuple | None]:
    """A node post-hook replacing the gradients at ``indices`` by plain tensors over the same storage."""

    def hook(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        if torch.is_grad_enabled():  # create_graph: the gradients carry a graph of their own
            return None
        grads = list(grad_inputs)
        for i in indices:
            grads[i] = _plain(grads[i])
        return tuple(grads)

    return hook


def _plain(grad: torch.Tensor | None) -> torch.Tensor | None:
    """``grad``'s storage, offset, sizes and strides in a new tensor that is no view (or ``grad`` itself)."""
    if (grad is None or type(grad) is not torch.Tensor or grad.layout != torch.strided
            or not grad.is_floating_point() or grad.is_conj() or grad.is_neg()):
        return grad
    # set_ with a tensor source (documented; torch's stubs list only storages): through
    # grad.untyped_storage() the sum stayed out of place on torch 2.13 (the Python storage
    # object torch keeps alive counts as one more holder).
    return torch.empty(0, dtype=grad.dtype, device=grad.device).set_(grad)  # type: ignore[call-overload]
