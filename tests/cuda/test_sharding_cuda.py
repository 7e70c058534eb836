"""Sharding stage 2 on CUDA (``pytest -m cuda tests/cuda``): the model's inputs go to its device, as DDP's do.

Read against torch's DDP (``DistributedDataParallel._pre_forward``): with
``device_ids`` it moves the forward's tensors to ``device_ids[0]`` with
``torch.distributed.utils._to_kwargs``, and FSDP2's root does the same.
Stage 2 replaces DDP with distamp's reducer, which moves them with the same
function, so a loop that hands the model CPU batches trains as it did
unsharded or at stage 1.
"""

from __future__ import annotations

import json

import pytest

from tests.cuda.jobs import run_two_gpu_job, two_gpus

pytestmark = pytest.mark.cuda


NCCL_STAGE2_JOB = """
    import json, os, sys, torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    from distamp import fleet

    out_dir = sys.argv[1]
    fleet.init()
    rank = dist.get_rank()

    def train(stage, inputs_on_cpu):
        strategy = fleet.DistributedStrategy(amp=True, sharding=stage > 0)
        strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
        if stage:
            strategy.sharding_configs = {"stage": stage}
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(fleet.device())
        opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with fleet.auto_cast():
                out = wrapped(x if inputs_on_cpu else x.cuda())
                loss = F.mse_loss(out.float(), y.cuda())
            opt.zero_grad()
            opt.backward(loss)
            opt.step()
        return torch.cat([t.flatten().cpu() for t in opt.fp32_state_dict(wrapped).values()]), out.device.type

    stage2_cpu, device = train(2, inputs_on_cpu=True)
    stage2_cuda, _ = train(2, inputs_on_cpu=False)
    stage1_cpu, _ = train(1, inputs_on_cpu=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"output_device": device, "same_as_cuda_inputs": torch.equal(stage2_cpu, stage2_cuda),
                   "same_as_stage1": torch.equal(stage2_cpu, stage1_cpu)}, f)
    dist.destroy_process_group()
"""


@two_gpus
@pytest.mark.timeout(300)
def test_two_rank_nccl_stage2_moves_cpu_inputs_to_the_model_device_as_ddp_does(tmp_path):
    run_two_gpu_job(tmp_path, NCCL_STAGE2_JOB)
    for r in range(2):
        # Stage 1 sums in the same FP32 slices: bitwise the same model.
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == {
            "output_device": "cuda", "same_as_cuda_inputs": True, "same_as_stage1": True}
