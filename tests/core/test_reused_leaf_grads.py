"""A leaf used twice (a head tied to the embedding) has its gradients summed in place, with the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distamp.core.reused_leaf_grads import accumulate_reused_leaf_grads_in_place

VOCAB, WIDTH = 4096, 128


def _tied_loss(weight: torch.Tensor, tokens: torch.Tensor, *, sparse: bool = False) -> torch.Tensor:
    """Embedding, a scaling, and a head tied to the embedding (``F.linear`` on the same weight)."""
    h = F.embedding(tokens, weight, sparse=sparse) * 1.5
    return F.linear(h, weight).float().square().mean()


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, WIDTH, generator=g).to(dtype).requires_grad_()
    return weight, torch.randint(0, VOCAB, (2, 16), generator=g)


_SUMS = ("aten::add", "aten::add_")


def _backward_profile(weight: torch.Tensor, tokens: torch.Tensor, hooked: bool) -> tuple[set[str], int]:
    """The op names run in backward, and the peak of tensor bytes allocated in it while the two gradients are
    summed (the backward's own peak may lie elsewhere: on a host without avx512_bf16, in its software BF16
    matrix product)."""
    loss = _tied_loss(weight, tokens)
    if hooked:
        assert accumulate_reused_leaf_grads_in_place(loss) == 2  # the head's TBackward0, EmbeddingBackward0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    # Only the thread that ran backward (a thread left by an earlier test must not count).
    threads = {e.start_thread_id() for e in events if e.name().startswith("autograd::engine::evaluate_function")}
    events = [e for e in events if e.start_thread_id() in threads]
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peak = 0
    for start, end in [(e.start_ns(), e.end_ns()) for e in events if e.name() in _SUMS]:
        live = sum(nbytes for time, nbytes in memory if time < start)
        peak = max(peak, live)
        for _, nbytes in ((t, n) for t, n in memory if start <= t <= end):
            live += nbytes
            peak = max(peak, live)
    return {e.name() for e in events}, peak


def _node_named(loss: torch.Tensor, name: str) -> torch.autograd.graph.Node:
    """The first node of ``loss``'s graph of that type name (depth first)."""
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if type(node).__name__ == name:
            return node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    raise LookupError(name)


def test_tied_bf16_gradients_are_summed_in_place_with_the_same_bits():
    weight, tokens = _inputs(torch.bfloat16)
    ops, peak = _backward_profile(weight, tokens, hooked=False)
    reference = weight.grad
    # The head's gradient is a view of mm's result: summed out of place.
    assert "aten::add" in ops, sorted(ops)
    assert "aten::add_" not in ops, sorted(ops)
    weight.grad = None
    ops, hooked_peak = _backward_profile(weight, tokens, hooked=True)
    assert "aten::add_" in ops, sorted(ops)
    assert "aten::add" not in ops, sorted(ops)
    assert torch.equal(weight.grad, reference)
    assert weight.grad.is_contiguous()
    weight_bytes = weight.numel() * weight.element_size()
    assert 0 < hooked_peak <= peak - weight_bytes + 64 * 1024, (peak, hooked_peak)


def test_nothing_is_hooked_without_a_reused_leaf():
    weight, tokens = _inputs(torch.float32)
    head = torch.randn(VOCAB, WIDTH, requires_grad=True)
    loss = F.linear(F.embedding(tokens, weight), head).square().mean()
    assert accumulate_reused_leaf_grads_in_place(loss) == 0
    assert accumulate_reused_leaf_grads_in_place(torch.tensor(1.0)) == 0


def test_a_gradient_someone_else_holds_is_not_added_into():
    weight, tokens = _inputs(torch.bfloat16)
    # The head's part alone, from its own graph (the embedding's input detached).
    h = (F.embedding(tokens, weight.detach()) * 1.5).requires_grad_(False)
    (head_part,) = torch.autograd.grad(F.linear(h, weight).float().square().mean(), weight)
    loss = _tied_loss(weight, tokens)
    kept: list[torch.Tensor] = []
    _node_named(loss, "TBackward0").register_hook(lambda grad_inputs, grad_outputs: kept.append(grad_inputs[0]))
    accumulate_reused_leaf_grads_in_place(loss)
    loss.backward()
    assert torch.equal(kept[0], head_part)


def test_second_order_gradients_are_left_alone():
    def grad_of_grad_norm(hooked: bool) -> torch.Tensor:
        weight, tokens = _inputs(torch.float32)
        loss = _tied_loss(weight, tokens)
        if hooked:
            accumulate_reused_leaf_grads_in_place(loss)
        (grad,) = torch.autograd.grad(loss, weight, create_graph=True)
        grad.square().sum().backward()
        assert weight.grad is not None
        return weight.grad

    assert torch.equal(grad_of_grad_norm(True), grad_of_grad_norm(False))


@pytest.mark.parametrize("sparse", [True, False])
def test_sparse_or_fp32_embedding_gradients_are_the_same(sparse: bool):
    grads = []
    for hooked in (False, True):
        weight, tokens = _inputs(torch.float32)
        loss = _tied_loss(weight, tokens, sparse=sparse)
        if hooked:
            accumulate_reused_leaf_grads_in_place(loss)
        loss.backward()
        assert weight.grad is not None
        grads.append(weight.grad.to_dense())
    assert torch.equal(grads[0], grads[1])
