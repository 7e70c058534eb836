"""Sharding saves memory: peak live tensor bytes per rank, measured on real processes.

Memory, not timing: the peak of live tensor bytes from building the model to
the end of training (examples/sharding_memory.py; torch.profiler allocation
events with the allocator counting every thread), for O2 BF16 AdamW on an
MLP whose optimizer state dominates (batch 8). Per parameter, sharding off
keeps 2 (BF16 weights) + 2 (BF16 gradient buckets) + 4 (FP32 masters) +
4 (FP32 master gradients) + 8 (Adam moments) = 20 bytes; sharded over 2 ranks
4 + 16/2 = 12. The buckets are small (0.1 MB) so that transient buffers,
which scale with the bucket size, stay small next to this small model, as
they are next to a large one with the default 25 MB.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.multiprocess import run_workers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

import sharding_memory  # examples/ is not a package: imported from the path set above

ARGV = ["--hidden", "256", "--layers", "16", "--batch", "8", "--steps", "2", "--bucket_mb", "0.1"]


def _measure(rank, world, stages):
    """Each stage in turn in the same two processes (one start-up instead of three).

    Every measurement counts the tensors allocated inside its own profiler
    window, from building its model; the previous stage's model, optimizer and
    DDP wrapper are gone (``measure`` deletes them and the collection below
    frees any cycle) before the next window opens.
    """
    import gc

    peaks = {}
    for stage in stages:
        gc.collect()
        peaks[stage] = sharding_memory.measure(rank, world, stage, sharding_memory.parse_args(ARGV))
    return peaks


@pytest.mark.timeout(240)
def test_sharding_peak_per_rank_is_at_most_0_7_of_unsharded_on_two_ranks():
    by_rank = run_workers(_measure, 2, (0, 1, 2), timeout=200)
    peaks = {stage: [ranks[stage] for ranks in by_rank] for stage in (0, 1, 2)}
    params = peaks[0][0]["params"]
    per_param = {stage: [r["peak_bytes"] / params for r in ranks] for stage, ranks in peaks.items()}
    print(f"peak bytes per parameter per rank (sharding off, stage 1, stage 2): {per_param}")
    assert all(r["every_thread"] for ranks in peaks.values() for r in ranks)
    unsharded = max(per_param[0])
    assert unsharded >= 20  # weights, gradients, masters, master gradients, moments
    for stage in (1, 2):
        assert max(per_param[stage]) <= 0.7 * unsharded, (stage, per_param)
