"""The reduce-scatter of sharding stages 1 and 2 alone, on a real 2-rank gloo group, with a stand-in bucket.

Parameters of 5 and 4 elements: 9 elements, rank 0 owns [0, 4) (the first 4 of
parameter 0), rank 1 owns [4, 9) (the last element of parameter 0 and all of
parameter 1), so parameter 0 is split across the two slices.
"""

from __future__ import annotations

import pytest
import torch

from distamp.sharding.reduce_scatter import bucket_future
from tests.multiprocess import run_workers


class Bucket:
    """What the hook needs of ``torch.distributed.GradBucket``."""

    def __init__(self, buffer, params, last=True):
        self._buffer, self._params, self._last = buffer, params, last

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last


def _grads(rank):
    # Not representable in BF16, so the wire rounding shows.
    return torch.linspace(-3.0, 5.0, 9) * (1.0 + rank / 3) + 0.001


def _recorded_rounds():
    """Record every all-to-all the reduce-scatter launches: its split sizes and whether it sent a bucket as it is."""
    from distamp.sharding import reduce_scatter

    rounds = []
    launch = reduce_scatter.dist.all_to_all_single

    def recording(output, send, output_splits, input_splits, **kwargs):
        rounds.append({"input_splits": tuple(input_splits), "received": output_splits[0], "send": send.clone(),
                       "send_ptr": send.data_ptr()})
        return launch(output, send, output_splits, input_splits, **kwargs)

    reduce_scatter.dist.all_to_all_single = recording
    return rounds


def _reduce(rank, world, wire, round_bytes=None):
    from torch import nn

    from distamp.sharding import wire_rounds
    from distamp.sharding.reduce_scatter import (
        ShardedGradReduce,
        reduce_scatter_hook,
    )
    from distamp.sharding.sharded_masters import ShardedMasters

    if round_bytes is not None:
        wire_rounds.GLOO_ROUND_BYTES = round_bytes
    params = [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2, 2))]
    shard = ShardedMasters(params, None, None, rank, world)
    state = ShardedGradReduce([shard], wire)
    buffer = _grads(rank).clone()
    rounds = _recorded_rounds()
    out = reduce_scatter_hook(state, Bucket(buffer, params)).wait()
    return {
        "slice": shard.grads.buffer.clone(),
        "returned_is_bucket": out is buffer,
        "bucket": buffer.clone(),
        "reduced": shard.grads.reduced,
        "input_splits": [r["input_splits"] for r in rounds],
        "received": [r["received"] for r in rounds],
        "identity": [r["send_ptr"] == buffer.data_ptr() for r in rounds],
        "pieces": [(p.param, p.start, p.stop) for p in shard.pieces],
        "stats": (state.stats.calls, state.stats.bytes),
        "in_flight": len(state.open),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_each_rank_gets_its_slice_of_the_mean_of_the_16_bit_gradients(wire):
    out = run_workers(_reduce, 2, wire, timeout=100)
    rounded = [_grads(r).to(wire).float() for r in range(2)]
    # Bitwise: each copy halved is exact in FP32 (a power-of-two divisor), the sum is rounded once, as here.
    expected = (rounded[0] + rounded[1]) / 2
    assert not torch.equal(expected, (_grads(0) + _grads(1)) / 2)  # the 16-bit wire does show
    assert torch.equal(out[0]["slice"], expected[:4])
    assert torch.equal(out[1]["slice"], expected[4:])
    assert out[0]["pieces"] == [(0, 0, 4)]
    assert out[1]["pieces"] == [(0, 4, 5), (1, 0, 4)]  # parameter 0 split across the slices
    for rank, result in enumerate(out):
        assert result["slice"].dtype == torch.float32
        assert result["returned_is_bucket"]
        assert torch.equal(result["bucket"], torch.zeros(9))
        assert result["reduced"]
        assert result["input_splits"] == [(4, 5)]  # one round: 18 bytes are well under gloo's round size
        assert result["received"] == [(4, 5)[rank]]
        assert result["identity"] == [wire == torch.float32]  # a 16-bit wire casts the FP32 bucket
        assert result["stats"] == (1, 9 * 2)
        assert result["in_flight"] == 0


@pytest.mark.timeout(120)
def test_rounds_on_gloo_carry_as_much_for_each_destination_and_sum_the_same():
    # 4 bytes per peer and round: 2 BF16 elements for each destination while both have them, then the rest.
    out = run_workers(_reduce, 2, torch.bfloat16, 4, timeout=100)
    rounded = [_grads(r).to(torch.bfloat16).float() for r in range(2)]
    expected = (rounded[0] + rounded[1]) / 2
    assert torch.equal(out[0]["slice"], expected[:4])  # bitwise what one round gives
    assert torch.equal(out[1]["slice"], expected[4:])
    for rank, result in enumerate(out):
        assert result["input_splits"] == [(2, 2), (2, 2), (0, 1)]
        assert result["received"] == [[2, 2, 0], [2, 2, 1]][rank]
        assert result["identity"] == [False] * 3  # rounds are packed
        assert result["stats"] == (3, 9 * 2)  # the same bytes as one round
        assert torch.equal(result["bucket"], torch.zeros(9))
        assert result["in_flight"] == 0


def _reduce_into_16_bit_slice(rank, world, dtype, slab):
    """O2 without gradient merge: a 16-bit bucket reduce-scattered into a 16-bit slice, and the unsharded path."""
    import torch.distributed as dist
    from torch import nn

    from distamp.sharding import reduce_scatter
    from distamp.sharding.sharded_masters import ShardedMasters

    reduce_scatter.SUM_SLAB = slab
    params = [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2, 2))]
    shard = ShardedMasters(params, dtype, None, rank, world, grad_dtype=dtype)
    state = reduce_scatter.ShardedGradReduce([shard], dtype)
    bucket = _grads(rank).to(dtype)
    # What unsharded O2's all-reduce hook leaves in .grad: the halves (exact) summed by gloo in the 16-bit dtype.
    unsharded = bucket / world
    dist.all_reduce(unsharded)
    reduce_scatter.reduce_scatter_hook(state, Bucket(bucket.clone(), params)).wait()
    return shard.grads.buffer.clone(), unsharded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slab", [1 << 15, 2])
