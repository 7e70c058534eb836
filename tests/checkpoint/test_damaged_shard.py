"""A damaged shard of a non-zero rank: every rank skips the checkpoint together and falls back.

Two ranks train O2 BF16 AdamW with sharding stage 2 and save at steps 5,
10 and 15; then rank 1's part of step 15 is corrupted, deleted or
truncated. Only the ranks whose slices overlap rank 1's saved slice read
that file, so rank 0 reading everything else intact is no evidence of an
unshared directory: 2 and 3 ranks resume from step 10 with one warning
naming the file and the rank that found it bad, as does a ``distrun`` job
restarted by ``--max_restarts 1`` after rank 1 damaged its shard and died.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from tests.checkpoint.test_checkpoint import corrupt_flip_byte, corrupt_truncate
from tests.checkpoint.test_sharded_checkpoint import _build, _train
from tests.multiprocess import run_workers
from tests.sharding.test_sharding import _flat

ROOT = Path(__file__).resolve().parents[2]
SAVES = {5: 1, 10: 2, 15: 3}  # checkpoint step: training steps done when it is saved


def _save(rank, world, directory):
    from distamp.checkpoint import save_checkpoint

    model, wrapped, opt, scheduler = _build(2)
    done, params = 0, {}
    for step, steps in SAVES.items():
        _train(rank, world, wrapped, opt, scheduler, done, steps)
        done = steps
        save_checkpoint(directory, step, model=wrapped, optimizer=opt, scheduler=scheduler)
        params[step] = _flat(model)
    return params


def _resume(rank, world, directory):
    from distamp.checkpoint import load_latest_checkpoint

    model, wrapped, opt, scheduler = _build(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt, scheduler=scheduler, timeout=60)
    return info.step, info.skipped, [str(w.message) for w in caught if "skipping" in str(w.message)], _flat(model)


def rank1_shard(directory: Path, step: int) -> Path:
    (path,) = directory.glob(f"step-{step:08d}.rank-00001.*.pt")
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    params = run_workers(_save, 2, str(directory), timeout=100)
    return directory, params[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("damage", "reason"), [
    (corrupt_flip_byte, "does not match the manifest's"),
    (os.remove, "payload missing"),
    (corrupt_truncate, "truncated"),
])
def test_a_damaged_shard_of_rank_1_is_skipped_by_every_rank(saved, tmp_path, world, damage, reason):
    source, params = saved
    directory = tmp_path / "ckpt"
    shutil.copytree(source, directory)
    bad = rank1_shard(directory, 15)
    damage(bad)
    out = run_workers(_resume, world, str(directory), timeout=100)
    for step, skipped, messages, _ in out:
        assert step == 10
        assert len(skipped) == 1
        assert str(bad) in skipped[0]
        assert reason in skipped[0]
        assert len(messages) == 1
        assert str(bad) in messages[0]
    # Only the ranks that read the shard found it bad: rank 1 of 2; ranks 1 and 2 of 3 (their slices overlap it).
    assert "(as rank 1 read it)" in out[0][2][0]
    if world == 2:
        assert torch.equal(out[0][3], params[10])  # same world size and layout: bitwise the step-10 state


JOB = """
    import glob, os, sys, time, warnings
    import torch.distributed as dist
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint
    from tests.checkpoint.test_damaged_shard import SAVES
    from tests.checkpoint.test_sharded_checkpoint import _build, _train

    directory = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, wrapped, opt, scheduler = _build(2)
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("always")
    info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt, scheduler=scheduler, timeout=60)
    if attempt == 0:
        done = 0
        for step, steps in SAVES.items():
            _train(rank, world, wrapped, opt, scheduler, done, steps)
            done = steps
            save_checkpoint(directory, step, model=wrapped, optimizer=opt, scheduler=scheduler)
        if rank == 1:  # rank 1's disk damages its shard of step 15, and rank 1 dies
            (shard,) = glob.glob(os.path.join(directory, "step-00000015.rank-00001.*.pt"))
            with open(shard, "r+b") as f:
                f.truncate(100)
            os._exit(3)
        time.sleep(60)
    print(f"attempt {attempt} rank {rank} resumed at {info.step}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_max_restarts_resumes_from_the_older_checkpoint_after_rank_1_damaged_its_shard(tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DISTAMP"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", "--max_restarts", "1",
         "--tee", "all", "job.py", str(tmp_path / "ckpt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=140, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "[rank0]: attempt 1 rank 0 resumed at 10" in lines, proc.stdout[-3000:]
    assert "[rank1]: attempt 1 rank 1 resumed at 10" in lines, proc.stdout[-3000:]
    for rank in (0, 1):  # the second attempt warned once on each rank
        log = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        assert log.count("skipping bad checkpoint") == 1, log[-3000:]
        assert "step-00000015.rank-00001." in log
        assert "truncated" in log
        assert "(as rank 1 read it)" in log


def _save_stage3(rank, world, directory):
    from distamp.checkpoint import save_checkpoint

    _, wrapped, opt, scheduler = _build(3)
    done = 0
    for step, steps in SAVES.items():
        _train(rank, world, wrapped, opt, scheduler, done, steps)
        done = steps
        save_checkpoint(directory, step, model=wrapped, optimizer=opt, scheduler=scheduler)


def _resume_stage3(rank, world, directory):
    from distamp.checkpoint import load_latest_checkpoint

    _, wrapped, opt, scheduler = _build(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt, scheduler=scheduler, timeout=60)
    return info.step, info.skipped, [str(w.message) for w in caught if "skipping" in str(w.message)]


@pytest.fixture(scope="module")
def saved_stage3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved3")
    run_workers(_save_stage3, 2, str(directory), timeout=100)
    return directory


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("file", "damage", "reason"), [
    ("__1_0.distcp", corrupt_flip_byte, "does not match the manifest's"),
    ("__1_0.distcp", os.remove, "payload missing"),
    (".metadata", corrupt_truncate, "truncated"),
])
def test_a_damaged_dcp_file_of_a_stage3_checkpoint_is_skipped_by_every_rank(saved_stage3, tmp_path, world, file,
                                                                          damage, reason):
    directory = tmp_path / "ckpt"
    shutil.copytree(saved_stage3, directory)
    (dcp_directory,) = directory.glob("step-00000015.dcp-*")
    bad = dcp_directory / file
    damage(bad)
    for step, skipped, messages in run_workers(_resume_stage3, world, str(directory), timeout=100):
        assert step == 10  # every rank falls back together, though only one verified the file
        assert len(skipped) == 1
        assert str(bad) in skipped[0]
        assert reason in skipped[0]
        assert len(messages) == 1
