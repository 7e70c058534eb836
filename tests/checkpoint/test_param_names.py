"""Optimizer state in checkpoints follows parameter names, not positions.

The model ``QK`` has two equal-shape layers ``q_proj`` and ``k_proj``; a
refactor that defines ``k_proj`` first changes the order of the parameters,
and so the positions torch's optimizer state, the FP32 masters and the
flat layouts of sharded state number them by. Resumed by that model, a
checkpoint's state must follow the names (as ``torch.distributed.checkpoint``
keys it): training goes on bitwise as the uninterrupted run, where the old
positional load gave ``q_proj``'s Adam moments and masters to ``k_proj``.
A checkpoint that names other parameters, groups or shapes is refused
before anything is loaded; one saved without names loads by position.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.checkpoint import load_latest_checkpoint, save_checkpoint
from distamp.optim.optimizer import AmpOptimizer
from distamp.strategy import DistributedStrategy
from tests.checkpoint.test_checkpoint import payload
from tests.multiprocess import run_workers

SAVE_AT, END, WIDTH = 3, 6, 6


class QK(nn.Module):
    """Two equal-shape projections multiplied, then an output layer; ``k_first`` defines ``k_proj`` first."""

    def __init__(self, k_first: bool = False, width: int = WIDTH) -> None:
        super().__init__()
        if k_first:
            self.k_proj = nn.Linear(WIDTH, width)
            self.q_proj = nn.Linear(WIDTH, width)
        else:
            self.q_proj = nn.Linear(WIDTH, width)
            self.k_proj = nn.Linear(WIDTH, width)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.q_proj(x)) * self.k_proj(x))


def make_qk(k_first: bool, seed: int = 0) -> QK:
    """A ``QK`` with the weights of ``QK()`` seeded ``seed``, whichever order it defines its layers in."""
    torch.manual_seed(seed)
    weights = QK().state_dict()
    model = QK(k_first)
    model.load_state_dict(weights)
    return model


def two_groups(model: nn.Module) -> list[dict]:
    """The projections (the first four parameters) in one param group, the output layer in another with its
    own learning rate."""
    params = list(model.parameters())
    return [{"params": params[:4]}, {"params": params[4:], "lr": 5e-3}]


def fp16_strategy() -> DistributedStrategy:
    strategy = DistributedStrategy(amp=True)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "float16", "init_loss_scaling": 1024.0}
    return strategy


def build(k_first: bool, seed: int = 0) -> tuple[QK, AmpOptimizer]:
    """O2 FP16 Adam over two param groups, unsharded, one process."""
    model = make_qk(k_first, seed)
    return model, AmpOptimizer(torch.optim.Adam(two_groups(model), lr=1e-2), fp16_strategy())


def batches(world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, WIDTH, generator=g), torch.randn(4 * world, 3, generator=g)) for _ in range(END)]


def train(model: nn.Module, opt: AmpOptimizer, first: int, last: int, rank: int = 0, world: int = 1) -> None:
    """Steps ``first..last-1``, this rank's share of each batch (no clipping: every update is per element).

    Inputs in the model's 16-bit dtype, or (``fleet``'s models) under ``fleet.auto_cast``.
    """
    from distamp import fleet

    one_process = isinstance(model, QK)
    for x, y in batches(world)[first:last]:
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        if one_process:
            loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        else:
            with fleet.auto_cast():
                loss = F.mse_loss(model(x).float(), y)
        opt.zero_grad()
        opt.backward(loss)
        assert opt.step()


def by_name(model: nn.Module, opt: AmpOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: the model's value, its FP32 master and its Adam moments."""
    module = getattr(model, "module", model)
    index = {id(p): i for i, p in enumerate(opt.master_weights.model_params)}
    masters = opt.master_weights.masters
    state = opt.inner_opt.state
    out = {}
    for name, p in module.named_parameters():
        master = masters[index[id(p)]]
        out[name] = {"value": p.detach().clone(), "master": master.detach().clone(),
                     **{k: v.clone() for k, v in state[master].items() if torch.is_tensor(v)}}
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def payload_of(directory, step: int) -> dict:
    return torch.load(payload(directory, step), weights_only=True)


# --------------------------------------------------------------------------- one process, unsharded


