"""distamp.checkpoint: bitwise resume, rotation, corruption fallback, atomicity, world-size change.

The resume tests compare a run that saves, is rebuilt from scratch (other
initial weights, other RNG states) and loads, against the same run without
interruption: parameters, FP32 masters, AdamW state, loss scale, counters
and the LR must be bitwise equal. The training step draws its data and
dropout masks from torch's RNG and adds noise from Python's ``random`` and
NumPy, so every RNG restored matters.
"""

from __future__ import annotations

import collections
import os
import pathlib
import random
import re
import shutil
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.checkpoint import (
    CheckpointInfo,
    list_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
)
from distamp.optim.optimizer import AmpOptimizer
from distamp.strategy import DistributedStrategy
from tests.multiprocess import run_workers

SKIP_AT = 2  # an injected inf makes this step skip, before the checkpoint


def make_strategy() -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {
        "use_pure_fp16": True,
        "dtype": "float16",
        "init_loss_scaling": 1024.0,
        "decr_every_n_nan_or_inf": 1,
        "incr_every_n_steps": 3,
    }
    return strategy


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.25), nn.ReLU(), nn.Linear(8, 3))


def build(seed: int, distributed: bool = False):
    """(model used for forward, optimizer, scheduler); O2 FP16 AdamW + StepLR."""
    model = make_net(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if distributed:
        from distamp import fleet

        fleet.init()
        optimizer = fleet.distributed_optimizer(inner, make_strategy())
        model = fleet.distributed_model(model)
    else:
        optimizer = AmpOptimizer(inner, make_strategy())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, start: int, stop: int, inject_rank: int = 0, rank: int = 0) -> list[bool]:
    """Steps ``start..stop-1``; data, dropout and noise all come from the global RNGs."""
    applied = []
    for step in range(start, stop):
        x = torch.randn(4, 6) + random.random() + float(np.random.rand())
        y = torch.randn(4, 3)
        loss = F.mse_loss(model(x.half()).float(), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        if step == SKIP_AT and rank == inject_rank:
            next(iter(optimizer.master_weights.model_params)).grad[0, 0] = float("inf")
        ok = optimizer.step()
        if ok:
            scheduler.step()
        applied.append(ok)
    return applied


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def snapshot(model, optimizer, scheduler) -> dict:
    module = getattr(model, "module", model)
    state = optimizer.state_dict()
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "masters": [m.detach().clone() for m in optimizer.master_weights.masters],
        "inner": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for s in state["inner"]["state"].values()
        ],
        "scaler": dict(state["loss_scaler"]),
        "counters": dict(state["counters"]),
        "lr": list(scheduler.get_last_lr()),
    }


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in ("params", "masters"):
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key], strict=True):
            assert x.dtype == y.dtype, key
            assert torch.equal(x, y), key
    for sa, sb in zip(a["inner"], b["inner"], strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k
    assert a["scaler"] == b["scaler"]
    assert a["counters"] == b["counters"]
    assert a["lr"] == b["lr"]


def uninterrupted_and_resumed(directory: str, total: int, save_at: int, distributed=False, rank=0) -> tuple:
    seed_everything(100 + rank)
    model, opt, sched = build(0, distributed)
    reference_applied = train(model, opt, sched, 0, total, rank=rank)
    reference = snapshot(model, opt, sched)

    seed_everything(100 + rank)
    model, opt, sched = build(0, distributed)
    first = train(model, opt, sched, 0, save_at, rank=rank)
    save_checkpoint(directory, save_at, model=model, optimizer=opt, scheduler=sched, extra={"next_step": save_at})
    train(model, opt, sched, save_at, save_at + 1, rank=rank)  # moves on past the checkpoint

    seed_everything(999)  # a restarted process: other weights, other RNG states
    model, opt, sched = build(7, distributed)
    info = load_latest_checkpoint(directory, model=model, optimizer=opt, scheduler=sched)
    rest = train(model, opt, sched, info.extra["next_step"], total, rank=rank)
    return reference_applied, first + rest, reference, snapshot(model, opt, sched), info


# --------------------------------------------------------------------------- one process


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    ref_applied, applied, reference, resumed, info = uninterrupted_and_resumed(str(tmp_path), 10, 6)
    assert ref_applied[SKIP_AT] is False
    assert ref_applied.count(False) == 1
    assert applied == ref_applied
    assert info == CheckpointInfo(
        step=6, path=str(payload(tmp_path, 6)), extra={"next_step": 6}, world_size=1, rng_restored=True,
        manifest=str(tmp_path / "step-00000006.json"),
    )
    assert_bitwise_equal(reference, resumed)


def test_without_the_rng_states_the_resumed_run_differs(tmp_path, monkeypatch):
    """Shows the comparison above is sharp: dropout and data depend on the RNGs."""
    from distamp.checkpoint import rng

    monkeypatch.setattr(rng, "set_rng_state", lambda state: [])
    _, _, reference, resumed, _ = uninterrupted_and_resumed(str(tmp_path), 10, 6)
    assert not torch.equal(reference["masters"][0], resumed["masters"][0])


def test_no_checkpoint_means_none(tmp_path):
    model, opt, sched = build(0)
    assert load_latest_checkpoint(tmp_path / "missing", model=model, optimizer=opt, scheduler=sched) is None
    assert load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched) is None
    assert list_checkpoints(tmp_path / "missing") == []


