"""What real clients hit on 2 ranks: a group made by the user, the optimizer without the data-parallel
model (and with torch's own DDP), and closures that do not go the documented way."""

from __future__ import annotations

import contextlib
import os
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp import fleet
from tests.multiprocess import run_workers

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _as_user_group(rank: int) -> None:
    """Forget the launcher's variables: the group exists, as under ``mp.spawn``."""
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)


def _place_in_user_group(rank: int, world_size: int, hosts: list[str]) -> dict:
    _as_user_group(rank)
    socket.gethostname = lambda: hosts[rank]  # this worker's "host"
    fleet.init()
    return {"index": fleet.worker_index(), "num": fleet.worker_num(), "local": fleet.local_rank(),
            "device": str(fleet.device())}


@pytest.mark.timeout(60)
def test_a_user_made_group_gives_each_rank_its_local_rank():
    one_host = run_workers(_place_in_user_group, 2, ["node-a", "node-a"], timeout=45)
    assert [r["local"] for r in one_host] == [0, 1]  # was [0, 0]: every rank on cuda:0
    assert [r["index"] for r in one_host] == [0, 1]
    assert all(r["num"] == 2 and r["device"] == "cpu" for r in one_host)
    two_hosts = run_workers(_place_in_user_group, 3, ["node-a", "node-b", "node-a"], timeout=45)
    assert [r["local"] for r in two_hosts] == [0, 0, 1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _strategy(amp: bool) -> fleet.DistributedStrategy:
    strategy = fleet.DistributedStrategy()
    strategy.amp = amp
    if amp:
        strategy.amp_configs = {"dtype": "bfloat16"}
    return strategy


def _optimizer_alone(rank: int, world_size: int, amp: bool) -> dict:
    fleet.init()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), _strategy(amp))
    x, y = _batch(rank, 0)
    with fleet.auto_cast():
        loss = F.cross_entropy(model(x), y)
    optimizer.backward(loss)
    try:
        optimizer.step()
    except RuntimeError as exc:
        error = str(exc)
    else:
        error = ""
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {"error": error, "unchanged": unchanged}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("amp", [False, True])
def test_the_optimizer_without_a_data_parallel_model_refuses_to_step_on_two_ranks(amp):
    results = run_workers(_optimizer_alone, 2, amp, timeout=60)
    for result in results:  # was: each rank stepped on its own gradients, silently
        assert "runs on 2 ranks, but nothing all-reduces the gradients it applies" in result["error"]
        assert "model = fleet.distributed_model(model)" in result["error"]
        assert result["unchanged"]


def _with_torch_ddp(rank: int, world_size: int, amp: bool, inf_at: int) -> dict:
    fleet.init()
    model = _model()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), _strategy(amp))
    ddp = DistributedDataParallel(model)
    applied = []
    for step in range(4):
        x, y = _batch(rank, step)
        if step == inf_at and rank == 1:
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        with fleet.auto_cast():
            loss = F.cross_entropy(ddp(x), y)
        optimizer.backward(loss)
        applied.append(optimizer.step())
    return {"params": [p.detach().float().clone() for p in model.parameters()], "applied": applied}


