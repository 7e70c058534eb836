"""AMP on one CUDA GPU through the public API (``pytest -m cuda tests/cuda``).

O1 and O2 in FP16 and BF16 train; O1 with the default op lists is bitwise
torch's own ``torch.autocast("cuda", dtype)`` + ``torch.amp.GradScaler("cuda")``
loop, on an MLP and on a small conv net; a BF16 O2 step with a non-finite
gradient is skipped; ``torch.compile`` sees ``fleet.auto_cast`` as it sees
``torch.autocast``.

Everything runs in the pytest process: ``fleet.init()`` without a launcher
makes it a one-process world (a one-rank NCCL group on ``cuda:0``), so
``fleet.distributed_model`` calls the model directly, without DDP.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.cuda

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def make_strategy(**configs):
    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = configs
    return strategy


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def convnet(seed: int = 0) -> nn.Module:
    # No pooling: CUDA pooling backward kernels may use atomics, which would
    # make a bitwise comparison between two runs flaky.
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 4),
    )


MODELS = {"mlp": (mlp, (16,)), "conv": (convnet, (3, 8, 8))}


def batches(kind: str, n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = MODELS[kind][1]
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, *shape, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda())
        for _ in range(n)
    ]


def fleet_build(model: nn.Module, strategy, lr: float = 1e-2):
    """fleet.init, the model on fleet.device(), distributed_optimizer, distributed_model."""
    from distamp import fleet

    fleet.init()
    model = model.to(fleet.device())
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), strategy)
    wrapped = fleet.distributed_model(model)
    return model, wrapped, opt


def fleet_step(wrapped, opt, x, y) -> tuple[float, torch.dtype, bool]:
    from distamp import fleet

    with fleet.auto_cast():
        out = wrapped(x)
        loss = F.mse_loss(out.float(), y)
    opt.zero_grad()
    opt.backward(loss)
    return loss.item(), out.dtype, opt.step()


@contextlib.contextmanager
def deterministic_cudnn():
    """Deterministic convolution algorithms, so two identical runs agree bitwise."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pure", [False, True], ids=["O1", "O2"])
def test_o1_and_o2_train_on_one_gpu(pure, dtype):
    from distamp import fleet

    low = DTYPES[dtype]
    model, wrapped, opt = fleet_build(mlp(), make_strategy(use_pure_fp16=pure, dtype=dtype))
    assert fleet.device() == torch.device("cuda", 0)
    assert wrapped.ddp is None  # one-process world: no DDP
    x, y = batches("mlp", 1)[0]
    results = [fleet_step(wrapped, opt, x, y) for _ in range(30)]
    losses = [loss for loss, _, _ in results]
    assert all(out_dtype == low for _, out_dtype, _ in results)
    assert opt.steps_applied >= 25
    assert losses[-1] < 0.5 * losses[0]
    expected = low if pure else torch.float32
    assert all(p.dtype == expected and p.is_cuda for p in model.parameters())
    if pure:
        assert all(m.dtype == torch.float32 and m.is_cuda for m in opt.master_weights.masters)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_o1_is_bitwise_torch_autocast_and_gradscaler(kind, dtype):
    """Default op lists: O1 is torch.autocast("cuda") + GradScaler("cuda"), step for step."""
    low = DTYPES[dtype]
    data = batches(kind, 6)
    make_model = MODELS[kind][0]
    fp16 = dtype == "float16"
    with deterministic_cudnn():
        ref = make_model().cuda()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2000, enabled=fp16)
        for x, y in data:
            with torch.autocast("cuda", dtype=low):
                loss = F.mse_loss(ref(x).float(), y)
            ref_opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()

        scaling = {"init_loss_scaling": 2.0**16, "incr_every_n_steps": 2000, "decr_every_n_nan_or_inf": 1}
        model, wrapped, opt = fleet_build(make_model(), make_strategy(dtype=dtype, **(scaling if fp16 else {})))
        for x, y in data:
            fleet_step(wrapped, opt, x, y)

    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    if fp16:
        assert opt.get_loss_scaling() == scaler.get_scale()