def save_steps(directory, steps, keep=2):
    model, opt, sched = build(0)
    for step in steps:
        save_checkpoint(directory, step, model=model, optimizer=opt, scheduler=sched, extra={"step": step}, keep=keep)
    return model, opt, sched


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def layout(directory) -> list[str]:
    """The file names with each payload's hash replaced by ``<hash>``."""
    return sorted(re.sub(r"\.[0-9a-f]{16}\.pt$", ".<hash>.pt", name) for name in files(directory))


def payload(directory, step: int):
    """The common payload file of checkpoint ``step``."""
    (found,) = [p for p in directory.iterdir() if p.name.startswith(f"step-{step:08d}.common.")]
    return found


def test_keeps_the_last_two_and_creates_the_directory(tmp_path):
    directory = tmp_path / "a" / "b"
    save_steps(directory, [10, 20, 30, 40])
    assert layout(directory) == [
        "step-00000030.common.<hash>.pt", "step-00000030.json", "step-00000040.common.<hash>.pt", "step-00000040.json"
    ]
    save_steps(directory, [50, 60, 70], keep=3)
    assert list_checkpoints(directory) == [70, 60, 50]


def test_a_save_removes_newer_checkpoints_of_an_abandoned_run_and_stale_temporaries(tmp_path):
    save_steps(tmp_path, [10, 20])
    (tmp_path / ".tmp-12345-0badf00d-step-00000030.common.pt").write_bytes(b"half a checkpo")
    save_steps(tmp_path, [15])  # resumed from 10 after 20 went bad, now saving 15
    assert layout(tmp_path) == [
        "step-00000010.common.<hash>.pt", "step-00000010.json", "step-00000015.common.<hash>.pt", "step-00000015.json"
    ]


def corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def corrupt_flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def manifest_of(path):
    """The manifest next to the payload ``path``."""
    return path.with_name(path.name.split(".")[0] + ".json")


def corrupt_drop_manifest(path):
    manifest_of(path).unlink()
    return manifest_of(path)


def corrupt_garble_manifest(path):
    manifest_of(path).write_text("{not json")
    return manifest_of(path)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (corrupt_truncate, "truncated"),
        (corrupt_flip_byte, "corrupted"),
        (corrupt_drop_manifest, "no manifest"),
        (corrupt_garble_manifest, "unreadable manifest"),
    ],
)
def test_a_bad_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, corrupt, reason):
    save_steps(tmp_path, [10, 20])
    bad_file = corrupt(payload(tmp_path, 20))
    model, opt, sched = build(3)
    with pytest.warns(UserWarning, match=f"skipping bad checkpoint {re.escape(str(bad_file))}.*{reason}"):
        info = load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert info.step == 10
    assert info.extra == {"step": 10}
    assert info.skipped
    assert str(bad_file) in info.skipped[0]