def test_a_16_bit_slice_gets_the_fp32_mean_rounded_once_as_the_unsharded_all_reduce_leaves_it(slab):
    # slab 2: the FP32 partial sums are built 2 elements at a time, across the split of parameter 0 too.
    out = run_workers(_reduce_into_16_bit_slice, 2, torch.bfloat16, slab, timeout=100)
    rounded = [_grads(r).to(torch.bfloat16).float() for r in range(2)]
    fp32_mean = rounded[0] / 2 + rounded[1] / 2
    expected = fp32_mean.to(torch.bfloat16)
    assert not torch.equal(expected.float(), fp32_mean)  # the slice's rounding does show
    assert out[0][0].dtype == torch.bfloat16
    assert torch.equal(out[0][0], expected[:4])
    assert torch.equal(out[1][0], expected[4:])
    for result in out:
        assert torch.equal(result[1], expected)  # bitwise what the unsharded all-reduce gives on 2 ranks


def _reversed_and_accumulated(rank, world):
    from torch import nn

    from distamp.sharding.reduce_scatter import (
        ShardedGradReduce,
        reduce_scatter_hook,
    )
    from distamp.sharding.sharded_masters import ShardedMasters

    params = [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2, 2))]
    shard = ShardedMasters(params, None, None, rank, world)
    state = ShardedGradReduce([shard], torch.float32)
    order = [params[1], params[0]]  # DDP's bucket order: parameter 1's 4 elements, then parameter 0's 5
    g = _grads(rank)
    rounds = _recorded_rounds()
    for _ in range(2):  # two backward passes accumulate in the FP32 slice
        buffer = torch.cat([g[5:], g[:5]])
        reduce_scatter_hook(state, Bucket(buffer, order)).wait()
    (first, _) = rounds
    # Rank 0's elements (parameter 0 [0, 4)), then rank 1's (parameter 1, then parameter 0 [4, 5)), divided by
    # the world size before the wire cast (exact for 2 ranks).
    packed = torch.cat([g[:4], g[5:], g[4:5]]) / world
    return (shard.grads.buffer.clone(), torch.equal(first["send"], packed), first["send_ptr"] == buffer.data_ptr(),
            first["input_splits"], len(state._plans))


@pytest.mark.timeout(120)
def test_a_bucket_in_another_order_is_packed_per_rank_and_sums_accumulate():
    out = run_workers(_reversed_and_accumulated, 2, timeout=100)
    expected = (_grads(0) + _grads(1)) / 2 * 2  # FP32 wire: exact inputs; two passes
    assert torch.allclose(out[0][0], expected[:4], rtol=1e-6, atol=0)  # two FP32 additions: not bitwise
    assert torch.allclose(out[1][0], expected[4:], rtol=1e-6, atol=0)
    for _, packed, identity, splits, plans in out:
        assert packed
        assert not identity
        assert splits == (4, 5)
        assert plans == 1