def test_bf16_o2_step_with_a_non_finite_gradient_is_skipped():
    """The fused check-and-unscale runs on BF16 CUDA gradients (pytorch/pytorch#127176)."""
    model, wrapped, opt = fleet_build(mlp(), make_strategy(use_pure_fp16=True, dtype="bfloat16"))
    x, y = batches("mlp", 1)[0]
    assert fleet_step(wrapped, opt, x, y)[2] is True
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.master_weights.masters]
    momenta = [s["momentum_buffer"].clone() for s in opt.state.values()]

    from distamp import fleet

    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(x).float(), y)
    opt.zero_grad()
    opt.backward(loss)
    assert model[0].weight.grad.dtype == torch.bfloat16
    assert model[0].weight.grad.is_cuda
    model[0].weight.grad[0, 0] = float("inf")
    assert opt.step() is False
    assert opt.step_was_skipped
    assert opt.get_loss_scaling() == 1.0
    for before, p in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, p)
    for before, m in zip(masters, opt.master_weights.masters, strict=True):
        assert torch.equal(before, m)
    for before, s in zip(momenta, opt.state.values(), strict=True):
        assert torch.equal(before, s["momentum_buffer"])
    assert fleet_step(wrapped, opt, x, y)[2] is True


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_compile_under_auto_cast_runs_in_16_bits_like_torch_autocast(backend, dtype, tmp_path, monkeypatch):
    # Each case compiles on an empty on-disk cache: before torch 2.13 AOTAutograd's cache key has no
    # autocast dtype, so the reference under torch.autocast(bfloat16) read the graph the float16 case
    # had cached and ran in FP16 (torch 2.11, H100). distamp's auto_cast switches that cache off
    # (distamp.amp.compile_cache); torch.autocast alone does not.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    from distamp import fleet

    low = DTYPES[dtype]
    fleet.init(strategy=make_strategy(dtype=dtype))  # auto_cast follows this strategy
    model = mlp().to(fleet.device())
    x = batches("mlp", 1)[0][0]
    torch._dynamo.reset()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=low):
            reference = torch.compile(model, backend=backend)(x)
        with fleet.auto_cast():
            out = torch.compile(model, backend=backend)(x)
    assert reference.dtype == low
    assert out.dtype == low
    assert torch.equal(out, reference)


def _o2_step_and_masters(reset_peak_before_step: bool) -> list[torch.Tensor]:
    """One O2 BF16 SGD step of a 4.2M-parameter MLP on a batch whose activations dwarf the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))
    _, wrapped, opt = fleet_build(model, make_strategy(use_pure_fp16=True, dtype="bfloat16"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16384, 1024, generator=g).cuda(), torch.randn(16384, 1024, generator=g).cuda()
    from distamp import fleet

    with fleet.auto_cast():
        loss = F.mse_loss(wrapped(x).float(), y)
    opt.zero_grad()
    opt.backward(loss)
    del loss
    if reset_peak_before_step:
        torch.cuda.reset_peak_memory_stats()
    assert opt.step() is True
    return [m.detach().clone() for m in opt.master_weights.masters]


def test_o2_steps_in_one_chunk_below_an_earlier_peak_and_in_many_without_room_with_the_same_masters(monkeypatch):
    """On CUDA the chunked update takes chunks as large as fit below the allocator's peak so far: after an
    activation-heavy backward the whole model is one chunk (one inner ``step()``); with the peak statistic
    just reset there is no room and it steps in chunks of 1/16 of the model. The masters agree bitwise.

    The chunks are counted where each one steps: the inner optimizer's step hooks run once around them all.
    """
    from distamp.core import chunked_update

    chunks = []
    step_with = chunked_update._step_with
    monkeypatch.setattr(chunked_update, "_step_with", lambda *args: (chunks.append(1), step_with(*args)))
    masters = _o2_step_and_masters(reset_peak_before_step=False)
    one_chunk = len(chunks)
    chunks.clear()
    chunked_masters = _o2_step_and_masters(reset_peak_before_step=True)
    assert one_chunk == 1
    assert len(chunks) >= 16
    for a, b in zip(masters, chunked_masters, strict=True):
        assert torch.equal(a, b)