def _uninterrupted() -> dict:
    model, opt = build(False)
    train(model, opt, 0, END)
    return by_name(model, opt)


def _save(directory, k_first: bool = False) -> dict:
    model, opt = build(k_first)
    train(model, opt, 0, SAVE_AT)
    save_checkpoint(directory, SAVE_AT, model=model, optimizer=opt)
    return by_name(model, opt)


def test_a_model_defining_its_layers_in_another_order_resumes_bitwise(tmp_path):
    saved = _save(tmp_path)
    model, opt = build(True, seed=7)  # k_proj first; other weights
    assert next(n for n, _ in model.named_parameters()) == "k_proj.weight"
    load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    assert_same(by_name(model, opt), saved)  # each name has its own masters and moments back
    train(model, opt, SAVE_AT, END)
    assert_same(by_name(model, opt), _uninterrupted())


def test_a_checkpoint_records_the_names_shapes_and_groups_in_the_order_of_the_state(tmp_path):
    _save(tmp_path, k_first=True)
    assert payload_of(tmp_path, SAVE_AT)["optimizer_parameter_names"] == {
        "names": ["k_proj.weight", "k_proj.bias", "q_proj.weight", "q_proj.bias", "out.weight", "out.bias"],
        "shapes": [[WIDTH, WIDTH], [WIDTH], [WIDTH, WIDTH], [WIDTH], [3, WIDTH], [3]],
        "groups": [[0, 1, 2, 3], [4, 5]],
    }


def test_a_plain_torch_optimizer_follows_the_names_too(tmp_path):
    def adam(k_first: bool, seed: int = 0) -> tuple[QK, torch.optim.Optimizer]:
        model = make_qk(k_first, seed)
        return model, torch.optim.Adam(two_groups(model), lr=1e-2)

    def steps(model, opt, first, last):
        for x, y in batches()[first:last]:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    reference, ref_opt = adam(False)
    steps(reference, ref_opt, 0, END)
    model, opt = adam(False)
    steps(model, opt, 0, SAVE_AT)
    save_checkpoint(tmp_path, SAVE_AT, model=model, optimizer=opt)
    model, opt = adam(True, seed=7)
    load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    steps(model, opt, SAVE_AT, END)
    for name, p in reference.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p), name
        assert torch.equal(opt.state[dict(model.named_parameters())[name]]["exp_avg"], ref_opt.state[p]["exp_avg"])


def test_a_checkpoint_saved_without_names_loads_by_position_as_before(tmp_path, monkeypatch):
    from distamp.checkpoint import save

    monkeypatch.setattr(save.param_names, "record", lambda model, optimizer: None)
    saved = _save(tmp_path)
    assert "optimizer_parameter_names" not in payload_of(tmp_path, SAVE_AT)
    monkeypatch.undo()
    model, opt = build(False, seed=7)
    load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    assert_same(by_name(model, opt), saved)
    train(model, opt, SAVE_AT, END)
    assert_same(by_name(model, opt), _uninterrupted())


