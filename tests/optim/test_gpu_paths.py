"""CUDA-path defects checked on CPU: which kernels the step issues, and with which dtypes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp import auto_cast
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy


def _model(width: int = 4, layers: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _strategy(**amp_configs) -> DistributedStrategy:
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = amp_configs
    return strategy


def _one_step(model, opt) -> None:
    with auto_cast(dtype=opt.strategy.amp_config.dtype):
        loss = F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 4))
    opt.backward(loss)
    opt.step()


def test_o2_never_gives_the_fused_check_16_bit_tensors(monkeypatch):
    """torch has had no BF16 CUDA kernel for the fused check in several releases (pytorch issue 127176)."""
    seen: list[torch.dtype] = []
    import distamp.core.chunked_update as chunked_update
    import distamp.core.precision as precision

    original = precision.amp_foreach_non_finite_check_and_unscale_

    def recording(grads, found_inf, inv_scale):
        seen.extend(g.dtype for g in grads)
        return original(grads, found_inf, inv_scale)

    # Where the O2 precision plugin and its chunked check look the fused check up (distamp.torch_compat's name).
    monkeypatch.setattr(precision, "amp_foreach_non_finite_check_and_unscale_", recording)
    monkeypatch.setattr(chunked_update, "amp_foreach_non_finite_check_and_unscale_", recording)
    for dtype in ("bfloat16", "float16"):
        model = _model()
        _one_step(model, AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      _strategy(dtype=dtype, use_pure_fp16=True)))
    assert seen
    assert set(seen) == {torch.float32}


def test_the_lognormal_gradient_maximum_is_one_fused_kernel_not_one_op_per_parameter():
    model = _model(layers=12)  # 24 parameters
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                       _strategy(loss_scaling_algorithm="lognormal", init_loss_scaling=8.0))
    with torch.profiler.profile() as prof:
        _one_step(model, opt)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::_foreach_norm") == 1
    assert counts.get("aten::aminmax", 0) == 0
    assert counts.get("aten::abs", 0) < 5
    assert opt.loss_scaler.num_observations == 1
