"""distributed.ddp_preparation: the device check, the sharding checks, and what one preparation builds on 2 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.distributed.devices import check_device
from distamp.model.ddp_preparation import DDPPreparation
from distamp.sharding.reduce_scatter import REDUCE_BUCKET_BYTES
from distamp.strategy import DistributedStrategy
from tests.multiprocess import run_workers


def _strategy(amp: bool = True, stage: int = 0, bucket_mb: float = 25.0) -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.amp = amp
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.fuse_grad_size_in_MB = bucket_mb
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    return strategy


def test_check_device_returns_the_device_when_everything_is_on_it():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert check_device(model, torch.device("cpu")) == torch.device("cpu")


def test_check_device_names_the_first_parameter_elsewhere():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"^parameter '0.weight' is on meta, but this process trains on cpu "):
        check_device(model, torch.device("cpu"))


def test_check_device_names_a_buffer_elsewhere_and_the_fix():
    model = nn.BatchNorm1d(2)
    model.running_mean = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"buffer 'running_mean' is on meta") as info:
        check_device(model, torch.device("cpu"))
    assert str(info.value).endswith("move the model there before wrapping it: model.to(fleet.device())")


def test_check_device_names_a_compiled_models_tensors_as_the_model_does():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"^parameter '0.weight' is on meta"):
        check_device(torch.compile(model, backend="eager"), torch.device("cpu"))


class _Stage:
    """What check_sharding reads of an optimizer: its precision's stage and its masters' parameters."""

    def __init__(self, stage: int, params: list[nn.Parameter]) -> None:
        self.precision = type("P", (), {"stage": stage})()
        self.master_weights = type("M", (), {"model_params": params})()


def _preparation(model: nn.Module, strategy: DistributedStrategy) -> DDPPreparation:
    return DDPPreparation(model, strategy, None, None, find_unused_parameters=False)


def test_check_sharding_returns_the_stage_both_sides_agree_on():
    model = nn.Linear(2, 2)
    params = list(model.parameters())
    assert _preparation(model, _strategy(stage=1)).check_sharding([_Stage(1, params)]) == 1
    assert _preparation(model, _strategy(stage=2)).check_sharding([_Stage(2, params)]) == 2
    assert _preparation(model, _strategy()).check_sharding([_Stage(0, params)]) == 0


def test_check_sharding_refuses_a_model_and_optimizer_on_different_stages():
    model = nn.Linear(2, 2)
    opt = _Stage(2, list(model.parameters()))
    with pytest.raises(RuntimeError, match=r"optimizer's strategy has sharding stage 2 but the model's "
                                           r"\(fleet.distributed_model\) has stage off"):
        _preparation(model, _strategy()).check_sharding([opt])
    with pytest.raises(RuntimeError, match=r"has sharding stage off but the model's .* has stage 2"):
        _preparation(model, _strategy(stage=2)).check_sharding([_Stage(0, [])])
    # Stage 1 reduce-scatters too: a stage-1 optimizer with a stage-2 model (or the reverse) is refused.
    with pytest.raises(RuntimeError, match=r"has sharding stage 1 but the model's .* has stage 2"):
        _preparation(model, _strategy(stage=2)).check_sharding([_Stage(1, list(model.parameters()))])


def test_check_sharding_names_trainable_parameters_no_optimizer_owns():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)  # frozen: nobody needs to own its gradient
    opt = _Stage(2, list(model[0].parameters()))
    with pytest.raises(RuntimeError, match=r"but \['1.weight'\] \(of 1\) belong to no optimizer"):
        _preparation(model, _strategy(stage=2)).check_sharding([opt])
    opt.master_weights.model_params.append(model[1].weight)
    assert _preparation(model, _strategy(stage=2)).check_sharding([opt])


def _prepare(rank: int, world: int, amp: bool, stage: int, bucket_mb: float = 1.0) -> dict:
    from distamp import fleet
    from distamp.distributed.comm_hooks import LowPrecisionAllReduce
    from distamp.sharding.reduce_scatter import ShardedGradReduce
    from distamp.sharding.slice_reducer import SliceReducer

    torch.manual_seed(rank)  # different starting weights on each rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    strategy = _strategy(amp=amp, stage=stage, bucket_mb=bucket_mb)
    fleet.init(strategy=strategy)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    prepared = DDPPreparation(model, strategy, None, None, find_unused_parameters=False).run([opt])
    hook = prepared.comm_hook if prepared.reducer is None else prepared.reducer
    return {
        "hook": {LowPrecisionAllReduce: "16-bit all-reduce", ShardedGradReduce: "reduce-scatter",
                 SliceReducer: "stage-2 reducer, no DDP"}.get(type(hook), repr(hook)),
        "reduce_scatter": prepared.reduce_scatter,
        "bucket_bytes_cap": None if prepared.ddp is None else prepared.ddp.bucket_bytes_cap,
        "bucket_view": None if prepared.ddp is None else prepared.ddp.gradient_as_bucket_view,
        "exchange_bucket_bytes": None if stage == 0 else (hook.exchange if stage == 2 else hook).bucket_bytes,
        "weights": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in opt.master_weights.masters],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("amp", "stage", "hook"),
    [(False, 0, "None"), (True, 0, "16-bit all-reduce"), (True, 1, "reduce-scatter"),
     (True, 2, "stage-2 reducer, no DDP")],
)
def test_one_preparation_makes_ranks_identical_and_picks_the_comm_hook(amp, stage, hook):
    out = run_workers(_prepare, 2, amp, stage, timeout=100)
    for rank in (0, 1):
        assert out[rank]["hook"] == hook
        assert out[rank]["reduce_scatter"] == (stage > 0)
        if stage == 0:
            assert out[rank]["bucket_bytes_cap"] == 1024 * 1024  # strategy.fuse_grad_size_in_MB = 1
        if stage == 1:  # sized as stage 2's (a small model: the least), but never below DDP's first bucket
            assert REDUCE_BUCKET_BYTES < 1024 * 1024  # DDP's first bucket: 1 MiB
            assert out[rank]["bucket_bytes_cap"] == 1024 * 1024
        if stage < 2:
            assert out[rank]["bucket_view"]
    # Rank 1 started from other weights; after the preparation it holds rank 0's, bit for bit.
    for w0, w1 in zip(out[0]["weights"], out[1]["weights"], strict=True):
        assert torch.equal(w0, w1)
    if amp and stage == 0:
        for m0, m1 in zip(out[0]["masters"], out[1]["masters"], strict=True):
            assert m0.dtype == torch.float32
            assert torch.equal(m0, m1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("bucket_mb", "expected"), [(25, REDUCE_BUCKET_BYTES), (3, 3 * 2**20), (0.5, 2**19)])
def test_the_sharded_stages_size_buckets_from_the_model_at_the_default_and_take_any_other_size_as_given(
        stage, bucket_mb, expected):
    # The model's BF16 gradient is 116 bytes: at the default 25 MB the smallest bucket (256 KiB); a size the
    # user chose, above or below that, is the bucket (DDP's bucket_cap_mb, DeepSpeed's reduce_bucket_size).
    out = run_workers(_prepare, 2, True, stage, bucket_mb, timeout=100)
    for rank in (0, 1):
        assert out[rank]["exchange_bucket_bytes"] == expected
        if stage == 1:  # DDP's buckets are the same, never below DDP's first bucket (1 MiB)
            assert out[rank]["bucket_bytes_cap"] == max(expected, 2**20)
