"""Sharding stage 3 (FSDP2) on CUDA (``pytest -m cuda tests/cuda``).

Read against torch's FSDP2 source (``torch/distributed/fsdp/_fully_shard``):
on CUDA, FSDP2 all-gathers and reduce-scatters on streams of its own
(``_fsdp_collectives.foreach_all_gather`` / ``foreach_reduce``); distamp's
reduce-scatter (:class:`~distamp.sharding.fsdp_comms.WireReduceScatter`)
is called inside FSDP's reduce-scatter stream, so its temporaries are
allocated and freed on that stream, and FSDP's root post-backward makes the
default stream wait for the reduce before ``step()`` reads the sharded
gradients. NCCL gathers in place, so FSDP's own all-gather is kept there
(the in-place broadcasts are for gloo). These tests check the dtypes, the
comms installed and the skip verdict on one GPU, and with two GPUs a
2-rank NCCL job that skips an FP16 overflow on one rank in lockstep.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.cuda.jobs import run_two_gpu_job, two_gpus

pytestmark = pytest.mark.cuda


def _stage3(**configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = configs
    strategy.sharding_configs = {"stage": 3}
    return strategy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def test_one_gpu_stage3_o2_bf16_stores_fp32_shards_gathers_bf16_and_keeps_fsdp_all_gather():
    from distamp import fleet
    from distamp.sharding.fsdp_comms import InPlaceAllGather, WireReduceScatter

    fleet.init()
    model = _model().to(fleet.device())
    strategy = _stage3(use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    gathered = []
    model[0].register_forward_pre_hook(lambda m, args: gathered.append(m.weight.dtype))
    group = model[0]._get_fsdp_state()._fsdp_param_group
    assert isinstance(group._reduce_scatter_comm, WireReduceScatter)
    assert not isinstance(group._all_gather_comm, InPlaceAllGather)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(x).float(), y)
    opt.backward(loss)
    assert gathered == [torch.bfloat16]
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.to_local().dtype for p in model.parameters()} == {torch.float32}
    assert opt.step()
    state = opt.fp32_state_dict(wrapped)
    assert all(t.dtype == torch.float32 and t.is_cuda and type(t) is torch.Tensor for t in state.values())


def test_one_gpu_stage3_fp16_overflow_is_skipped_and_named():
    from distamp import fleet

    fleet.init()
    model = _model().to(fleet.device())
    strategy = _stage3(use_pure_fp16=True, dtype="float16", init_loss_scaling=1024.0, decr_every_n_nan_or_inf=1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 4, device="cuda")
    applied = []
    for step in range(3):
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        handle = None
        if step == 1:
            bias = dict(wrapped._unsharded_parameters())["3.bias"]
            handle = bias.register_hook(lambda g: torch.full_like(g, float("inf")))
        opt.zero_grad()
        opt.backward(loss)
        if handle is not None:
            handle.remove()
        applied.append(opt.step())
    assert applied == [True, False, True]
    assert opt.get_loss_scaling() == 512.0
    assert opt.stats()["last_overflow"] == {"step": 2, "params": ["3.bias"]}


NCCL_STAGE3_JOB = """
    import json, os, sys, torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    from distamp import fleet

    out_dir = sys.argv[1]
    fleet.init()
    rank = dist.get_rank()
    strategy = fleet.DistributedStrategy(amp=True, sharding=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "float16", "init_loss_scaling": 1024.0,
                            "decr_every_n_nan_or_inf": 1}
    strategy.sharding_configs = {"stage": 3}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(fleet.device())
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    g = torch.Generator().manual_seed(1 + rank)
    applied = []
    for step in range(4):
        x, y = torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
        with fleet.auto_cast():
            loss = F.mse_loss(wrapped(x).float(), y)
        handle = None
        if step == 2 and rank == 1:  # before communication, on one rank only
            weight = dict(wrapped._unsharded_parameters())["0.weight"]
            handle = weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0], device=grad.device),
                                                                      float("inf")))
        opt.zero_grad()
        opt.backward(loss)
        if handle is not None:
            handle.remove()
        opt.clip_grad_norm_(1.0)
        applied.append(opt.step())
    full = torch.cat([t.flatten().cpu() for t in opt.fp32_state_dict(wrapped).values()])
    torch.save(full, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"applied": applied, "scale": opt.get_loss_scaling(),
                   "overflow": opt.stats()["last_overflow"]}, f)
    dist.destroy_process_group()
"""


@two_gpus
@pytest.mark.timeout(300)
def test_two_rank_nccl_stage3_skips_an_overflow_on_one_rank_in_lockstep(tmp_path):
    run_two_gpu_job(tmp_path, NCCL_STAGE3_JOB)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report == {"applied": [True, True, False, True], "scale": 512.0,
                          "overflow": {"step": 3, "params": ["0.weight"]}}
    full = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert torch.equal(full[0], full[1])
