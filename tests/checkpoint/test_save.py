"""save_checkpoint: a crash or failure at any point leaves the newest committed checkpoint loadable.

"Crash" is a killed writer: no clean-up runs, so the test looks at copies
of the directory taken before and after every rename and removal. "Fail"
is an exception: the save must remove what it wrote and nothing else.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import warnings

import pytest

from distamp.checkpoint import atomic, load_latest_checkpoint, save_checkpoint, storage
from tests.checkpoint.test_checkpoint import (
    build,
    files,
    layout,
    payload,
    save_steps,
    train,
)


def contents(directory) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in files(directory)}


def load(directory):
    model, opt, sched = build(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a crash copy may hold an unfinished save: warned, then skipped
        return load_latest_checkpoint(directory, model=model, optimizer=opt, scheduler=sched)


def resave_copies(tmp_path, monkeypatch) -> list:
    """Re-save step 10 with new state and keep=1, copying the directory around every change."""
    directory = tmp_path / "ckpt"
    model, opt, sched = build(0)
    save_checkpoint(directory, 10, model=model, optimizer=opt, scheduler=sched, extra={"version": "old"}, keep=1)
    train(model, opt, sched, 0, 1)
    copies = []
    real_replace, real_unlink = os.replace, os.unlink

    def copy():
        copies.append(tmp_path / f"crash-{len(copies)}")
        shutil.copytree(directory, copies[-1])

    def replace(src, dst):
        copy()
        real_replace(src, dst)
        copy()

    def unlink(path):
        copy()
        real_unlink(path)
        copy()

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    save_checkpoint(directory, 10, model=model, optimizer=opt, scheduler=sched, extra={"version": "new"}, keep=1)
    monkeypatch.undo()
    return copies


def test_a_crash_at_any_point_of_resaving_a_step_leaves_it_loadable(tmp_path, monkeypatch):
    copies = resave_copies(tmp_path, monkeypatch)
    assert len(copies) >= 6  # payload rename, manifest rename, old payload removal
    versions = []
    for copy in copies:
        info = load(copy)
        assert info is not None, copy
        assert info.step == 10, copy
        versions.append(info.extra["version"])
    # Old until the manifest's rename commits, new from then on.
    assert versions == sorted(versions, key=["old", "new"].index)
    assert set(versions) == {"old", "new"}


@pytest.mark.parametrize("failing_call", [1, 2], ids=["payload rename", "manifest rename"])
def test_a_resave_that_fails_at_a_rename_leaves_the_previous_checkpoint_as_it_was(tmp_path, monkeypatch, failing_call):
    model, opt, sched = save_steps(tmp_path, [10], keep=1)
    before = contents(tmp_path)
    train(model, opt, sched, 0, 1)
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == failing_call:
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(RuntimeError, match=r"rank 0 could not save checkpoint 10 .*Input/output error"):
        save_checkpoint(tmp_path, 10, model=model, optimizer=opt, scheduler=sched, extra={"step": 11}, keep=1)
    monkeypatch.undo()
    assert contents(tmp_path) == before
    assert load(tmp_path).extra == {"step": 10}


def fail_on_manifest(monkeypatch):
    """Disk full while the manifest is written (after the payload was)."""
    real = atomic._HashingWriter._write_raw

    def write(self, view):
        if self._raw.name.endswith(".json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, view)

    monkeypatch.setattr(atomic._HashingWriter, "_write_raw", write)


def test_a_save_that_fails_writing_the_manifest_removes_its_payload(tmp_path, monkeypatch):
    model, opt, sched = save_steps(tmp_path, [10])
    before = contents(tmp_path)
    fail_on_manifest(monkeypatch)
    with pytest.raises(RuntimeError, match=r"could not save checkpoint 20 .*No space left on device") as raised:
        save_checkpoint(tmp_path, 20, model=model, optimizer=opt, scheduler=sched)
    assert isinstance(raised.value.__cause__, OSError)
    assert raised.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    assert contents(tmp_path) == before  # no orphan payload keeps the disk full
    assert load(tmp_path).step == 10


def test_a_failed_resave_of_unchanged_state_keeps_the_payload_it_shares_with_the_committed_one(tmp_path, monkeypatch):
    model, opt, sched = save_steps(tmp_path, [10], keep=1)
    before = contents(tmp_path)
    fail_on_manifest(monkeypatch)
    written = []
    real_write_payload = storage.write_payload
    monkeypatch.setattr(storage, "write_payload", lambda *a: written.append(real_write_payload(*a)) or written[-1])
    with pytest.raises(RuntimeError, match="No space left on device"):
        save_checkpoint(tmp_path, 10, model=model, optimizer=opt, scheduler=sched, extra={"step": 10}, keep=1)
    monkeypatch.undo()
    assert written[0].name == payload(tmp_path, 10).name  # the same content got the same name
    assert contents(tmp_path) == before
    assert load(tmp_path).step == 10


def test_a_failure_after_the_commit_is_logged_and_the_save_stands(tmp_path, monkeypatch, caplog):
    model, opt, sched = build(0)

    def refuse(*args):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(storage, "rotate", refuse)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        path = save_checkpoint(tmp_path, 10, model=model, optimizer=opt, scheduler=sched)
    assert path == str(payload(tmp_path, 10))
    assert "checkpoint 10 saved, but removing old files" in caplog.text
    assert layout(tmp_path) == ["step-00000010.common.<hash>.pt", "step-00000010.json"]


def _merging(k_steps: int):
    import torch
    from torch import nn

    from distamp.optim import AmpOptimizer
    from distamp.strategy import DistributedStrategy

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    strategy = DistributedStrategy(amp=True, gradient_merge=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    strategy.gradient_merge_configs = {"k_steps": k_steps}
    return model, AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)


def _micro_batch(model, opt) -> bool:
    import torch

    from distamp.amp import auto_cast

    with auto_cast(dtype="bfloat16"):
        loss = model(torch.randn(3, 4)).float().square().mean()
    opt.backward(loss)
    return opt.step()


def test_a_save_inside_a_gradient_merge_window_is_refused_before_writing_and_one_after_it_is_not(tmp_path):
    model, opt = _merging(3)
    _micro_batch(model, opt)
    _micro_batch(model, opt)
    with pytest.raises(ValueError, match=r"^save_checkpoint\(step=1\) inside a gradient-merge window: 2 of its 3 "
                                         r"micro-batches are accumulated in the gradients"):
        save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=opt)
    assert not (tmp_path / "ckpt").exists() or files(tmp_path / "ckpt") == []
    assert _micro_batch(model, opt)  # the window's step
    save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=opt)
    assert files(tmp_path / "ckpt")


def test_loading_a_state_saved_inside_a_window_warns_that_its_gradients_were_not_saved():
    model, opt = _merging(2)
    _micro_batch(model, opt)
    state = opt.state_dict()  # optimizer.state_dict() itself is not refused (logging, EMA code read it)
    _, opt2 = _merging(2)
    with pytest.warns(UserWarning, match=r"saved inside a gradient-merge window \(micro-batch 1 of 2\); the "
                                         r"gradients accumulated before it were not saved"):
        opt2.load_state_dict(state)