def test_every_checkpoint_bad_starts_from_scratch_with_warnings(tmp_path):
    save_steps(tmp_path, [10, 20])
    corrupt_flip_byte(payload(tmp_path, 10))
    corrupt_truncate(payload(tmp_path, 20))
    model, opt, sched = build(3)
    with pytest.warns(UserWarning, match="no intact checkpoint") as record:
        assert load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched) is None
    messages = [str(w.message) for w in record]
    assert any("step-00000020.common." in m and "truncated" in m for m in messages)
    assert any("step-00000010.common." in m and "corrupted" in m for m in messages)
    assert any("no intact checkpoint" in m for m in messages)
    assert {os.path.basename(w.filename) for w in record} == {"test_checkpoint.py"}  # the caller's line


class _DiskFull(OSError):
    pass


def test_a_failed_write_leaves_no_partial_file_under_a_final_name(tmp_path, monkeypatch):
    from distamp.checkpoint import atomic

    model, opt, sched = save_steps(tmp_path, [10])
    before = {name: (tmp_path / name).read_bytes() for name in files(tmp_path)}
    real_write = atomic._HashingWriter._write_raw
    written = []

    def fail_midway(self, view):
        if sum(written) > 200:
            # Look at the directory while the half-written payload exists.
            written.append(-1)
            visible = files(tmp_path)
            assert [n for n in visible if n.startswith("step-")] == sorted(before), visible
            assert any(n.startswith(".tmp-") for n in visible)
            raise _DiskFull(28, "No space left on device")
        real_write(self, view)
        written.append(view.nbytes)

    monkeypatch.setattr(atomic._HashingWriter, "_write_raw", fail_midway)
    with pytest.raises(RuntimeError, match=r"rank 0 could not save checkpoint 20 .*No space left on device") as info:
        save_checkpoint(tmp_path, 20, model=model, optimizer=opt, scheduler=sched)
    assert isinstance(info.value.__cause__, _DiskFull)
    assert written[-1] == -1
    assert {name: (tmp_path / name).read_bytes() for name in files(tmp_path)} == before  # no leftovers
    monkeypatch.undo()
    model2, opt2, sched2 = build(3)
    assert load_latest_checkpoint(tmp_path, model=model2, optimizer=opt2, scheduler=sched2).step == 10


def test_a_crash_between_payload_and_manifest_is_an_incomplete_checkpoint(tmp_path, monkeypatch):
    """A killed writer runs no clean-up: the directory as it stood at the manifest's rename."""
    model, opt, sched = save_steps(tmp_path, [10])
    crashed = tmp_path / "crashed"
    real_replace = os.replace

    def kill_at_manifest(src, dst):
        if str(dst).endswith(".json"):
            shutil.copytree(tmp_path / "ckpt", crashed)
            raise _DiskFull(28, "No space left on device")
        real_replace(src, dst)

    for name in files(tmp_path):
        os.renames(tmp_path / name, tmp_path / "ckpt" / name)
    monkeypatch.setattr(os, "replace", kill_at_manifest)
    with pytest.raises(RuntimeError, match="could not save checkpoint 20"):
        save_checkpoint(tmp_path / "ckpt", 20, model=model, optimizer=opt, scheduler=sched)
    monkeypatch.undo()
    assert [n for n in layout(crashed) if not n.startswith(".tmp-")] == [
        "step-00000010.common.<hash>.pt", "step-00000010.json", "step-00000020.common.<hash>.pt"
    ]
    with pytest.warns(
        UserWarning, match=r"step-00000020.json: no manifest \(the save did not finish; step-00000020.common"
    ):
        info = load_latest_checkpoint(crashed, model=model, optimizer=opt, scheduler=sched)
    assert info.step == 10


def test_the_payload_loads_with_weights_only(tmp_path):
    save_steps(tmp_path, [5])
    saved = torch.load(payload(tmp_path, 5), weights_only=True)
    assert saved["optimizer"]["format"] == "distamp.AmpOptimizer/1"
    assert set(saved["rng"][0]) >= {"python", "torch", "numpy"}