def _full_batch_reference(amp: bool, inf_at: int) -> list[torch.Tensor]:
    """One process, both ranks' data in one batch (DDP averages the two halves' gradients)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(4):
        if step == inf_at:
            continue
        xs, ys = zip(*(_batch(rank, step) for rank in range(2)), strict=True)
        optimizer.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("amp", [False, True])
def test_a_model_in_torch_ddp_keeps_working_reduced_once_with_the_verdict_agreed(amp):
    inf_at = 2 if amp else -1  # AMP off checks nothing, as a plain optimizer
    rank0, rank1 = run_workers(_with_torch_ddp, 2, amp, inf_at, timeout=60)
    # Under AMP the inf on rank 1 skips step 2 on both ranks.
    assert rank0["applied"] == rank1["applied"] == [step != inf_at for step in range(4)]
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)
    # Reduced once: the average of the ranks' gradients, as one process on both batches (not twice that).
    tolerance = 2e-2 if amp else 1e-5
    for got, want in zip(rank0["params"], _full_batch_reference(amp, inf_at), strict=True):
        torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def _closures(rank: int, world_size: int, amp: bool) -> dict:
    fleet.init()
    model = _model()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), _strategy(amp))
    model = fleet.distributed_model(model)
    x, y = _batch(rank, 0)

    def documented() -> torch.Tensor:
        optimizer.zero_grad()
        with fleet.auto_cast():
            loss = F.cross_entropy(model(x), y)
        optimizer.backward(loss)
        return loss

    def no_backward() -> torch.Tensor:
        with fleet.auto_cast():
            return F.cross_entropy(model(x), y)

    out: dict = {}
    loss = optimizer.step(documented)
    out["documented"] = (isinstance(loss, torch.Tensor), optimizer.step_was_skipped, optimizer.steps_applied)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = optimizer.step(no_backward)
    out["no_backward"] = (isinstance(loss, torch.Tensor), optimizer.step_was_skipped, optimizer.steps_applied)
    out["no_backward_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    out["warnings"] = [(str(w.message), os.path.basename(w.filename)) for w in caught]
    if not amp:  # a plain loss.backward() is fine without a loss scale
        def plain_backward() -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        loss = optimizer.step(plain_backward)
        out["plain_backward"] = (isinstance(loss, torch.Tensor), optimizer.step_was_skipped, optimizer.steps_applied)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("amp", [False, True])
def test_closures_return_the_loss_and_a_closure_without_backward_is_a_warned_skip(amp):
    for result in run_workers(_closures, 2, amp, timeout=60):
        # amp off was: "backward() called after the gradients were unscaled" (the unscale ran first).
        assert result["documented"] == (True, False, 1)
        # was: reported as applied (steps_applied 2), silently changing nothing.
        assert result["no_backward"] == (True, True, 1)
        assert result["no_backward_unchanged"]
        assert len(result["warnings"]) == 1
        message, filename = result["warnings"][0]
        assert "found no new gradients since the last step" in message
        assert filename == "test_client_scenarios.py"  # the user's line, not distamp's
        if not amp:
            assert result["plain_backward"] == (True, False, 2)  # was: returned True, not the loss


def _merge_with_torch_ddp_no_sync(rank: int, world_size: int, wrapper: str) -> list[torch.Tensor]:
    import contextlib

    fleet.init()
    model = _model()
    strategy = _strategy(True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    wrapped = DistributedDataParallel(model) if wrapper == "torch" else fleet.distributed_model(model)
    for step in range(3):
        for micro in range(2):
            x, y = _batch(rank, 2 * step + micro)
            quiet = wrapped.no_sync() if wrapper == "torch" and micro == 0 else contextlib.nullcontext()
            with quiet:
                with fleet.auto_cast():
                    loss = F.cross_entropy(wrapped(x), y)
                optimizer.minimize(loss)
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.timeout(90)
def test_o2_gradient_merge_in_torch_ddp_with_no_sync_keeps_the_ranks_equal():
    # O2 moved the no_sync micro-batch's local gradient into its FP32 sum, out of the .grad that DDP's next
    # synced backward all-reduces: each rank added its own, and the replicas silently diverged.
    rank0, rank1 = run_workers(_merge_with_torch_ddp_no_sync, 2, "torch", timeout=60)
    for a, b in zip(rank0, rank1, strict=True):
        assert torch.equal(a, b)
    # The same updates as fleet.distributed_model's window, up to the no_sync micro-batch summed in BF16 in .grad.
    reference = run_workers(_merge_with_torch_ddp_no_sync, 2, "fleet", timeout=60)[0]
    for a, b in zip(rank0, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7)


def _step_inside_no_sync(rank: int, world_size: int, wrapper: str) -> dict:
    fleet.init()
    model = _model()
    strategy = _strategy(True)
    strategy.amp_configs = {"dtype": "float16", "use_pure_fp16": wrapper != "stage3"}
    if wrapper.startswith("stage"):
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(wrapper[-1])}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    wrapped = DistributedDataParallel(model) if wrapper == "torch" else fleet.distributed_model(model, strategy)
    errors = []
    for step in range(3):
        optimizer.zero_grad()
        with wrapped.no_sync():
            x, y = _batch(rank, 2 * step)
            with fleet.auto_cast():
                loss = F.cross_entropy(wrapped(x), y)
            optimizer.backward(loss)
            if step == 1:  # a step inside the window: only this rank's micro-batch is in .grad
                try:
                    optimizer.step()
                except RuntimeError as exc:
                    errors.append(str(exc))
        x, y = _batch(rank, 2 * step + 1)
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x), y)
        optimizer.backward(loss)  # synced: reduces the window's sum
        optimizer.step()
    params = optimizer.fp32_state_dict(wrapped)
    return {"errors": errors, "params": [p.detach().float().clone() for p in params.values()],
            "applied": optimizer.steps_applied}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", ["fleet", "torch", "stage2", "stage3"])
def test_a_step_after_a_no_sync_backward_is_refused_on_every_rank_and_the_window_goes_on(wrapper):
    rank0, rank1 = run_workers(_step_inside_no_sync, 2, wrapper, timeout=90)
    for result in (rank0, rank1):
        # was: each rank applied its own unreduced gradient (sharded: each slice its owner's), silently
        assert len(result["errors"]) == 1
        assert "after a backward inside model.no_sync()" in result["errors"][0]
        assert "outside no_sync()" in result["errors"][0]
        assert result["applied"] == 3
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)


def _parameters_outside_the_model(rank: int, world_size: int, stage: int, when: str) -> dict:
    fleet.init()
    model = _model()
    head = nn.Linear(3, 3)  # a learnable loss head, outside the data-parallel model
    strategy = _strategy(True)
    strategy.amp_configs = {"dtype": "float16"}
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    params = list(model.parameters()) + (list(head.parameters()) if when == "built" else [])
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(params, lr=0.5), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    errors = []
    if when == "added":
        try:
            optimizer.add_param_group({"params": list(head.parameters())})
        except RuntimeError as exc:
            errors.append(str(exc))
    before = {k: v.detach().clone() for k, v in optimizer.fp32_state_dict(wrapped).items()}
    x, y = _batch(rank, 0)
    with fleet.auto_cast():
        loss = F.cross_entropy(head(wrapped(x)), y)
    optimizer.backward(loss)
    try:
        optimizer.step()
    except RuntimeError as exc:
        errors.append(str(exc))
    after = optimizer.fp32_state_dict(wrapped)
    return {"errors": errors, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "head": [p.detach().clone() for p in head.parameters()], "groups": len(optimizer.param_groups)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("stage", "when"), [(0, "built"), (0, "added"), (1, "built"), (3, "built")])
def test_optimizer_parameters_outside_the_data_parallel_model_are_refused_on_every_rank(stage, when):
    rank0, rank1 = run_workers(_parameters_outside_the_model, 2, stage, when, timeout=90)
    for result in (rank0, rank1):
        # was: nothing reduced the head's gradient; each rank (stages 1-2: each slice's owner) applied its own
        assert len(result["errors"]) == 1
        assert "['params[4] (3, 3)', 'params[5] (3,)']" in result["errors"][0]
        assert "not parameters of the data-parallel model" in result["errors"][0]
        assert result["unchanged"] == (when == "built")  # refused by add_param_group, the model's step went on
        assert result["groups"] == 1
    for a, b in zip(rank0["head"], rank1["head"], strict=True):
        assert torch.equal(a, b)


def _forward_through_module(rank: int, world_size: int, path: str, bypass: str) -> dict:
    """O2 FP16 on ``path``, four steps (the third overflowing on rank 1); the second step's forward first bypasses
    the wrapper (``bypass``: "module" calls ``wrapped.module``, "twice" runs a second backward of one forward,
    "none" neither), and where that step is refused it is redone through the wrapper on the same batch."""
    fleet.init()
    model = _model()
    strategy = _strategy(True)
    strategy.amp_configs = {"dtype": "float16", "use_pure_fp16": True, "init_loss_scaling": 128.0}
    if path == "powersgd":
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": 1, "start_step": 1, "min_compression_rate": 1.0}
    elif path != "stage0":
        strategy.sharding = True
        strategy.sharding_configs = {"stage": int(path[-1])}
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.5), strategy)
    wrapped = fleet.distributed_model(model, strategy)
    errors = []

    def train_step(step: int, forward: nn.Module, twice: bool = False) -> None:
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        with fleet.auto_cast():
            loss = F.cross_entropy(forward(x), y) * (1e38 if step == 2 and rank == 1 else 1.0)
        if twice:
            optimizer.backward(loss / 2, retain_graph=True)
        optimizer.backward(loss / 2 if twice else loss)
        optimizer.step()

    for step in range(4):
        if step == 1 and bypass != "none":
            try:
                train_step(step, wrapped.module if bypass == "module" else wrapped, twice=bypass == "twice")
                continue
            except RuntimeError as exc:
                errors.append(str(exc))
        train_step(step, wrapped)
    params = optimizer.fp32_state_dict(wrapped)
    return {"errors": errors, "params": [p.detach().clone() for p in params.values()],
            "applied": optimizer.steps_applied, "skipped": optimizer.stats()["steps_skipped"]}


def _bypassed_and_not(rank: int, world_size: int, path: str, bypass: str) -> tuple[dict, dict]:
    return _forward_through_module(rank, world_size, path, bypass), _forward_through_module(
        rank, world_size, path, "none")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("path", "bypass"), [("stage0", "module"), ("stage1", "module"), ("powersgd", "module"),
                                              ("stage0", "twice"), ("stage2", "module"), ("stage3", "module")])
def test_a_backward_whose_forward_bypassed_ddp_is_refused_where_ddp_reduces_and_trains_elsewhere(path, bypass):
    """DDP reduces only the backward of a forward it ran: a forward through model.module, or a second backward of
    one forward, left each rank's own gradient. Stage 2's reducer and stage 3's FSDP2 hooks reduce it anyway."""
    results = run_workers(_bypassed_and_not, 2, path, bypass, timeout=100)
    refused = path in ("stage0", "stage1", "powersgd")
    for bypassed, reference in results:
        # was: every rank (stage 1: each slice's owner) applied its own gradient, silently
        assert len(bypassed["errors"]) == int(refused)
        if refused:
            assert "did not run through the fleet.distributed_model wrapper" in bypassed["errors"][0]
            assert "model.module" in bypassed["errors"][0]
        assert (bypassed["applied"], bypassed["skipped"]) == (reference["applied"], reference["skipped"]) == (3, 1)
        for a, b in zip(bypassed["params"], reference["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(results[0][0]["params"], results[1][0]["params"], strict=True):
        assert torch.equal(a, b)


def _plain_backward(rank: int, world_size: int, amp: bool, misuse: str, optimizers: int) -> dict:
    """Three steps with loss.backward() (AMP off, or BF16 O1: a loss scale of 1); the second first runs
    ``misuse`` ("module": the forward through ``wrapped.module``; "no_sync": inside ``wrapped.no_sync()``;
    "none": neither) and, where that step is refused, is redone through the wrapper on the same batch.
    With ``optimizers=2`` each layer has its own, both stepped."""
    fleet.init()
    model = _model()
    strategy = _strategy(amp)
    groups = [model.parameters()] if optimizers == 1 else [model[0].parameters(), model[2].parameters()]
    opts = [fleet.distributed_optimizer(torch.optim.SGD(params, lr=0.5), strategy) for params in groups]
    wrapped = fleet.distributed_model(model, strategy)
    errors = []

    def train_step(step: int, how: str) -> None:
        x, y = _batch(rank, step)
        for optimizer in opts:
            optimizer.zero_grad()
        with fleet.auto_cast(), wrapped.no_sync() if how == "no_sync" else contextlib.nullcontext():
            loss = F.cross_entropy((wrapped.module if how == "module" else wrapped)(x).float(), y)
        loss.backward()
        for optimizer in opts:
            optimizer.step()

    for step in range(3):
        if step == 1 and misuse != "none":
            try:
                train_step(step, misuse)
                continue
            except RuntimeError as exc:
                errors.append(str(exc))
        train_step(step, "wrapper")
    return {"errors": errors, "params": [p.detach().clone() for p in model.parameters()],
            "applied": [optimizer.steps_applied for optimizer in opts]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("amp", "optimizers"), [(False, 1), (True, 1), (False, 2)])
def test_a_plain_loss_backward_of_a_bypassed_or_no_sync_forward_is_refused_at_step_on_every_rank(amp, optimizers):
    """optimizer.backward asked the wrapper whether its backward reduced; a plain loss.backward() (usable where
    the loss scale is 1) was not asked, and each rank applied its own gradient. step() now asks for it (the first
    optimizer's step, with two: the wrapper is asked once per backward)."""
    results = {misuse: run_workers(_plain_backward, 2, amp, misuse, optimizers, timeout=100)
               for misuse in ("module", "no_sync", "none")}
    expected = {"module": "did not run through the fleet.distributed_model wrapper",
                "no_sync": "after a backward inside model.no_sync()"}
    for misuse, ranks in results.items():
        for result in ranks:
            # was: applied, each rank its own gradient (the ranks' weights differed after the step)
            assert len(result["errors"]) == (misuse != "none")
            if misuse != "none":
                assert expected[misuse] in result["errors"][0]
            assert result["applied"] == [3] * optimizers
            for a, b in zip(result["params"], results["none"][0]["params"], strict=True):
                assert torch.equal(a, b)