def _one_owner_per_bucket(rank, world, max_open):
    """Four 4-element parameters, two per rank; DDP's order puts each in its own bucket, rank 1's first."""
    from torch import nn

    from distamp.sharding import wire_rounds
    from distamp.sharding.reduce_scatter import ShardedGradReduce, reduce_scatter_hook
    from distamp.sharding.sharded_masters import ShardedMasters

    wire_rounds.GLOO_ROUND_BYTES = 8  # 2 FP32 elements per peer and round
    params = [nn.Parameter(torch.zeros(4)) for _ in range(4)]
    shard = ShardedMasters(params, None, None, rank, world)
    state = ShardedGradReduce([shard], torch.float32, max_open=max_open)
    rounds = _recorded_rounds()
    g = torch.arange(16, dtype=torch.float32) * (rank + 1)
    futures = [reduce_scatter_hook(state, Bucket(g[4 * i : 4 * i + 4].clone(), [params[i]], last=i == 0))
               for i in reversed(range(4))]
    assert all(f.done() for f in futures)
    return shard.grads.buffer.clone(), [r["input_splits"] for r in rounds], len(state.open)


@pytest.mark.timeout(120)
def test_buckets_owned_by_one_rank_wait_until_every_destination_fills_a_round():
    # Rank 1's two buckets come first; nothing goes until rank 0's arrive, then every round is even both ways.
    out = run_workers(_one_owner_per_bucket, 2, None, timeout=100)
    mean = torch.arange(16, dtype=torch.float32) * 1.5
    assert torch.equal(out[0][0], mean[:8])
    assert torch.equal(out[1][0], mean[8:])
    for _, splits, still_open in out:
        assert splits == [(2, 2)] * 4
        assert still_open == 0


@pytest.mark.timeout(120)
def test_a_bound_on_open_buckets_sends_the_oldest_as_it_is_when_too_many_wait():
    # max_open=2: one bucket may wait. Rank 1's second bucket pushes its first out alone, one way; the
    # rest pairs up; rank 0's last bucket goes alone at the end.
    out = run_workers(_one_owner_per_bucket, 2, 2, timeout=100)
    mean = torch.arange(16, dtype=torch.float32) * 1.5
    assert torch.equal(out[0][0], mean[:8])
    assert torch.equal(out[1][0], mean[8:])
    for _, splits, still_open in out:
        assert splits == [(0, 2), (0, 2), (2, 2), (2, 2), (2, 0), (2, 0)]
        assert still_open == 0


def _large_lent_gradient(rank, world):
    """Stage 2's hand-over: a 12-element gradient (48 bytes) with room for 2 open buckets of 16 bytes, then 4 more."""
    from torch import nn

    from distamp.sharding.reduce_scatter import ShardedGradReduce
    from distamp.sharding.sharded_masters import ShardedMasters

    params = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(12))]
    shard = ShardedMasters(params, None, None, rank, world)
    state = ShardedGradReduce([shard], torch.float32, bucket_bytes=16, max_open=2)
    rounds = _recorded_rounds()
    g = torch.arange(16, dtype=torch.float32) * (rank + 1)
    large = g[4:].clone()
    state.launch(large, [params[1]])
    after_large = (len(state.open), large.untyped_storage().nbytes(), len(rounds))
    state.launch(g[:4].clone(), [params[0]], last=True)
    state.finish_completed(wait=True)
    return shard.grads.buffer.clone(), [r["input_splits"] for r in rounds], after_large


@pytest.mark.timeout(120)
def test_a_bucket_larger_than_the_open_bound_is_summed_and_freed_before_backward_goes_on():
    # Rank 0 owns 4 of the large bucket's elements, rank 1 8: balanced rounds would leave rank 1's last 4
    # waiting; a bucket larger than max_open buckets goes out whole instead, and launch() returns when it is
    # summed, so autograd computes the next gradient after this one is freed.
    out = run_workers(_large_lent_gradient, 2, timeout=100)
    mean = torch.arange(16, dtype=torch.float32) * 1.5
    assert torch.equal(out[0][0], mean[:8])
    assert torch.equal(out[1][0], mean[8:])
    for _, splits, after_large in out:
        assert after_large == (0, 0, 4)  # nothing open, the gradient's storage freed, in 4 rounds
        assert splits == [(2, 2), (2, 2), (0, 2), (0, 2), (2, 0), (2, 0)]


