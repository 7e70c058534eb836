"""distamp's process and device plumbing on CUDA (``pytest -m cuda tests/cuda``).

A one-process world on NCCL, the device check in ``fleet.distributed_model``,
a checkpoint round trip that restores the CUDA RNG, ``distrun --gpus``
device mapping, and, with two GPUs, a 2-rank NCCL job: lockstep skipping
with an inf injected on one rank after communication, DDP on the local
device, and the FP16 wire pre-division.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.cuda

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


def make_strategy(**configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = configs
    return strategy


def test_one_process_world_is_a_one_rank_nccl_group_on_cuda_0():
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    from distamp import fleet

    fleet.init()
    assert fleet.device() == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    assert (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("nccl", 0, 1)
    t = torch.ones(3, device=fleet.device())
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert sorted(DistributedSampler(range(10), shuffle=False)) == list(range(10))
    wrapped = fleet.distributed_model(nn.Linear(2, 2).to(fleet.device()))
    assert wrapped.ddp is None


def test_a_model_left_on_the_cpu_is_refused_before_ddp():
    from distamp import fleet

    fleet.init()
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight' is on cpu, but this process trains on cuda:0 \(fleet.device\(\)\); "
        r"move the model there before wrapping it: model.to\(fleet.device\(\)\)",
    ):
        fleet.distributed_model(nn.Linear(2, 2))


@two_gpus
def test_a_model_on_another_gpu_is_refused():
    from distamp import fleet

    fleet.init()
    with pytest.raises(ValueError, match=r"parameter 'weight' is on cuda:1, but this process trains on cuda:0"):
        fleet.distributed_model(nn.Linear(2, 2).to("cuda:1"))


def test_checkpoint_round_trip_restores_the_cuda_rng(tmp_path):
    """Data and dropout masks come from the CUDA RNG: the resumed steps match bitwise."""
    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2)).to(fleet.device())
    opt = fleet.distributed_optimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        make_strategy(use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0),
    )
    wrapped = fleet.distributed_model(model)

    def steps(n: int) -> None:
        for _ in range(n):
            x = torch.randn(4, 8, device=fleet.device())
            with fleet.auto_cast():
                loss = wrapped(x).float().pow(2).mean()
            opt.zero_grad()
            opt.backward(loss)
            opt.step()

    steps(3)
    save_checkpoint(tmp_path, 3, model=wrapped, optimizer=opt)
    rng_at_save = torch.cuda.get_rng_state()
    steps(3)
    expected = [p.detach().clone() for p in model.parameters()]

    torch.cuda.manual_seed_all(12345)  # as a restarted process would have
    info = load_latest_checkpoint(tmp_path, model=wrapped, optimizer=opt)
    assert info is not None
    assert info.step == 3
    assert info.rng_restored
    assert torch.equal(torch.cuda.get_rng_state(), rng_at_save)
    steps(3)
    for a, b in zip(model.parameters(), expected, strict=True):
        assert torch.equal(a, b)


def distrun(tmp_path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    return subprocess.run(
        [sys.executable, "-m", "distamp.launcher", *args], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=timeout, check=False,
    )


REPORT_DEVICE = """
    import json, os, sys, torch, torch.distributed as dist
    from distamp import fleet
    fleet.init()
    info = {
        "device": str(fleet.device()), "current": torch.cuda.current_device(),
        "count": torch.cuda.device_count(), "backend": dist.get_backend(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "selected": os.environ.get("DISTAMP_SELECTED_GPUS"),
    }
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(info, f)
"""


@pytest.mark.timeout(180)
def test_distrun_gpus_0_gives_the_worker_cuda_0(tmp_path):
    (tmp_path / "report.py").write_text(textwrap.dedent(REPORT_DEVICE))
    done = distrun(tmp_path, "--gpus", "0", "report.py", str(tmp_path), timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    info = json.loads((tmp_path / "rank0.json").read_text())
    # --gpus ids index what the caller sees: through its CUDA_VISIBLE_DEVICES when set.
    caller = os.environ.get("CUDA_VISIBLE_DEVICES")
    entry = caller.split(",")[0].strip() if caller is not None else "0"
    assert info == {
        "device": "cuda:0", "current": 0, "count": 1, "backend": "nccl",
        "visible": entry, "selected": entry,
    }


# Two ranks, one GPU each. Rank 1 gets an inf in a gradient after the
# all-reduce, so only the synced flag can make rank 0 skip too.
NCCL_JOB = """
    import json, os, sys, torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    from distamp import fleet

    out_dir = sys.argv[1]
    fleet.init()
    rank, local = dist.get_rank(), fleet.local_rank()

    def strategy(**configs):
        s = fleet.DistributedStrategy()
        s.amp = True
        s.amp_configs = configs
        return s

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(fleet.device())
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        strategy(use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0, decr_every_n_nan_or_inf=1),
    )
    wrapped = fleet.distributed_model(model)
    applied = []
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        if step == 1 and rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        applied.append(opt.step())
    params = torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()
    masters = torch.cat([m.detach().flatten() for m in opt.master_weights.masters]).cpu()

    # FP32 (O1) gradients +70000 / -60000: finite once pre-divided, inf if cast to FP16 first.
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return (self.weight * x).sum()

    scale_model = Scale().to(fleet.device())
    scale_opt = fleet.distributed_optimizer(
        torch.optim.SGD(scale_model.parameters(), lr=1e-4), strategy(dtype="float16", init_loss_scaling=1.0)
    )
    scale_wrapped = fleet.distributed_model(scale_model)
    scale_opt.backward(scale_wrapped(torch.tensor([70000.0 if rank == 0 else -60000.0], device=fleet.device())))
    wire_grad = scale_model.weight.grad.item()
    wire_applied = scale_opt.step()

    torch.save({"params": params, "masters": masters}, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({
            "rank": rank, "local": local, "device": str(fleet.device()), "backend": dist.get_backend(),
            "device_ids": wrapped.ddp.device_ids, "applied": applied, "scale": opt.get_loss_scaling(),
            "wire_grad": wire_grad, "wire_applied": wire_applied,
        }, f)
    dist.destroy_process_group()
"""


@two_gpus
@pytest.mark.timeout(300)
def test_two_rank_nccl_job_skips_in_lockstep_on_local_devices(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent(NCCL_JOB))
    done = distrun(tmp_path, "--gpus", "0,1", "--tee", "all", "job.py", str(tmp_path), timeout=270)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    half_wire = torch.tensor([35000.0]).half().float().item() - 30000.0  # 5008: 5000 up to FP16 rounding
    for rank, report in enumerate(reports):
        assert report == {
            "rank": rank, "local": rank, "device": f"cuda:{rank}", "backend": "nccl",
            "device_ids": [rank], "applied": [True, False, True], "scale": 512.0,
            "wire_grad": half_wire, "wire_applied": True,
        }
    assert torch.equal(tensors[0]["params"], tensors[1]["params"])
    assert torch.equal(tensors[0]["masters"], tensors[1]["masters"])


# A group made by the script under mp.spawn, without torch.cuda.set_device: fleet.init selects each
# rank's GPU, so torch's NCCL object collectives (which use the current device) get one GPU per rank.
SPAWN_JOB = """
    import json, os, socket, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    from distamp import fleet

    def worker(rank, out_dir, port):
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        fleet.init()
        gathered = [None, None]
        dist.all_gather_object(gathered, {"rank": rank, "current": torch.cuda.current_device()})
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"device": str(fleet.device()), "current": torch.cuda.current_device(),
                       "gathered": gathered}, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(sys.argv[1], port), nprocs=2)
"""


@two_gpus
@pytest.mark.timeout(300)
def test_a_group_made_under_mp_spawn_gets_each_ranks_gpu_made_current(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent(SPAWN_JOB))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC")}
    done = subprocess.run([sys.executable, "job.py", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=270, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "device": f"cuda:{rank}", "current": rank,
            "gathered": [{"rank": 0, "current": 0}, {"rank": 1, "current": 1}],
        }
