"""The broadcast of rank 0's parameters and buffers (stages 1-3 at build, buffers before forwards).

Each rank takes group rank 0's values bitwise; large contiguous tensors go in
place and small ones coalesced per dtype; and every tensor handed to gloo is
emptied before the call returns, so no flat copy is left for gloo's thread to
free (its frees are invisible to torch.profiler's memory events, and came
while the next buffers were allocated: an intermittent 4 MB overcount in the
stage 3 memory test).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distamp.sharding.buffer_broadcast import BROADCAST_BYTES, broadcast_from_rank0
from tests.multiprocess import run_workers

LARGE = BROADCAST_BYTES // 4 + 5
"""FP32 elements of a tensor broadcast alone, in place."""


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(LARGE, generator=g),
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randn(64, LARGE // 64 + 1, generator=g).t(),  # large but not contiguous: coalesced
        torch.empty(0),
        torch.randint(0, 100, (11,), generator=g),
        torch.randn(2, 9, generator=g),
    ]


def _broadcast(rank, world_size):
    group = dist.new_group([1, 2])  # group rank 0 is global rank 1
    handed: list[tuple[torch.Tensor, int]] = []
    real = dist.broadcast

    def spy(tensor, src=None, group=None, async_op=False, **kwargs):
        handed.append((tensor, tensor.data_ptr()))
        assert src == 1
        return real(tensor, src=src, group=group, async_op=async_op, **kwargs)

    if rank == 0:
        return None
    tensors = _tensors(rank)
    large_ptr = tensors[0].data_ptr()
    dist.broadcast = spy
    try:
        broadcast_from_rank0(tensors, group)
    finally:
        dist.broadcast = real
    return {
        "values": [t.tolist() for t in tensors],
        "dtypes": [t.dtype for t in tensors],
        "handed": len(handed),
        "large_in_place": handed[0][1] == large_ptr,
        "left_held": [t.untyped_storage().nbytes() for t, _ in handed],
    }


@pytest.mark.timeout(120)
def test_every_rank_takes_group_rank_0s_values_and_nothing_handed_to_gloo_keeps_memory():
    out = run_workers(_broadcast, 3, timeout=100)
    expected = _tensors(1)
    for rank in (1, 2):
        assert out[rank]["values"] == [t.tolist() for t in expected]
        assert out[rank]["dtypes"] == [t.dtype for t in expected]
        # The large contiguous tensor alone and in place; FP32 small + non-contiguous (one bucket, closed by the
        # large transposed one), then the small FP32 after it, BF16, int64; the empty tensor in none.
        assert out[rank]["large_in_place"]
        assert out[rank]["handed"] == 5
        assert out[rank]["left_held"] == [0] * 5
