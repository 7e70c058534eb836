"""A PowerSGD checkpoint resumed across world sizes: 2 -> 1 -> 2 ranks, on real gloo groups.

Each rank's PowerSGD error feedback is its residual of a sum over the
saving ranks; at another world size it has no counterpart and is dropped
with one warning when loaded. What must not happen: the state of the
other world size re-saved as if it were this one's, which made the next
job at the original world size look for a rank part the checkpoint never
had, judge the newest checkpoint damaged and fall back past it (or, with
``keep=1``, start from scratch).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multiprocess import run_workers

pytestmark = pytest.mark.timeout(300)


def _strategy():
    from distamp import fleet

    s = fleet.DistributedStrategy()
    s.amp = True
    s.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True}
    s.powersgd = True
    s.powersgd_configs = {"rank": 2, "start_step": 1}
    return s


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _job(rank, world_size, directory, last_step, keep):
    """Resume from the newest checkpoint, train to ``last_step``, save there; report what happened."""
    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _strategy())
    wrapped = fleet.distributed_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
    start = info.step if info is not None else 0
    for step in range(start + 1, last_step + 1):
        x, y = _batch(rank, step)
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x), y)
        opt.zero_grad()
        opt.backward(loss)
        opt.step()
    save_checkpoint(directory, last_step, model=wrapped, optimizer=opt, keep=keep)
    compressor = opt.policy.compressor
    return {
        "resumed_from": start,
        "warnings": [str(w.message) for w in caught],
        "has_error_feedback": compressor is not None and bool(compressor.error),
        "saved": opt.state_dict().get("powersgd"),
    }


def _parts(directory: str, step: int) -> list[str]:
    with open(os.path.join(directory, f"step-{step:08d}.json")) as f:
        return sorted(entry["part"] for entry in json.load(f)["files"])


@pytest.mark.parametrize("keep", [1, 3])
def test_two_one_two_ranks_resumes_from_the_newest_checkpoint(tmp_path, keep):
    directory = str(tmp_path / "ckpt")
    first = run_workers(_job, 2, directory, 3, keep, timeout=120)
    assert [r["resumed_from"] for r in first] == [0, 0]
    assert _parts(directory, 3) == ["common", "rank-00000", "rank-00001"]

    (one,) = run_workers(_job, 1, directory, 5, keep, timeout=120)
    assert one["resumed_from"] == 3
    dropped = [m for m in one["warnings"] if "PowerSGD error feedback dropped" in m]
    assert len(dropped) == 1, one["warnings"]
    assert "saved by 2 rank(s) and is resumed by 1" in dropped[0]
    assert not any("skipping" in m for m in one["warnings"]), one["warnings"]
    # One rank builds no compressor: the 2-rank state must not be carried on and saved as the 1-rank job's.
    assert one["saved"] is None
    assert _parts(directory, 5) == ["common"]

    again = run_workers(_job, 2, directory, 7, keep, timeout=120)
    for rank, out in enumerate(again):
        assert out["resumed_from"] == 5, (rank, out["warnings"])
        assert not any("skipping" in m or "bad checkpoint" in m for m in out["warnings"]), out["warnings"]
        assert not any("PowerSGD error feedback dropped" in m for m in out["warnings"]), out["warnings"]
        assert out["has_error_feedback"]  # compressing again after the resume, with fresh error feedback
    assert _parts(directory, 7) == ["common", "rank-00000", "rank-00001"]


def _corrupt(directory: str, step: int, part: str) -> str:
    """Flip one byte in the middle of checkpoint ``step``'s payload ``part``; returns its name."""
    (name,) = [n for n in os.listdir(directory) if n.startswith(f"step-{step:08d}.{part}.")]
    with open(os.path.join(directory, name), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


def test_a_damaged_newest_checkpoint_falls_back_naming_the_step_and_why(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_workers(_job, 2, directory, 3, 3, timeout=120)
    run_workers(_job, 1, directory, 5, 3, timeout=120)
    bad = _corrupt(directory, 5, "common")
    out = run_workers(_job, 2, directory, 7, 3, timeout=120)
    for result in out:
        assert result["resumed_from"] == 3
        skipped = [m for m in result["warnings"] if "skipping bad checkpoint" in m]
        assert len(skipped) == 1, result["warnings"]
        assert bad in skipped[0]
        assert "(corrupted)" in skipped[0]
        assert "step 5 is not resumed" in skipped[0]


def _legacy_one_rank_job(rank, world_size, directory):
    """What a 1-rank job saved before the fix: the 2-rank PowerSGD state it loaded, carried on unchanged."""
    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _strategy())
    wrapped = fleet.distributed_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
    (name,) = [n for n in os.listdir(directory) if n.startswith("step-00000003.rank-00000.")]
    carried = torch.load(os.path.join(directory, name), weights_only=True)["optimizer_shard"]["powersgd"]
    assert carried["world_size"] == 2
    opt._pending_compressor_state = carried  # as the old code kept it
    save_checkpoint(directory, 5, model=wrapped, optimizer=opt, keep=3)


def test_a_checkpoint_carrying_another_world_sizes_state_loads_without_fallback(tmp_path):
    # Checkpoints written before the fix hold, in a 1-rank job's manifest, a 2-rank PowerSGD marker: the
    # 2-rank reader must take rank 0's part (the only one) and drop the stale error feedback, not skip.
    directory = str(tmp_path / "ckpt")
    run_workers(_job, 2, directory, 3, 3, timeout=120)
    run_workers(_legacy_one_rank_job, 1, directory, timeout=120)
    assert _parts(directory, 5) == ["common", "rank-00000"]
    out = run_workers(_job, 2, directory, 7, 3, timeout=120)
    for rank, result in enumerate(out):
        assert result["resumed_from"] == 5, result["warnings"]
        assert not any("skipping" in m for m in result["warnings"]), result["warnings"]
        dropped = [m for m in result["warnings"] if "PowerSGD error feedback dropped" in m]
        assert len(dropped) == (1 if rank == 0 else 0), result["warnings"]


def _load_worker(rank, world_size, directory):
    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint

    fleet.init()
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 4))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _strategy())
    wrapped = fleet.distributed_model(model)
    try:
        load_latest_checkpoint(directory, model=wrapped, optimizer=opt)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_an_intact_manifest_missing_a_part_raises_instead_of_falling_back(tmp_path):
    from distamp.checkpoint.manifest import Manifest

    directory = str(tmp_path / "ckpt")
    run_workers(_job, 2, directory, 3, 3, timeout=120)
    run_workers(_job, 2, directory, 5, 3, timeout=120)
    path = os.path.join(directory, "step-00000005.json")
    with open(path, "rb") as f:
        manifest = Manifest.from_bytes(f.read(), path)
    kept = tuple(f for f in manifest.files if f.part != "rank-00001")
    with open(path, "wb") as f:  # consistent checksum: not damage, a manifest written without the part
        f.write(Manifest(manifest.step, manifest.world_size, kept).to_bytes())
    errors = run_workers(_load_worker, 2, directory, timeout=120)
    assert errors[0] == errors[1]
    assert "lists no rank-00001 part" in errors[0]
    assert "(step 5, saved by 2 rank(s))" in errors[0]
    assert "not damaged" in errors[0]
