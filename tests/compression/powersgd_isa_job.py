"""One rank of a 2-rank PowerSGD job (O2 BF16, rank 2, torch ops) that saves its parameters and masters.

Started as ``python -m tests.compression.powersgd_isa_job OUT`` by
``test_powersgd.py`` with RANK, WORLD_SIZE and MASTER_* set, each rank in its
own interpreter so that each can be given another instruction set
(``ATEN_CPU_CAPABILITY`` and oneDNN's ``ONEDNN_MAX_CPU_ISA`` are read once,
when torch first dispatches).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from distamp import fleet

STEPS = 15


def main(out: str) -> None:
    os.environ["DISTAMP_POWERSGD_KERNELS"] = "torch"
    torch.set_num_threads(1)
    fleet.init()
    rank = fleet.worker_index()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.powersgd = True
    strategy.powersgd_configs = {"rank": 2, "start_step": 2}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    # lr a power of two: SGD's own update p += -lr * buf is then exact whether or not the CPU fuses it, so
    # any difference between the ranks comes from the gradient PowerSGD wrote.
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=2.0**-4, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model)
    for step in range(STEPS):
        # Integer-derived data: torch's normal sampler is vectorised and would give each ISA other inputs.
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(-512, 512, (64, 64), generator=g).float() / 256
        y = torch.randint(0, 10, (64,), generator=g)
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        opt.backward(loss)
        if not opt.step():
            raise RuntimeError(f"step {step} was skipped")
    torch.save({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt.master_weights.masters],
        "compression_rate": opt.stats()["compression_rate"],
    }, f"{out}-{rank}.pt")
    fleet.barrier_worker()


if __name__ == "__main__":
    main(sys.argv[1])