def test_a_plain_torch_optimizer_and_no_scheduler_work(tmp_path):
    model = make_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, model=model, optimizer=opt)
    model2 = make_net(1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    assert load_latest_checkpoint(tmp_path, model=model2, optimizer=opt2).step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    assert torch.equal(
        opt.state_dict()["state"][0]["momentum_buffer"], opt2.state_dict()["state"][0]["momentum_buffer"]
    )


class _WithChildCalledModule(nn.Module):
    """A user's model whose first layer is an attribute called ``module``, as a wrapper's inner model is."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.module(x)))


def _child_called_module_worker(rank, world_size, directory, compiled):
    from distamp import fleet

    fleet.init()
    out = {}
    for seed in (0, 1):
        model = _WithChildCalledModule(seed)
        opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        wrapped = fleet.distributed_model(model)
        if compiled:
            wrapped = torch.compile(wrapped)
        if seed == 0:
            wrapped(torch.randn(2, 6)).sum().backward()
            opt.step()
            save_checkpoint(directory, 1, model=wrapped, optimizer=opt)
            saved = torch.load(payload(pathlib.Path(directory), 1), weights_only=True)
            out["saved_keys"] = sorted(saved["model"])
        else:
            load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
        out[seed] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_with_a_child_called_module_is_saved_and_restored_whole(tmp_path, compiled):
    """Was: the checkpoint took any ``.module`` for a wrapper's and saved the child alone; the load restored it
    alone, silently."""
    (out,) = run_workers(_child_called_module_worker, 1, str(tmp_path), compiled, timeout=100)
    assert out["saved_keys"] == ["head.bias", "head.weight", "module.bias", "module.weight"]
    assert out[1].keys() == out[0].keys()
    assert all(torch.equal(out[1][k], out[0][k]) for k in out[0])


# --------------------------------------------------------------------------- bad input


class _Halve:
    """A callable LR lambda: LambdaLR puts its __dict__ in state_dict()."""

    def __init__(self) -> None:
        self.factor = np.float64(0.5)

    def __call__(self, epoch: int) -> float:
        return self.factor**epoch


def test_bad_arguments_are_refused_clearly(tmp_path):
    model, opt, _ = build(0)
    kw = {"model": model, "optimizer": opt}
    with pytest.raises(ValueError, match=r"keep=0 must be >= 1"):
        save_checkpoint(tmp_path, 1, keep=0, **kw)
    with pytest.raises(TypeError, match=r"keep must be an int, got bool"):
        save_checkpoint(tmp_path, 1, keep=True, **kw)
    with pytest.raises(ValueError, match=r"step=-1 must be >= 0"):
        save_checkpoint(tmp_path, -1, **kw)
    with pytest.raises(TypeError, match=r"step must be an int, got float \(1.5\)"):
        save_checkpoint(tmp_path, 1.5, **kw)
    with pytest.raises(TypeError, match=r"extra\['pos'\]\[1\] is a ndarray .*weights_only=True.*tolist"):
        save_checkpoint(tmp_path, 1, extra={"pos": [1, np.zeros(2)]}, **kw)
    with pytest.raises(TypeError, match=r"extra\['n'\] is a int64 \(.*Convert it with int\(\.\.\.\)"):
        save_checkpoint(tmp_path, 1, extra={"n": np.int64(3)}, **kw)
    with pytest.raises(TypeError, match=r"extra\['loss'\] is a float64 .*Convert it with float\(\.\.\.\)"):
        save_checkpoint(tmp_path, 1, extra={"loss": np.float64(0.5)}, **kw)
    with pytest.raises(TypeError, match=r"extra\['seen'\] is a defaultdict"):
        save_checkpoint(tmp_path, 1, extra={"seen": collections.defaultdict(int)}, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _Halve())
    # The NumPy factor reaches the optimizer's lr before the scheduler's own state.
    with pytest.raises(
        TypeError, match=r"optimizer.state_dict\(\)\['inner'\]\['param_groups'\]\[0\]\['lr'\] is a float64"
    ):
        save_checkpoint(tmp_path, 1, scheduler=sched, **kw)
    for group in opt.param_groups:
        group["lr"] = float(group["lr"])
    with pytest.raises(TypeError, match=r"scheduler.state_dict\(\)\['[a-z_]+'\]\[0\].* is a float64"):
        save_checkpoint(tmp_path, 1, scheduler=sched, **kw)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer .* got dict"):
        save_checkpoint(tmp_path, 1, model=model, optimizer={})
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got dict"):
        save_checkpoint(tmp_path, 1, model={}, optimizer=opt)
    with pytest.raises(TypeError, match=r"scheduler must have state_dict\(\) and load_state_dict\(\)"):
        save_checkpoint(tmp_path, 1, scheduler=object(), **kw)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"directory='.*file' exists and is not a directory"):
        save_checkpoint(tmp_path / "file", 1, **kw)
    assert files(tmp_path) == ["file"]


def test_loading_into_a_different_setup_names_the_mismatch(tmp_path):
    model, opt, sched = save_steps(tmp_path, [1])
    with pytest.raises(RuntimeError, match=r"has an LR scheduler state but scheduler=None"):
        load_latest_checkpoint(tmp_path, model=model, optimizer=opt)
    plain = torch.optim.AdamW(make_net(0).parameters())
    with pytest.raises(RuntimeError, match=r"optimizer is a AmpOptimizer, this one is a AdamW"):
        load_latest_checkpoint(tmp_path, model=make_net(0), optimizer=plain, scheduler=sched)
    o1 = DistributedStrategy(amp=True, amp_configs={"use_pure_fp16": False})
    other = make_net(0)
    o1_opt = AmpOptimizer(torch.optim.AdamW(other.parameters()), o1)
    o1_sched = torch.optim.lr_scheduler.StepLR(o1_opt, step_size=3)
    with pytest.raises(RuntimeError, match=r"disagree on use_pure_fp16"):
        load_latest_checkpoint(tmp_path, model=other, optimizer=o1_opt, scheduler=o1_sched)


# --------------------------------------------------------------------------- two ranks


def _resume_two_ranks(rank, world_size, directory):
    ref_applied, applied, reference, resumed, info = uninterrupted_and_resumed(
        directory, 10, 6, distributed=True, rank=rank
    )
    return ref_applied, applied, reference, resumed, info


@pytest.mark.timeout(120)
def test_two_ranks_resume_bitwise_identically(tmp_path):
    out = run_workers(_resume_two_ranks, 2, str(tmp_path), timeout=100)
    for ref_applied, applied, reference, resumed, info in out:
        # The inf is injected on rank 0 only; the flag sync skips the step on both.
        assert ref_applied[SKIP_AT] is False
        assert applied == ref_applied
        assert info.step == 6
        assert info.world_size == 2
        assert info.rng_restored
        assert_bitwise_equal(reference, resumed)
        assert_bitwise_equal(resumed, out[0][3])
    assert list_checkpoints(tmp_path) == [6]


def _train_and_save(rank, world_size, directory):
    seed_everything(100 + rank)
    model, opt, sched = build(0, distributed=True)
    train(model, opt, sched, 0, 4, rank=rank)
    save_checkpoint(directory, 4, model=model, optimizer=opt, scheduler=sched, extra={"next_step": 4})
    return snapshot(model, opt, sched)


def _load_and_continue(rank, world_size, directory):
    seed_everything(5 + rank)
    model, opt, sched = build(9, distributed=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        info = load_latest_checkpoint(directory, model=model, optimizer=opt, scheduler=sched)
    loaded = snapshot(model, opt, sched)
    train(model, opt, sched, info.extra["next_step"], info.extra["next_step"] + 2, rank=rank)
    return info, loaded, snapshot(model, opt, sched), [str(w.message) for w in record]


@pytest.mark.timeout(120)
def test_two_ranks_save_one_resumes(tmp_path):
    saved = run_workers(_train_and_save, 2, str(tmp_path), timeout=100)
    assert_bitwise_equal(saved[0], saved[1])
    seed_everything(5)
    model, opt, sched = build(9)
    with pytest.warns(UserWarning, match=r"saved by 2 rank\(s\) and is resumed by 1: .*RNG states are not"):
        info = load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched)
    assert info.world_size == 2
    assert not info.rng_restored
    assert info.extra == {"next_step": 4}
    assert_bitwise_equal(snapshot(model, opt, sched), saved[0])
    train(model, opt, sched, 4, 6)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


@pytest.mark.timeout(120)
def test_one_rank_saves_two_resume_from_the_same_intact_checkpoint(tmp_path):
    seed_everything(100)
    model, opt, sched = build(0)
    train(model, opt, sched, 0, 4)
    save_checkpoint(tmp_path, 4, model=model, optimizer=opt, scheduler=sched, extra={"next_step": 4})
    saved = snapshot(model, opt, sched)
    train(model, opt, sched, 4, 5)
    save_checkpoint(tmp_path, 5, model=model, optimizer=opt, scheduler=sched, extra={"next_step": 5})
    corrupt_flip_byte(payload(tmp_path, 5))

    out = run_workers(_load_and_continue, 2, str(tmp_path), timeout=100)
    for rank, (info, loaded, after, messages) in enumerate(out):
        assert info.step == 4
        assert info.world_size == 1
        assert not info.rng_restored
        assert_bitwise_equal(loaded, saved)
        assert_bitwise_equal(after, out[0][2])  # still in lockstep after two more steps
        assert any("step-00000005.common." in m and "corrupted" in m for m in messages)
        assert any("resumed by 2" in m for m in messages) == (rank == 0)  # warned once


def _load_from_unshared_directories(rank, world_size, base):
    # Rank 1 "lives on another node": its directory holds a different file.
    directory = os.path.join(base, f"node{rank}")
    model, opt, sched = build(0, distributed=True)
    try:
        load_latest_checkpoint(directory, model=model, optimizer=opt, scheduler=sched)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_ranks_that_see_different_files_fail_together_instead_of_hanging(tmp_path):
    save_steps(tmp_path / "node0", [3])
    save_steps(tmp_path / "node1", [1])
    out = run_workers(_load_from_unshared_directories, 2, str(tmp_path), timeout=100)
    for message in out:
        assert message is not None
        assert "rank 1 sees a different file" in message
        assert "shared by every node" in message


@pytest.mark.parametrize("other", [torch.optim.Adam, torch.optim.SGD])
def test_a_checkpoint_of_another_inner_optimizer_is_refused_before_training(tmp_path, other):
    """AdamW's state would load into Adam (then train with AdamW's weight decay as L2) or SGD (then fail at its
    first step on a missing 'momentum'): refused on load, naming both classes."""
    model, opt, sched = build(0)
    train(model, opt, sched, 0, 2)
    save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched)
    net = make_net(1)
    wrong = AmpOptimizer(other(net.parameters(), lr=1e-2), make_strategy())
    wrong_sched = torch.optim.lr_scheduler.StepLR(wrong, step_size=3, gamma=0.5)
    with pytest.raises(RuntimeError, match=rf"an AmpOptimizer around AdamW, this one is around {other.__name__}"):
        load_latest_checkpoint(tmp_path, model=net, optimizer=wrong, scheduler=wrong_sched)


def test_a_checkpoint_of_another_scheduler_class_is_refused_and_its_own_class_loads(tmp_path):
    save_steps(tmp_path, [1])  # a StepLR
    model, opt, _ = build(3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    # torch's load_state_dict would update the CosineAnnealingLR's __dict__ with the StepLR's state, silently.
    with pytest.raises(RuntimeError, match=r"LR scheduler is a StepLR, this one is a CosineAnnealingLR"):
        load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=cosine)
    assert not hasattr(cosine, "step_size")
    model, opt, sched = build(3)
    assert load_latest_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched).step == 1
