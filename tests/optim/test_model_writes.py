"""O2: weights the user writes into the model between steps are what it trains from, as without masters.

``model.load_state_dict`` after the optimizer was built (pretrained
weights), an in-place edit under ``torch.no_grad()``: the next step must
start from the written values, not silently put back the FP32 masters
(which then also applied a gradient taken at the written weights to the old
ones). Reference: the same run whose masters are set to the written values
by hand, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.amp import auto_cast
from distamp.optim import AmpOptimizer
from distamp.strategy import DistributedStrategy


def _strategy(dtype: str) -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": dtype,
                            **({"init_loss_scaling": 1024.0} if dtype == "float16" else {})}
    return strategy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 3))


def _steps(model, opt, dtype, seeds) -> None:
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        with auto_cast(dtype=getattr(torch, dtype)):
            loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()


def _write(model: nn.Module, how: str) -> list[nn.Parameter]:
    """Write some of the model's weights; returns the ones written."""
    with torch.no_grad():
        if how == "in_place":
            model[0].weight.mul_(0.5)
            model[1].weight.add_(0.25)  # the FP32-kept LayerNorm has a separate master too
            return [model[0].weight, model[1].weight]
        pretrained = {k: torch.randn_like(v, dtype=torch.float32) for k, v in model.state_dict().items()}
        model.load_state_dict(pretrained)
        return list(model.parameters())


@pytest.mark.parametrize("how", ["in_place", "load_state_dict"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_o2_trains_from_weights_written_into_the_model_between_steps(dtype, how):
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy(dtype))
    _steps(model, opt, dtype, [1, 2])
    _write(model, how)
    written = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, dtype, [3, 4])

    reference = _model()
    ref_opt = AmpOptimizer(torch.optim.SGD(reference.parameters(), lr=0.1), _strategy(dtype))
    _steps(reference, ref_opt, dtype, [1, 2])
    changed = _write(reference, how)
    assert all(torch.equal(a, b) for a, b in zip(written, reference.parameters(), strict=True))
    with torch.no_grad():  # what the write must mean: the written parameters' masters become their values
        for p in changed:
            ref_opt.master_weights.master_for(p).copy_(p)
    _steps(reference, ref_opt, dtype, [3, 4])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    ours, theirs = opt.master_weights.exact_fp32(), ref_opt.master_weights.exact_fp32()
    assert all(torch.equal(ours[id(p)], theirs[id(q)])
               for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def test_a_write_of_the_value_already_held_keeps_the_masters_fp32_bits():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy("bfloat16"))
    _steps(model, opt, "bfloat16", [1])
    before = [m.detach().clone() for m in opt.master_weights.masters]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in before)  # finer than BF16: there is a loss to see
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())  # the version counter moves, the value does not
    assert opt.master_weights.adopt_model_writes() == 0
    assert all(torch.equal(a, m) for a, m in zip(before, opt.master_weights.masters, strict=True))


def test_a_checkpoint_taken_after_loading_weights_holds_them():
    model = _model()
    opt = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), _strategy("bfloat16"))
    _write(model, "load_state_dict")
    state = opt.state_dict()
    saved = state["master_weights"]
    assert all(torch.equal(m, p.detach().float()) for m, p in zip(saved, model.parameters(), strict=True))


def _write_between_steps(rank, world, stage, overlap):
    """Two ranks, O2 BF16 SGD: two steps, every rank loads the same pretrained weights, two more steps."""
    from distamp import fleet
    from tests.sharding.test_sharding import _flat, _strategy

    fleet.init()
    model = _model()
    strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16", overlap=overlap)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.01), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    _steps(wrapped, opt, "bfloat16", [10 * rank + 1, 10 * rank + 2])
    opt.finish_param_gather()
    torch.manual_seed(7)  # the same pretrained weights on every rank
    _write(model, "load_state_dict")
    written = _flat(model)
    _steps(wrapped, opt, "bfloat16", [10 * rank + 3])
    opt.finish_param_gather()
    return written, _flat(model)


@pytest.mark.timeout(120)
def test_weights_loaded_between_steps_are_trained_from_at_sharding_stages_1_and_2():
    from tests.multiprocess import run_workers

    runs = {(stage, overlap): run_workers(_write_between_steps, 2, stage, overlap, timeout=100)
            for stage, overlap in [(0, False), (1, False), (2, False), (2, True)]}
    for (stage, overlap), ranks in runs.items():
        for written, after in ranks:
            # One SGD step (lr 0.01) away from what was loaded; put back, the old weights are ~1 away.
            assert (after - written).abs().max() < 0.05, (stage, overlap)
            assert torch.equal(after, runs[0, False][0][1]), (stage, overlap)  # as unsharded, on every rank


def _embedding_run(max_norm: float | None) -> torch.Tensor:
    """O2 BF16: row 0 grows past ``max_norm`` every step (renormalised in the forward), row 1 by 1e-5 per step."""
    emb = nn.Embedding(3, 4, max_norm=max_norm)
    with torch.no_grad():
        emb.weight.copy_(torch.tensor([[2.0, 0, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5]]))
    opt = AmpOptimizer(torch.optim.SGD(emb.parameters(), lr=1e-5), _strategy("bfloat16"))
    for _ in range(20):
        with auto_cast(dtype=torch.bfloat16):
            out = emb(torch.tensor([0, 1])).float()
        opt.zero_grad()
        opt.backward(-(out[1].sum() + 1000 * out[0].sum()))
        assert opt.step()
    return opt.master_weights.exact_fp32()[id(emb.weight)]


def test_rows_an_embedding_renormalises_are_taken_into_the_master_and_the_other_rows_keep_their_fp32_bits():
    # Was: the first row renormalised in a forward (an in-place write of some rows) made the whole master adopt the
    # 16-bit weight, so every row's updates below BF16's spacing were lost at every such step.
    renormed = _embedding_run(max_norm=1.0)
    free = _embedding_run(max_norm=None)
    assert torch.equal(renormed[1:], free[1:])  # rows 1 (1e-5 per step, below BF16's spacing) and 2 (not looked up)
    assert not torch.equal(renormed[1], renormed[1].bfloat16().float())  # finer than BF16: the master kept it
    # Row 0: renormalised to norm 1 by the last forward, then one update of 1e-2 per element; unrenormalised: ~2.4.
    assert abs(renormed[0].norm().item() - 1.0) < 0.05
    assert free[0].norm().item() > 2.0