class Renamed(QK):
    """``QK`` whose output layer is called ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = self.out
        del self.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.q_proj(x)) * self.k_proj(x))


def _first_two_in_a_group(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": 5e-3}]


@pytest.mark.parametrize(
    ("make", "groups", "message"),
    [
        # The checkpoint's 'out.*' are this model's 'head.*': named on both sides.
        (lambda: Renamed(), two_groups,
         r"the checkpoint has parameters 'out.weight', 'out.bias', which this one lacks; this one has "
         r"parameters 'head.weight', 'head.bias', which the checkpoint lacks"),
        # The first two parameters in a group of their own: q_proj's at save, k_proj's now.
        (lambda: make_qk(True), _first_two_in_a_group,
         r"'k_proj.weight' is in group 1 of 2 in the checkpoint and in group 0 of 2 here"),
        (lambda: QK(k_first=True, width=WIDTH + 1), two_groups,
         r"parameter 'k_proj.weight' has shape \[6, 6\] in the checkpoint and \[7, 6\] in this model"),
    ],
    ids=["a name differs", "a group's members changed", "a shape changed"],
)
def test_a_checkpoint_of_other_names_groups_or_shapes_is_refused_before_anything_loads(tmp_path, make, groups,
                                                                                       message):
    model = make_qk(False)
    opt = AmpOptimizer(torch.optim.Adam(groups(model), lr=1e-2), fp16_strategy())
    train(model, opt, 0, SAVE_AT)
    save_checkpoint(tmp_path, SAVE_AT, model=model, optimizer=opt)

    torch.manual_seed(7)
    model = make()
    opt = AmpOptimizer(torch.optim.Adam(groups(model), lr=1e-2), fp16_strategy())
    train(model, opt, 0, 1)
    before = by_name(model, opt)
    with pytest.raises(RuntimeError, match=message) as raised:
        load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    assert "build the model and optimizer the way the saving run did" in str(raised.value)
    assert_same(by_name(model, opt), before)  # nothing loaded


# --------------------------------------------------------------------------- several processes, sharded


def _sharded_build(stage: int, k_first: bool):
    """O2 BF16 AdamW over two param groups with ``fleet`` at ``stage``; (wrapped model, optimizer)."""
    from distamp import fleet
    from tests.sharding.test_sharding import _strategy

    fleet.init()
    model = make_qk(k_first)
    strategy = _strategy(stage, use_pure_fp16=True, dtype="bfloat16")
    opt = fleet.distributed_optimizer(torch.optim.AdamW(two_groups(model), lr=1e-2), strategy)
    return fleet.distributed_model(model, strategy), opt


def _fp32(wrapped, opt) -> dict[str, torch.Tensor]:
    return {name: v.clone() for name, v in opt.fp32_state_dict(wrapped).items()}


def _save_then_resume_reordered(rank, world, root, stages):
    """Per stage: (uninterrupted, resumed by the k_proj-first model) after END steps, FP32 by name."""
    out = {}
    for stage in stages:
        wrapped, opt = _sharded_build(stage, k_first=False)
        train(wrapped, opt, 0, SAVE_AT, rank, world)
        save_checkpoint(os.path.join(root, f"stage{stage}-world{world}"), SAVE_AT, model=wrapped, optimizer=opt)
        train(wrapped, opt, SAVE_AT, END, rank, world)
        uninterrupted = _fp32(wrapped, opt)
        wrapped, opt = _sharded_build(stage, k_first=True)
        load_latest_checkpoint(os.path.join(root, f"stage{stage}-world{world}"), model=wrapped, optimizer=opt)
        train(wrapped, opt, SAVE_AT, END, rank, world)
        out[stage] = (uninterrupted, _fp32(wrapped, opt))
    return out


def _resume_both_orders(rank, world, root, plan):
    """Per (checkpoint, stage): the FP32 state by name after END steps, resumed in each order."""
    out = {}
    for saved, stage in plan:
        for k_first in (False, True):
            wrapped, opt = _sharded_build(stage, k_first)
            load_latest_checkpoint(os.path.join(root, saved), model=wrapped, optimizer=opt)
            train(wrapped, opt, SAVE_AT, END, rank, world)
            out[saved, stage, k_first] = _fp32(wrapped, opt)
    return out


def _assert_equal_by_name(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.timeout(400)
def test_stage_2_and_3_checkpoints_resume_reordered_models_at_any_world_size(tmp_path):
    root = str(tmp_path)
    # Two ranks, each stage: the reordered model resumes its own stage bitwise as the uninterrupted run.
    two = run_workers(_save_then_resume_reordered, 2, root, (2, 3), timeout=150)
    for results in two:
        for stage in (2, 3):
            _assert_equal_by_name(results[stage][1], results[stage][0])
    # One rank unsharded resumes them, and saves an unsharded checkpoint of its own.
    plan = [("stage2-world2", 0), ("stage3-world2", 0)]
    (one,) = run_workers(_resume_both_orders, 1, root, plan, timeout=120)
    run_workers(_save_then_resume_reordered, 1, root, (0,), timeout=120)
    # Two ranks resume that one at stages 2 and 3, and each other's at the other stage.
    plan2 = [("stage0-world1", 2), ("stage0-world1", 3), ("stage2-world2", 3), ("stage3-world2", 2)]
    resumed = run_workers(_resume_both_orders, 2, root, plan2, timeout=200)
    for results, steps in ((one, plan), *((r, plan2) for r in resumed)):
        for saved, stage in steps:  # the reordered model resumes as the one of the saving order
            _assert_equal_by_name(results[saved, stage, True], results[saved, stage, False])
