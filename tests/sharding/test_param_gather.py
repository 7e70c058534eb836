"""SliceAllGather: every rank's slice lands in every rank's parameters, in each parameter's dtype.

Collective rounds (NCCL's path, forced here on gloo) in bounded rounds; pairwise messages (gloo's path)
straight into the destinations.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distamp.core.flat_layout import FlatLayout
from distamp.sharding.param_gather import SliceAllGather
from tests.multiprocess import run_workers

NUMELS = [5, 3, 0, 4, 7]
DTYPES = [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]


def _truth():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) * 3 for n in NUMELS]


def _sources(layout, rank, truth):
    return [truth[p.param][p.start : p.stop].clone() for p in layout.pieces(*layout.range_of(rank))]


def test_one_rank_copies_and_rounds_in_place():
    layout = FlatLayout(NUMELS, 1)
    truth = _truth()
    dest = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
    gather = SliceAllGather(layout, 0, None, chunk_bytes=8)
    gather.run(_sources(layout, 0, truth), dest.__getitem__)
    for t, d in zip(truth, dest, strict=True):
        assert torch.equal(d, t.to(d.dtype))
    assert gather.stats.calls == 0  # no buffers, no rounds
    fresh = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
    gather.run(_sources(layout, 0, truth), fresh.__getitem__, params=[1])
    assert torch.equal(fresh[1], truth[1])
    assert not fresh[0].any()
    assert not fresh[4].any()


def _worker(rank, world_size):
    layout = FlatLayout(NUMELS, world_size)
    truth = _truth()
    out = {}
    for chunk_bytes in (4, 1 << 20):
        dest = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
        gather = SliceAllGather(layout, rank, dist.group.WORLD, chunk_bytes=chunk_bytes, pairwise=False)
        gather.run(_sources(layout, rank, truth), dest.__getitem__)
        out[chunk_bytes] = (dest, gather.stats.calls, gather.stats.bytes)
    from distamp.sharding import wire_rounds

    wire_rounds.GLOO_ROUND_BYTES = 4  # gloo's rounds: 2 BF16 or 1 FP32 element sent per rank, many in flight
    dest = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
    gather = SliceAllGather(layout, rank, dist.group.WORLD, chunk_bytes=1 << 20, pairwise=False)
    gather.run(_sources(layout, rank, truth), dest.__getitem__)
    out["rounds"] = (dest, gather.stats.calls, gather.stats.bytes)
    wire_rounds.GLOO_ROUND_BYTES = 1 << 20
    out.update(_subsets(layout, rank, truth, pairwise=False))
    return out


def _subsets(layout, rank, truth, pairwise):
    """Gathers of some parameters only: two of them, and a class of empty parameters only."""
    subset = [torch.full((n,), -1.0, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
    SliceAllGather(layout, rank, dist.group.WORLD, 1 << 20, pairwise=pairwise).run(
        _sources(layout, rank, truth), subset.__getitem__, params=[0, 4])
    empty = SliceAllGather(layout, rank, dist.group.WORLD, 1 << 20, pairwise=pairwise)
    empty.run(_sources(layout, rank, truth), subset.__getitem__, params=[2])
    return {"subset": subset, "empty_calls": empty.stats.calls}


def _assert_subsets(got, truth):
    assert got["empty_calls"] == 0
    subset = got["subset"]
    assert torch.equal(subset[0], truth[0].to(torch.bfloat16))
    assert torch.equal(subset[4], truth[4])
    assert all(torch.equal(subset[i], torch.full((NUMELS[i],), -1.0, dtype=DTYPES[i])) for i in (1, 2, 3))


@pytest.mark.timeout(60)
def test_two_ranks_get_every_value_bitwise_in_its_wire_dtype():
    truth = _truth()
    layout = FlatLayout(NUMELS, 2)
    results = run_workers(_worker, 2, timeout=50)
    for rank, got in enumerate(results):
        for chunk_bytes, (dest, calls, sent) in ((k, got[k]) for k in (4, 1 << 20, "rounds")):
            for i, (t, d) in enumerate(zip(truth, dest, strict=True)):
                assert d.dtype == DTYPES[i]
                assert torch.equal(d, t.to(DTYPES[i])), (rank, chunk_bytes, i)
            # One gather per dtype class with a large chunk; with 4 bytes per round, one element per rank per
            # round: as many rounds as the longest contribution of each class.
            longest = {}
            for dtype in {torch.bfloat16, torch.float32}:
                members = {i for i, d in enumerate(DTYPES) if d == dtype}
                longest[dtype] = max(
                    sum(p.length for p in layout.pieces(*layout.range_of(r)) if p.param in members) for r in range(2))
            if chunk_bytes == 1 << 20:
                assert calls == 2
                assert sent == longest[torch.bfloat16] * 2 + longest[torch.float32] * 4
            elif chunk_bytes == "rounds":
                assert calls == -(-longest[torch.bfloat16] // 2) + longest[torch.float32]
                assert sent == -(-longest[torch.bfloat16] // 2) * 4 + longest[torch.float32] * 4
            else:
                # bf16: 4 bytes // (2 ranks * 2 bytes) = 1 element per round; fp32: max(1, 4 // 8) = 1
                assert calls == longest[torch.bfloat16] + longest[torch.float32]
        _assert_subsets(got, truth)


def _pairwise_worker(rank, world_size):
    from distamp.sharding import wire_rounds

    layout = FlatLayout(NUMELS, world_size)
    truth = _truth()
    gather = SliceAllGather(layout, rank, dist.group.WORLD, chunk_bytes=4)
    assert gather.pairwise  # gloo's default
    out = {}
    wire_rounds.GLOO_ROUND_BYTES = 4  # messages of 2 BF16 or 1 FP32 element
    dest = [torch.zeros(n, dtype=d) for n, d in zip(NUMELS, DTYPES, strict=True)]
    running = gather.start(_sources(layout, rank, truth), dest.__getitem__)
    running.finish_params([3])  # one parameter: its values are in, the others may still arrive
    out["first"] = (dest[3].clone(), running.done)
    running.finish()
    out["all"] = (dest, running.done, gather.stats.calls, gather.stats.bytes)
    wire_rounds.GLOO_ROUND_BYTES = 1 << 20
    out.update(_subsets(layout, rank, truth, pairwise=None))  # None: gloo's default, pairwise
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_pairwise_messages_write_every_value_bitwise_into_the_destinations(world):
    truth = _truth()
    layout = FlatLayout(NUMELS, world)
    for rank, got in enumerate(run_workers(_pairwise_worker, world, timeout=80)):
        first, first_done = got["first"]
        assert torch.equal(first, truth[3].to(torch.bfloat16))
        assert not first_done  # other parameters' messages were still to be waited on
        dest, done, calls, sent = got["all"]
        assert done
        for i, (t, d) in enumerate(zip(truth, dest, strict=True)):
            assert d.dtype == DTYPES[i]
            assert torch.equal(d, t.to(DTYPES[i])), (rank, i)
        # This rank's pieces cut into messages of 4 bytes, each counted once (as contributed), in its dtype.
        pieces = layout.pieces(*layout.range_of(rank))
        assert calls == sum(-(-p.length // (2 if DTYPES[p.param] == torch.bfloat16 else 1)) for p in pieces)
        assert sent == sum(p.length * (2 if DTYPES[p.param] == torch.bfloat16 else 4) for p in pieces)
        _assert_subsets(got, truth)
