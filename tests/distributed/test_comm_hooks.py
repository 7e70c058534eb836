"""The 16-bit all-reduce hook alone, on a real 2-rank gloo group.

The hook only reads ``bucket.buffer()``, so a stand-in bucket drives it
without DDP; gloo all-reduces float16 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_workers


class Bucket:
    """What the hook needs of ``torch.distributed.GradBucket``."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return []


def _reduce_one_bucket(rank, world_size, values, bucket_dtype, wire_dtype):
    from distamp.distributed.comm_hooks import (
        LowPrecisionAllReduce,
        low_precision_allreduce_hook,
    )

    state = LowPrecisionAllReduce(wire_dtype)
    buffer = torch.tensor(values[rank], dtype=bucket_dtype)
    out = low_precision_allreduce_hook(state, Bucket(buffer)).wait()
    return out, out is buffer


@pytest.mark.timeout(120)
def test_fp32_bucket_is_divided_before_the_fp16_cast():
    """Per-rank gradients 70000 and -60000 exceed FP16 but their halves do not (mean 5000)."""
    values = [[70000.0, 1.0], [-60000.0, 3.0]]
    out = run_workers(_reduce_one_bucket, 2, values, torch.float32, torch.float16, timeout=100)
    # What crosses the wire is each half rounded to FP16 (35000 -> 35008), then summed in FP16.
    halves = torch.tensor(values) / 2
    expected = halves.half().sum(0).float()
    assert expected[0].item() == 5008.0  # 5000 up to FP16 rounding, not inf
    for reduced, in_place in out:
        assert in_place
        assert reduced.dtype == torch.float32
        assert torch.equal(reduced, expected)


@pytest.mark.timeout(120)
def test_16_bit_bucket_is_divided_in_place():
    values = [[1000.0, 2.0], [3000.0, -6.0]]
    out = run_workers(_reduce_one_bucket, 2, values, torch.bfloat16, torch.bfloat16, timeout=100)
    for reduced, in_place in out:
        assert in_place
        assert reduced.dtype == torch.bfloat16
        assert torch.equal(reduced, torch.tensor([2000.0, -2.0], dtype=torch.bfloat16))
