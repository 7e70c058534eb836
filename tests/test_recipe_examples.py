"""The converted PyTorch DDP tutorial and the small GPT example run under distrun and do what they say."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # long multi-process runs (setup.cfg)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIAL = os.path.join(ROOT, "examples", "ddp_tutorial.py")


def _distrun(tmp_path, *args: str) -> str:
    cmd = [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", TUTORIAL, *args,
           "--batch_size", "128"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(200)
def test_tutorial_trains_snapshots_fp32_and_resumes(tmp_path):
    precision = ["--dtype", "bfloat16", "--pure_fp16"]  # O2: the model is 16-bit, the snapshot is not
    first = _distrun(tmp_path, "2", "1", *precision)
    assert "[rank0]: Epoch 1 | Training snapshot saved" in first
    snapshot = torch.load(tmp_path / "runs" / "tutorial" / "o2-bfloat16" / "snapshot.pt", weights_only=True)
    assert snapshot["EPOCHS_RUN"] == 2
    assert {k: v.dtype for k, v in snapshot["MODEL_STATE"].items()} == {"weight": torch.float32, "bias": torch.float32}
    resumed = _distrun(tmp_path, "3", "1", *precision)
    assert "Resuming training from snapshot at epoch 2" in resumed
    assert "Epoch 0 |" not in resumed
    assert "[rank0]: [GPUcpu] Epoch 2 |" in resumed


@pytest.mark.timeout(300)
def test_the_two_tutorial_commands_run_one_after_the_other_and_each_resumes(tmp_path):
    # examples/README's two commands, with and without --pure_fp16: they shared one snapshot, and the second
    # failed with "checkpoint and optimizer disagree on use_pure_fp16".
    o2 = ["--pure_fp16", "--dtype", "bfloat16"]
    assert "Resuming" not in _distrun(tmp_path, "2", "1")
    assert "Resuming" not in _distrun(tmp_path, "2", "1", *o2)
    assert "Resuming training from snapshot at epoch 2" in _distrun(tmp_path, "3", "1")
    assert "Resuming training from snapshot at epoch 2" in _distrun(tmp_path, "3", "1", *o2)


@pytest.mark.timeout(120)
def test_gpt_example_learns_with_schedule_clipping_and_merge(tmp_path):
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    cmd = [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", script,
           "--steps", "40", "--merge", "2", "--warmup", "5"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    summary = dict(item.split("=") for line in done.stdout.splitlines() if line.startswith("[rank0]: final_loss")
                   for item in line.removeprefix("[rank0]: ").split())
    assert float(summary["final_loss"]) < float(summary["uniform"]) - 0.5  # it learns
    applied = [line for line in done.stdout.splitlines() if "steps_applied=" in line]
    assert len(applied) == 1
    assert "steps_applied=40 steps_skipped=0" in applied[0]


def _gpt_final_loss(tmp_path, *args: str) -> float:
    script = os.path.join(ROOT, "examples", "train_gpt.py")
    cmd = [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", script, *args]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    line = next(line for line in done.stdout.splitlines() if line.startswith("[rank0]: final_loss"))
    return float(line.removeprefix("[rank0]: ").split()[0].split("=")[1])


@pytest.mark.timeout(330)
def test_gpt_example_fp16_o2_stage3_ends_within_2_percent_of_unsharded(tmp_path):
    args = ("--dtype", "float16", "--steps", "40", "--merge", "2", "--warmup", "5")
    unsharded = _gpt_final_loss(tmp_path, *args)
    sharded = _gpt_final_loss(tmp_path, *args, "--sharding_stage", "3")
    assert abs(sharded - unsharded) <= 0.02 * unsharded, (sharded, unsharded)


@pytest.mark.timeout(150)
def test_nanogpt_style_loop_does_what_the_readme_table_says(tmp_path):
    """README, 'Adding distamp to existing data-parallel code': ctx built once, require_backward_grad_sync, norms."""
    script = os.path.join(ROOT, "examples", "nanogpt_style.py")
    cmd = [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2", script, "--steps", "6"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=140, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout + done.stderr
    assert "'custom_black_varnames': ['transformer.h.*.ln_1', 'transformer.h.*.ln_2', 'transformer.ln_f']" in out
    assert "no autocast region" not in out
    assert "gradient all-reduce calls per optimizer step: [1]" in out  # one bucket, once per 2 micro-steps
    assert ("model.state_dict()['transformer.h.0.attn.weight']: torch.bfloat16; "
            "optimizer.fp32_state_dict(model)['transformer.h.0.attn.weight']: torch.float32") in out
    assert "custom LayerNorm parameters: ['torch.bfloat16']" in out  # as the warning says