def _unsupported(rank, world):
    from distamp.sharding.reduce_scatter import ShardedGradReduce

    try:
        ShardedGradReduce([], torch.float64)
    except TypeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(60)
def test_unsupported_wire_dtype():
    out = run_workers(_unsupported, 1, timeout=50)
    assert out == ["wire_dtype=torch.float64 is not supported; use torch.float16, bfloat16 or float32"]


def test_the_bucket_future_of_a_cpu_bucket_is_a_plain_future():
    buffer = torch.ones(3)
    future = bucket_future(buffer)
    future.set_result(buffer)
    assert future.wait() is buffer


@pytest.mark.cuda
def test_the_bucket_future_orders_a_cuda_bucket_for_the_stream_that_waits():
    """Completed on a side stream (as the backward thread's stream may differ from DDP's), read on another."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        buffer = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(10_000_000)  # keep the side stream busy, so an unordered read would see zeros
        buffer.fill_(3.0)
        future = bucket_future(buffer)
        future.set_result(buffer)  # records an event on the side stream
    value = future.wait()  # the current (default) stream waits for that event
    assert bool((value == 3.0).all())


def _large_parameter(rank, world):
    """One parameter 2.5x a bucket's bytes, alone in its bucket (as DDP and the stage-2 reducer put it)."""
    from torch import nn

    from distamp.sharding import reduce_scatter
    from distamp.sharding.sharded_masters import ShardedMasters

    n = 5 * reduce_scatter.REDUCE_BUCKET_BYTES // 2 // 2  # BF16 elements
    param = nn.Parameter(torch.zeros(n))
    shard = ShardedMasters([param], None, None, rank, world)
    state = reduce_scatter.ShardedGradReduce([shard], torch.bfloat16)
    sends, running = [], []
    launch = reduce_scatter.dist.all_to_all_single

    def recording(output, send, *args, **kwargs):
        sends.append(send.numel() * send.element_size())
        running.append(len(state._running))
        return launch(output, send, *args, **kwargs)

    reduce_scatter.dist.all_to_all_single = recording
    g = torch.Generator().manual_seed(rank)
    grad = torch.randn(n, generator=g).bfloat16()
    done = bucket_future(grad)
    state.launch(grad.clone(), [param], done)
    state.finish_completed(wait=True)
    return sends, running, shard.grads.buffer.clone(), grad, done.done()


@pytest.mark.timeout(120)
def test_a_parameter_larger_than_a_bucket_goes_in_rounds_of_at_most_a_bucket_two_at_a_time():
    from distamp.sharding.reduce_scatter import MAX_IN_FLIGHT, REDUCE_BUCKET_BYTES

    out = run_workers(_large_parameter, 2, timeout=100)
    for sends, running, _, _, done in out:
        assert done
        assert len(sends) >= 3
        assert max(sends) <= REDUCE_BUCKET_BYTES
        assert max(running) < MAX_IN_FLIGHT  # rounds already on the wire when another is launched
    total = out[0][3].float() / 2 + out[1][3].float() / 2  # each copy halved in FP32: exact
    half = total.numel() // 2
    assert torch.equal(out[0][2], total[:half])
    assert torch.equal(out[1][2], total[half:])


def test_bucket_size_is_a_sixteenth_of_the_gradient_at_the_default_and_the_given_size_otherwise():
    from distamp.sharding.reduce_scatter import BUCKET_FRACTION, REDUCE_BUCKET_BYTES, reduce_bucket_bytes
    from distamp.strategy import DEFAULT_FUSE_GRAD_SIZE_IN_MB

    mib = 2**20
    assert DEFAULT_FUSE_GRAD_SIZE_IN_MB == 25
    assert reduce_bucket_bytes(1000, 25) == REDUCE_BUCKET_BYTES  # a small model: the smallest bucket
    assert reduce_bucket_bytes(64 * mib, 25) == 64 * mib // BUCKET_FRACTION
    assert reduce_bucket_bytes(10_000 * mib, 25) == 25 * mib  # at most the default's 25 MB
    assert reduce_bucket_bytes(1000, 3) == 3 * mib  # chosen: the size, however small the model
    assert reduce_bucket_bytes(10_000 * mib, 100) == 100 * mib
    assert reduce_bucket_bytes(64 * mib, 0.0002) == int(0.0002 * mib)
    assert reduce_bucket_bytes(64 * mib, 1e-9) == 1
