"""optim.slice_grads.SliceGrads: the FP32 slice buffer against FlatLayout pieces computed by hand."""

from __future__ import annotations

import torch
from torch import nn

from distamp.core.flat_layout import FlatLayout, Piece
from distamp.sharding.slice_grads import SliceGrads


def _setup(rank=1):
    # numels 6, 0, 4: 10 elements over 2 ranks; rank 1 owns [5, 10): param 0 [5, 6) and param 2 [0, 4)
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(0)), nn.Parameter(torch.zeros(4))]
    layout = FlatLayout([6, 0, 4], 2)
    lo, hi = layout.range_of(rank)
    pieces = layout.pieces(lo, hi)
    masters = [nn.Parameter(torch.zeros(p.length)) for p in pieces]
    return params, pieces, masters, SliceGrads(params, pieces, masters, lo, hi)


def test_pieces_split_a_parameter_as_computed_by_hand():
    _, pieces, _, grads = _setup()
    assert pieces == [Piece(0, 5, 6, 5), Piece(2, 0, 4, 6)]
    assert grads.buffer.dtype == torch.float32
    assert grads.buffer.numel() == 5
    assert grads.view(1).data_ptr() == grads.buffer[1:].data_ptr()


def test_collect_copies_the_slice_in_fp32_and_adds_extra():
    params, _, masters, grads = _setup()
    params[0].data, params[2].data = params[0].data.bfloat16(), params[2].data.bfloat16()  # O2: 16-bit model
    params[0].grad = torch.arange(6, dtype=torch.float32).view(2, 3).to(torch.bfloat16)
    params[2].grad = torch.tensor([10.0, 11, 12, 13]).to(torch.bfloat16)
    grads.collect({id(params[2]): torch.ones(4)})
    assert torch.equal(grads.buffer, torch.tensor([5.0, 11, 12, 13, 14]))
    assert masters[0].grad.data_ptr() == grads.buffer.data_ptr()
    assert torch.equal(masters[1].grad, torch.tensor([11.0, 12, 13, 14]))


def test_collect_without_gradient_zeroes_its_view_and_skips():
    params, _, masters, grads = _setup()
    grads.buffer.fill_(7.0)
    params[2].grad = torch.ones(4)
    grads.collect()
    assert masters[0].grad is None
    assert torch.equal(grads.buffer, torch.tensor([0.0, 1, 1, 1, 1]))


def test_reduced_buffer_is_kept():
    params, _, _, grads = _setup()
    grads.buffer.copy_(torch.tensor([1.0, 2, 3, 4, 5]))
    grads.reduced = True
    params[0].grad = torch.full((2, 3), 9.0)
    params[2].grad = torch.full((4,), 9.0)
    grads.collect()
    assert torch.equal(grads.buffer, torch.tensor([1.0, 2, 3, 4, 5]))
    grads.zero()
    assert not grads.buffer.any()
    assert grads.reduced is False


def test_expose_writes_the_slice_and_zeros_elsewhere_then_takes_changes():
    params, _, masters, grads = _setup()
    params[0].grad = torch.full((2, 3), 9.0)
    params[2].grad = torch.full((4,), 9.0)
    grads.collect()
    grads.buffer.copy_(torch.tensor([1.0, 2, 3, 4, 5]))
    versions = grads.expose()
    assert torch.equal(params[0].grad, torch.tensor([[0.0, 0, 0], [0, 0, 1]]))
    assert torch.equal(params[2].grad, torch.tensor([2.0, 3, 4, 5]))
    assert [g is p.grad for (g, _), p in zip(versions, [params[0], params[2]], strict=True)] == [True, True]
    params[2].grad.mul_(2)
    grads.take_changes({id(params[2].grad)})
    assert torch.equal(grads.buffer, torch.tensor([1.0, 4, 6, 8, 10]))
    grads.zero()
    assert [m.grad for m in masters] == [None, None]


