"""A data-parallel model freed after ``destroy_process_group()`` does not hang the process.

gloo's thread that completes a comm hook's all-reduce takes the GIL once more, after the backward
returned, to release the hook's Python continuation; freeing the model's reducer (the process
group's last owner) joins that thread with the GIL held. Without distamp's finalizer this hung at
the first or second iteration of the loop below, every time.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distamp import fleet
from tests.multiprocess import free_port, run_workers


def _train_destroy_free(rank: int, world_size: int, port: int, iterations: int, pure: bool) -> int:
    dist.destroy_process_group()  # the harness's group; each iteration builds its own
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=30))
    for it in range(iterations):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"it{it}", store), rank=rank, world_size=world_size)
        fleet._state = fleet._FleetState()
        strategy = fleet.DistributedStrategy(amp=True)
        strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": pure}
        module = nn.Linear(64, 64)
        optimizer = fleet.distributed_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), strategy)
        model = fleet.distributed_model(module)
        with fleet.auto_cast():
            loss = model(torch.ones(4, 64)).float().sum()
        optimizer.backward(loss)
        optimizer.step()
        dist.destroy_process_group()  # the user's teardown, then the model goes out of scope
        del model, optimizer, module, loss
    dist.init_process_group("gloo", store=dist.PrefixStore("last", store), rank=rank, world_size=world_size)
    # A rank may return from init before its peer finished connecting: a rank that exited at once
    # closed its sockets under the peer's handshake ("connection closed by peer").
    dist.barrier()
    return iterations


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pure", [False, True])
def test_freeing_the_model_after_destroy_process_group_does_not_hang(pure):
    assert run_workers(_train_destroy_free, 2, free_port(), 8, pure, timeout=90) == [8, 8]
