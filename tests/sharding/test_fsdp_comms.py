"""Stage 3's collectives on real gloo groups: the reduce-scatter sums in FP32, the all-gather fills in place."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_workers


def _reduce_scatter(rank, world):
    from distamp.sharding.fsdp_comms import WireReduceScatter

    comm = WireReduceScatter()
    # Each rank sends every rank a chunk of 3 BF16 values: 1 from rank 0, 2**-9 from the others.
    value = 1.0 if rank == 0 else 2.0**-9
    chunk = torch.tensor([value, 4 * value, -value], dtype=torch.bfloat16)
    send = torch.cat([chunk * (r + 1) for r in range(world)])
    summed = torch.empty(3, dtype=torch.bfloat16)
    comm(summed, send, dist.group.WORLD, dist.ReduceOp.SUM)
    averaged = torch.empty(3, dtype=torch.float32)
    fsdp_input = comm.allocate((3 * world,), dtype=torch.float32, device=torch.device("cpu"))
    fsdp_input.copy_(send)  # as FSDP's copy-in fills the buffer it got from allocate()
    comm(averaged, fsdp_input, dist.group.WORLD, dist.ReduceOp.AVG)
    # FSDP's buffer is freed once sent (FSDP would hold it until the next reduce-scatter); the caller's own is not.
    assert fsdp_input.untyped_storage().nbytes() == 0
    assert send.untyped_storage().nbytes() == 3 * world * 2
    return summed.float().tolist(), averaged.tolist(), comm.stats.calls, comm.stats.bytes


@pytest.mark.timeout(120)
def test_reduce_scatter_adds_the_chunks_in_fp32_and_rounds_once():
    world = 4
    for rank, (summed, averaged, calls, sent) in enumerate(run_workers(_reduce_scatter, world, timeout=100)):
        exact = (rank + 1) * torch.tensor([1.0, 4.0, -1.0]) * (1 + 3 * 2.0**-9)
        # BF16 sums 1 + 2**-9 three times to 1; the FP32 sum rounded once keeps the small addends.
        assert summed == exact.to(torch.bfloat16).float().tolist()
        assert summed != [(rank + 1) * 1.0, (rank + 1) * 4.0, -(rank + 1) * 1.0]
        torch.testing.assert_close(torch.tensor(averaged), exact / world)
        assert (calls, sent) == (2, 3 * world * 2 + 3 * world * 4)


def _reduce_scatter_in_messages(rank, world, dtype):
    from distamp.sharding import fsdp_comms

    comm = fsdp_comms.WireReduceScatter()
    n = 2 * fsdp_comms._MESSAGE + 123  # two whole messages and a partial one per chunk
    g = torch.Generator().manual_seed(rank)
    mine = (torch.randn(world * n, generator=g) * 2.0 ** torch.randint(-10, 10, (world * n,), generator=g))
    fsdp_input = comm.allocate((world * n,), dtype=dtype, device=torch.device("cpu"))
    fsdp_input.copy_(mine)
    every = [torch.empty(world * n, dtype=dtype) for _ in range(world)]
    dist.all_gather(every, fsdp_input)
    expected = every[0].view(world, n)[rank].float()
    for other in every[1:]:  # FP32, in rank order, rounded once
        expected += other.view(world, n)[rank]
    summed = torch.empty(n, dtype=dtype)
    comm(summed, fsdp_input, dist.group.WORLD, dist.ReduceOp.SUM)
    assert fsdp_input.untyped_storage().nbytes() == 0  # FSDP's buffer is freed once reduced
    rounded_twice = (every[0].view(world, n)[rank] + every[-1].view(world, n)[rank]) if world > 2 else None
    return (torch.equal(summed, expected.to(dtype)), summed.float().sum().item(),
            rounded_twice is None or not torch.equal(summed, (rounded_twice + every[1].view(world, n)[rank])))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "dtype"), [(2, torch.bfloat16), (2, torch.float16), (3, torch.bfloat16)])
def test_reduce_scatter_on_gloo_goes_in_messages_and_adds_every_ranks_chunk_bitwise_in_rank_order(world, dtype):
    """Each rank's sum is bitwise the FP32 sum of every rank's chunk in rank order, rounded once (two chunks are
    one torch.add, which adds 16-bit tensors in FP32 and rounds once; three are summed in FP32 slices)."""
    results = run_workers(_reduce_scatter_in_messages, world, dtype, timeout=100)
    assert all(equal for equal, _, _ in results)
    assert all(differs for _, _, differs in results)  # three chunks: 16-bit sums of pairs would round twice
    assert len({total for _, total, _ in results}) == world  # each rank got its own chunk


def _all_gather(rank, world):
    from distamp.sharding.fsdp_comms import InPlaceAllGather

    comm = InPlaceAllGather()
    output = comm.allocate((2 * world,), dtype=torch.bfloat16, device=torch.device("cpu"))
    own = output.view(world, -1)[rank]
    own.copy_(torch.tensor([rank, -rank], dtype=torch.bfloat16))  # as FSDP's copy-in leaves it
    work = comm(output, own, dist.group.WORLD)
    # A finished Work, not None: FSDP then frees the output after its copy-out.
    assert isinstance(work, dist.Work)
    assert work.is_completed()
    assert work.wait()
    separate = torch.empty(2 * world, dtype=torch.bfloat16)
    comm(separate, torch.tensor([rank, -rank], dtype=torch.bfloat16), dist.group.WORLD, async_op=True)
    return output.tolist(), separate.tolist()


@pytest.mark.timeout(120)
def test_all_gather_puts_every_ranks_chunk_in_its_place():
    world = 3
    expected = [float(v) for r in range(world) for v in (r, -r)]
    for gathered, separate in run_workers(_all_gather, world, timeout=100):
        assert gathered == expected
        assert separate == expected