def test_rank_with_an_empty_slice_and_no_params():
    layout = FlatLayout([1], 2)
    params = [nn.Parameter(torch.zeros(1))]
    empty = SliceGrads(params, layout.pieces(*layout.range_of(0)), [], *layout.range_of(0))
    params[0].grad = torch.ones(1)
    empty.collect()
    assert empty.buffer.numel() == 0
    assert empty.expose()[0][0] is params[0].grad
    assert not params[0].grad.any()
    none = SliceGrads([], [], [], 0, 0)
    none.collect()
    assert none.buffer.device == torch.device("cpu")


def _setup_16_bit():
    params, pieces, masters, _ = _setup()
    layout = FlatLayout([6, 0, 4], 2)
    return params, masters, SliceGrads(params, pieces, masters, *layout.range_of(1), dtype=torch.bfloat16)


def test_a_16_bit_slice_is_read_in_place_and_its_fp32_copy_is_made_only_when_asked():
    params, masters, grads = _setup_16_bit()
    assert grads.buffer.dtype == torch.bfloat16
    assert grads.low
    grads.buffer.copy_(torch.tensor([1.0, 2, 3, 4, 5]) * 1024 + 1)  # 1025, 2049, ...: not all BF16 numbers
    grads.reduced = True
    params[0].grad = torch.zeros(2, 3)  # stage 1: DDP's zeroed bucket; the slice holds the reduced values
    grads.arrived.add(2)  # stage 2: the reducer summed parameter 2 and freed its .grad
    grads.collect()
    assert [m.grad for m in masters] == [None, None]  # no FP32 gradient yet
    assert [s.grad.data_ptr() for s, _ in grads.pairs()] == [grads.buffer.data_ptr(), grads.buffer[1:].data_ptr()]
    assert grads.fp32_buffer is None
    grads.materialize(1 / 1024)
    expected = grads.buffer.float() / 1024  # exact: a power of two
    assert torch.equal(grads.fp32, expected)
    assert grads.fp32_buffer is grads.fp32
    assert masters[1].grad.data_ptr() == grads.fp32[1:].data_ptr()
    assert [i for i, _ in grads.reduced_grads()] == [0, 2]
    grads.drop_fp32()
    assert grads.fp32 is None
    assert [m.grad for m in masters] == [None, None]
    assert [g.dtype for _, g in grads.reduced_grads()] == [torch.bfloat16, torch.bfloat16]  # the slice itself
    grads.zero()
    assert grads.pairs() == []
    assert not grads.buffer.any()


def test_a_16_bit_slice_not_reduced_reads_the_model_gradients_without_rounding():
    params, _, grads = _setup_16_bit()
    params[0].grad = torch.arange(6, dtype=torch.float32).view(2, 3) + 0.001  # an FP32-kept parameter's gradient
    grads.collect()
    (source, _), = grads.pairs()  # parameter 2 has no gradient: skipped
    assert source.grad.data_ptr() == params[0].grad[1, 2:].data_ptr()  # no copy
    assert source.grad.dtype == torch.float32
    grads.materialize(1.0)
    assert torch.equal(grads.fp32[:1], torch.tensor([5.001]))
    assert not grads.buffer.any()
    grads.fp32.fill_(7.0)  # a copy a skipped step left: collect() starts afresh
    grads.collect({id(params[0]): torch.ones(6)})  # a gradient-merge sum: added to a fresh FP32 copy
    assert torch.equal(grads.fp32[:1], torch.tensor([5.001]) + 1)


def test_a_16_bit_slice_is_made_only_when_something_sums_into_it():
    params, _, grads = _setup_16_bit()
    params[0].grad = torch.ones(2, 3)
    grads.collect()  # nothing reduced: .grad is read in place
    grads.zero()
    assert grads._buffer is None  # one rank, or no data-parallel model: no 2 bytes per parameter for nothing
    assert grads.buffer.dtype == torch.bfloat16  # what a reduce-scatter asks for
    assert grads.buffer.numel() == 5
    assert grads._buffer is not None
