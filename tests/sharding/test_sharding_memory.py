"""Sharding saves memory: peak live tensor bytes per rank, measured on real processes.

Memory, not timing: the peak of live tensor bytes from building the model to
the end of training (examples/sharding_memory.py; torch.profiler allocation
events with the allocator counting every thread), for O2 BF16 AdamW on a
2.4M-parameter MLP whose optimizer state dominates (batch 8). Per parameter,
sharding off keeps 2 (BF16 weights) + 2 (BF16 gradient buckets) + 4 (FP32
masters) + 4 (FP32 master gradients) + 8 (Adam moments) = 20 bytes; over 2
ranks stage 1 keeps 2 + 2 + 16/2 = 12 (DDP's full buckets stay) and stage 2
2 + 16/2 = 10 (only its FP32 gradient slice, no .grad). Transient buffers
(buckets in flight, all-gather rounds) come on top: they are capped in bytes
whatever ``fuse_grad_size_in_MB`` says, so the ratios hold at the default
25 MB as at 0.1 MB.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.multiprocess import run_workers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))

import sharding_memory  # examples/ is not a package: imported from the path set above

MODEL = ["--hidden", "512", "--layers", "10", "--batch", "8", "--steps", "2"]  # 2.40M parameters


def _measure(rank, world, stages, argv):
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
        peaks[stage] = sharding_memory.measure(rank, world, stage, sharding_memory.parse_args(argv))
    return peaks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket_mb", ["25", "0.1"])
def test_stage_1_peak_per_rank_is_at_most_0_7_and_stage_2_at_most_0_6_of_unsharded_on_two_ranks(bucket_mb):
    by_rank = run_workers(_measure, 2, (0, 1, 2), [*MODEL, "--bucket_mb", bucket_mb], timeout=260)
    peaks = {stage: [ranks[stage] for ranks in by_rank] for stage in (0, 1, 2)}
    params = peaks[0][0]["params"]
    per_param = {stage: [r["peak_bytes"] / params for r in ranks] for stage, ranks in peaks.items()}
    print(f"peak bytes per parameter per rank (sharding off, stage 1, stage 2): {per_param}")
    assert all(r["every_thread"] for ranks in peaks.values() for r in ranks)
    assert 2.3e6 < params < 2.5e6
    unsharded = max(per_param[0])
    assert unsharded >= 20  # weights, gradients, masters, master gradients, moments
    assert max(per_param[1]) <= 0.70 * unsharded, per_param
    assert max(per_param[2]) <= 0.60 * unsharded, per_param


STAGE3_ARGV = ["--hidden", "1024", "--layers", "3", "--batch", "8", "--steps", "2"]


def _measure_stage3(rank, world):
    """Sharding off, then stage 3, at the default settings (units, buckets) on a 2.2M-parameter MLP."""
    import gc

    peaks = {}
    for stage in (0, 3):
        gc.collect()
        peaks[stage] = sharding_memory.measure(rank, world, stage, sharding_memory.parse_args(STAGE3_ARGV))
    return peaks


@pytest.mark.timeout(240)
def test_stage3_peak_per_rank_is_at_most_half_of_unsharded_on_two_ranks():
    """Per parameter on 2 ranks: FP32 shard 2 + FP32 gradient shard 2 + Adam moments 4 = 8 bytes, plus one
    unit's unsharded 16-bit parameters and gradients in flight (each Linear is a unit by default)."""
    by_rank = run_workers(_measure_stage3, 2, timeout=200)
    params = by_rank[0][0]["params"]
    assert 2.0e6 < params < 2.5e6
    unsharded = max(r[0]["peak_bytes"] for r in by_rank)
    sharded = max(r[3]["peak_bytes"] for r in by_rank)
    print(f"peak bytes per parameter per rank: sharding off {unsharded / params:.1f}, stage 3 {sharded / params:.1f}")
    assert all(r[stage]["every_thread"] for r in by_rank for stage in (0, 3))
    assert unsharded / params >= 20
    assert sharded <= 0.5 * unsharded, (sharded, unsharded)
