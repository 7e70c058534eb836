"""The examples run end to end on two real ranks under distrun; tiny configurations, no timings checked."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)

import bench_modes
import bench_replica_check
import benchmark
import netns
from train_digits import DigitsNet


def distrun(tmp_path, script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``distrun --nproc_per_node 2 examples/<script> args`` in ``tmp_path``; fails the test on error."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "distamp.launcher", "--nproc_per_node", "2",
           os.path.join(EXAMPLES, script), *args]
    try:
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        logs = sorted((tmp_path / "log").glob("workerlog.*"))
        tails = "".join(f"\n--- {log.name} (last 30 lines):\n" + "\n".join(log.read_text().splitlines()[-30:])
                        for log in logs)
        pytest.fail(f"{script} did not finish in {timeout} s (a hang, or a host far slower than CI's){tails}")
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


# The limits only catch a hang: the job takes ~20 s alone, and twice (2026-11-27 and -28) over 50 s on
# torch 2.15.0's CUDA build (slower imports) with the other pytest-xdist worker busy.
@pytest.mark.slow
@pytest.mark.timeout(170)
def test_train_digits_writes_consistent_outputs(tmp_path):
    done = distrun(tmp_path, "train_digits.py", "--max_steps", "6", "--pure_fp16", "--no_progress",
                   "--out_dir", "out", "--save_params", "params.pt", timeout=150)

    accuracy = re.findall(r"test_accuracy=(\d\.\d{4})$", done.stdout, re.MULTILINE)
    assert len(accuracy) == 1, done.stdout  # rank 0 only
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert history["precision"] == "float16-O2"
    assert history["world_size"] == 2
    assert f"{history['test_accuracy']:.4f}" == accuracy[0]
    assert history["step"] == [1, 2, 3, 4, 5, 6]
    assert len(history["loss"]) == len(history["loss_scale"]) == len(history["skipped"]) == 6
    assert len(history["grad_norm"]) == len(history["overflows"]) == 6  # optimizer.stats() telemetry
    assert history["overflows"][-1] == history["skipped_steps"]
    assert history["skipped_steps"] == sum(history["skipped"])
    assert all(s >= 1.0 for s in history["loss_scale"])
    assert history["loss_scale"][0] <= 32768.0
    assert (tmp_path / "out" / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert params.keys() == DigitsNet().state_dict().keys()
    assert params["classifier.3.weight"].dtype == torch.float16  # O2 keeps 16-bit model weights


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_train_digits_log_lines_are_not_glued_onto_the_progress_bar(tmp_path):
    # A scale of 2**24 overflows FP16 at once: the first steps are skipped and logged while the bar runs.
    distrun(tmp_path, "train_digits.py", "--max_steps", "3", "--init_loss_scaling", str(2.0**24),
            "--out_dir", "out", timeout=150)
    log = (tmp_path / "log" / "workerlog.0").read_text()
    assert "3/3" in log  # the bar ran
    skipped = re.findall(r"(.)WARNING distamp: step \d+ skipped", log, re.DOTALL)
    assert skipped, log
    # Each starts a line of its own (after tqdm.write cleared the bar), never right after the bar's text.
    assert set(skipped) <= {"\n", "\r"}, log


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_benchmark_smoke_counts_half_the_bytes(tmp_path):
    # 23 s alone, 33 s beside another test; one CI run went past 70 s.
    modes = "fp32,torch_bf16,distamp_o2_bf16"
    done = distrun(tmp_path, "benchmark.py", "--model", "shallow", "--batch", "4", "--modes", modes,
                   "--reps", "2", "--steps", "1", "--warmup", "1", "--probe_steps", "1",
                   "--json", "bench.json", timeout=130)

    assert "| mode | step ms (median) |" in done.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert list(result["modes"]) == modes.split(",")
    n = sum(p.numel() for p in bench_modes.FAMILIES["shallow"].build(0).parameters())
    rows = result["modes"]
    assert rows["fp32"]["wire_bytes_per_step"] == 4 * n
    assert rows["torch_bf16"]["wire_bytes_per_step"] == 2 * n
    # distamp: 16-bit gradients plus its small found-inf flag all-reduce.
    assert 2 * n <= rows["distamp_o2_bf16"]["wire_bytes_per_step"] <= 2 * n + 64
    for row in rows.values():
        assert row["samples"] == 2
        assert row["median_s"] > 0
        assert row["iqr_s"] >= 0
        assert len(row["peak_bytes_per_rank"]) == 2
    assert rows["fp32"]["vs_fp32"] == 1.0
    assert rows["distamp_o2_bf16"]["vs_torch_native"] == pytest.approx(
        rows["distamp_o2_bf16"]["median_s"] / rows["torch_bf16"]["median_s"])


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", ["shallow", "cnn"])  # cnn: BatchNorm, an FP32 unit on both sides
def test_benchmark_stage3_sends_what_torch_fsdp2_sends_plus_the_verdict(tmp_path, model):
    modes = "torch_bf16_fsdp2,distamp_o2_bf16_stage3"
    distrun(tmp_path, "benchmark.py", "--model", model, "--batch", "4", "--modes", modes,
            "--reps", "2", "--steps", "1", "--warmup", "1", "--probe_steps", "1", "--json", "bench.json", timeout=130)

    rows = json.loads((tmp_path / "bench.json").read_text())["modes"]
    torch_bytes = rows["torch_bf16_fsdp2"]["wire_bytes_per_step"]
    assert torch_bytes > 0
    # The same BF16 all-gathers and reduce-scatters, plus distamp's found-inf flag all-reduce, plus rank 0's
    # buffers before the forward (DDP's broadcast_buffers, which FSDP2 does not do): half of them leave a rank.
    ours = rows["distamp_o2_bf16_stage3"]
    buffer_bytes = sum(b.numel() * b.element_size() for b in bench_modes.FAMILIES[model].build(0).buffers())
    assert (buffer_bytes > 0) == (model == "cnn")
    assert torch_bytes < ours["wire_bytes_per_step"] - buffer_bytes / 2 <= torch_bytes + 64
    for row in rows.values():
        assert sum(row["wire_bytes_by_collective_per_step"].values()) == row["wire_bytes_per_step"]
    assert rows["distamp_o2_bf16_stage3"]["vs_torch_native"] == pytest.approx(
        rows["distamp_o2_bf16_stage3"]["median_s"] / rows["torch_bf16_fsdp2"]["median_s"])


BF16_MODES = "fp32,torch_bf16,distamp_o1_bf16,distamp_o2_bf16"
SMOKE = ("--reps", "1", "--steps", "1", "--warmup", "1", "--probe_steps", "1")


def run_one_process(tmp_path, *args: str, timeout: float) -> tuple[str, dict]:
    """``python examples/benchmark.py args`` (a one-process world); its stdout and JSON results."""
    cmd = [sys.executable, os.path.join(EXAMPLES, "benchmark.py"), *args, "--json", "bench.json"]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"benchmark.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout, json.loads((tmp_path / "bench.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_benchmark_cnn_in_one_process(tmp_path):
    out, result = run_one_process(tmp_path, "--model", "cnn", "--batch", "2", "--image_size", "16", "--threads", "1",
                                  "--modes", BF16_MODES, *SMOKE, timeout=100)

    cfg, rows = result["config"], result["modes"]
    family = bench_modes.family("cnn", image_size=16)
    assert (cfg["world_size"], cfg["model"], cfg["batch_per_rank"], cfg["compile"]) == (1, "cnn", 2, False)
    assert cfg["family"] == family.describe()
    assert cfg["sizes"]["image_size"] == 16
    assert f"({family.describe()};" in out
    assert "batch 2 per rank, eager, 1 ranks" in out
    assert "| peak bytes/param | peak x FP32 | peak x torch-native |" in out
    assert list(rows) == BF16_MODES.split(",")
    n_params = sum(p.numel() for p in family.build(0).parameters())
    assert cfg["parameters"] == n_params
    for mode, row in rows.items():
        assert row["peak_bytes_per_param"] == pytest.approx(max(row["peak_bytes_per_rank"]) / n_params), mode
        assert f"| {row['peak_bytes_per_param']:.2f} |" in out, mode
    for mode, row in rows.items():
        # One process: no DDP on either side, so nothing at all goes through a collective.
        assert row["wire_bytes_per_step"] == 0, mode
        assert row["collective_calls_per_step"] == {}, mode
        assert row["last_loss"] == pytest.approx(rows["fp32"]["last_loss"], rel=0.02), mode
    for mode in ("distamp_o1_bf16", "distamp_o2_bf16"):
        assert rows[mode]["peak_vs_torch_native"] == pytest.approx(
            max(rows[mode]["peak_bytes_per_rank"]) / max(rows["torch_bf16"]["peak_bytes_per_rank"]))
    assert "peak_vs_torch_native" not in rows["fp32"]


@pytest.mark.timeout(60)
def test_benchmark_tiny_gpt_in_one_process(tmp_path):
    # No probes here (each is a fresh process, ~4 s): the CNN test covers them in one process.
    out, result = run_one_process(tmp_path, "--model", "tiny_gpt", "--threads", "1", "--modes", BF16_MODES,
                                  "--reps", "1", "--steps", "1", "--warmup", "1", "--probe_steps", "0", timeout=50)

    cfg, rows = result["config"], result["modes"]
    family = bench_modes.FAMILIES["tiny_gpt"]
    assert (cfg["world_size"], cfg["batch_per_rank"], cfg["threads_per_rank"]) == (1, family.default_batch, 1)
    assert cfg["family"] == family.describe()
    assert "eager, 1 ranks" in out
    assert list(rows) == BF16_MODES.split(",")
    for mode, row in rows.items():
        assert row["last_loss"] == pytest.approx(rows["fp32"]["last_loss"], rel=0.02), mode
    assert rows["distamp_o1_bf16"]["vs_torch_native"] == pytest.approx(
        rows["distamp_o1_bf16"]["median_s"] / rows["torch_bf16"]["median_s"])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_benchmark_compiled_runners_are_reused_without_recompiling(tmp_path):
    # The MLP with the fewest ops compiles fastest; one torch-native and one distamp mode, and no
    # probes (each would compile again in its own process). Two repetitions: the second reuses the
    # compiled runners, and benchmark.py fails if a timed step compiled.
    modes = "torch_bf16,distamp_o2_bf16"
    out, result = run_one_process(tmp_path, "--model", "shallow", "--batch", "2", "--threads", "1", "--compile",
                                  "--modes", modes, "--reps", "2", "--steps", "1", "--warmup", "1",
                                  "--probe_steps", "0", timeout=130)

    assert result["config"]["compile"] is True
    assert "torch.compile, 1 ranks" in out
    rows = result["modes"]
    assert list(rows) == modes.split(",")
    assert all(row["samples"] == 2 for row in rows.values())
    assert rows["distamp_o2_bf16"]["last_loss"] == pytest.approx(rows["torch_bf16"]["last_loss"], rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_benchmark_gpt_on_two_ranks_counts_tied_weights_once(tmp_path):
    sizes = {"d_model": 32, "layers": 1, "heads": 2, "vocab": 64, "seq_len": 16}
    modes = "torch_bf16,distamp_o2_bf16"
    args = [a for k, v in sizes.items() for a in (f"--{k}", str(v))]
    done = distrun(tmp_path, "benchmark.py", "--model", "gpt", *args, "--batch", "2", "--modes", modes,
                   *SMOKE, "--json", "bench.json", timeout=100)

    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["config"]["world_size"] == 2
    assert result["config"]["sizes"] == {**sizes}
    assert "2 ranks" in done.stdout
    # The output head shares the token embedding's weight: DDP and distamp send it once.
    n = sum(p.numel() for p in bench_modes.family("gpt", **sizes).build(0).parameters())
    assert result["config"]["parameters"] == n
    rows = result["modes"]
    assert rows["torch_bf16"]["wire_bytes_per_step"] == 2 * n
    assert 2 * n <= rows["distamp_o2_bf16"]["wire_bytes_per_step"] <= 2 * n + 64
    assert all(len(row["peak_bytes_per_rank"]) == 2 for row in rows.values())


def test_batch_and_sizes_default_to_the_family():
    assert benchmark.parse_args([]).batch == 64
    assert benchmark.parse_args(["--model", "cnn"]).batch == 32
    assert benchmark.parse_args(["--model", "gpt", "--batch", "3"]).batch == 3
    args = benchmark.parse_args(["--model", "tiny_gpt", "--layers", "2"])
    assert (args.family.layers, args.family.d_model, args.batch) == (2, 32, 2)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "cnn", "--d_model", "64"], "does not take the sizes ['d_model']"),
    (["--model", "gpt", "--d_model", "30"], "d_model=30 must be a multiple of heads=4"),
    (["--model", "mlp", "--image_size", "32"], "it has none to override"),
])
def test_bad_sizes_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "2"], "--steps must be at least 3"),
    (["--reps", "0"], "--reps must be at least 1"),
])
def test_bench_replica_check_refuses_what_it_cannot_take_a_median_of(argv, message, capsys):
    # --steps 2 used to train, time nothing and die in statistics.median([]) after the process group existed
    with pytest.raises(SystemExit) as exit_info:
        bench_replica_check.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert bench_replica_check.parse_args(["--steps", "3", "--reps", "1"]).steps == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for gloo (CPU) runs")
def test_torch_powersgd_on_gloo_needs_one_bucket_for_the_whole_model(capsys):
    # torch's powerSGD_hook waits inside future callbacks: with two buckets on gloo it can hang for good.
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--modes", "torch_bf16_powersgd"])
    assert "pass --bucket_mb 26 or more (got 25.0)" in capsys.readouterr().err
    assert benchmark.parse_args(["--modes", "torch_bf16_powersgd", "--bucket_mb", "26"]).bucket_mb == 26
    assert benchmark.parse_args(["--model", "cnn", "--modes", "torch_bf16_powersgd"]).bucket_mb == 25  # 1.3 MB


def test_link_mode_without_root_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("RANK", raising=False)
    assert benchmark.main(["--link_gbit", "1"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_link_mode_under_a_launcher_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(benchmark._NETNS_ENV, raising=False)
    assert benchmark.main(["--link_gbit", "1"]) == 2
    assert "not under distrun" in capsys.readouterr().err


def _leftover_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("damp")]


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc`` (started in its own session) and everything in its process group.

    SIGTERM first: benchmark.py then stops its ranks and removes its
    namespaces itself. Then SIGKILL for the group: the ranks share it
    (``ip netns exec`` and ``unshare`` exec their command).
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def link_runs():
    """Register orchestrator processes; whatever happens to the test (a failure, a
    pytest-timeout), each is stopped with its ranks and its namespaces removed."""
    started: list[subprocess.Popen] = []
    yield started.append
    for proc in started:
        _stop_group(proc)
        netns.LinkedNamespaces.remove_leftovers(proc.pid)


# Two ranks importing torch in namespaces plus probe processes: over a minute
# when other tests load the machine.
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(netns.why_unavailable() is not None, reason=str(netns.why_unavailable()))
def test_link_mode_runs_one_rank_per_namespace_and_cleans_up(tmp_path, link_runs):
    cmd = [sys.executable, os.path.join(EXAMPLES, "benchmark.py"), "--link_gbit", "1", "--model", "shallow",
           "--batch", "4", "--modes", "fp32,torch_bf16", "--reps", "1", "--steps", "1", "--warmup", "1",
           "--probe_steps", "1", "--json", str(tmp_path / "link.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    link_runs(proc)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"benchmark.py --link_gbit did not finish in 240 s:\n{out}\n{err}")
    assert proc.returncode == 0, out + err
    result = json.loads((tmp_path / "link.json").read_text())
    assert result["config"]["link_gbit"] == 1.0
    assert result["config"]["world_size"] == 2
    assert "1 Gbit/s link" in out
    # Its namespaces are named after its pid; other tests may create their
    # own meanwhile, so look only for these.
    own = set(netns.LinkedNamespaces.names_for(proc.pid))
    assert not own & set(_leftover_namespaces())
    assert not [name for name in own if os.path.exists(f"/etc/netns/{name}")]


def test_namespaces_are_removed_when_setup_fails(monkeypatch):
    if netns.why_unavailable() is not None or shutil.which("ip") is None:
        pytest.skip(str(netns.why_unavailable()))
    link = netns.LinkedNamespaces(1.0)
    real_run = netns._run

    def fail_on_tc(*cmd):
        if cmd[0] == "tc":
            raise RuntimeError("injected tc failure")
        real_run(*cmd)

    monkeypatch.setattr(netns, "_run", fail_on_tc)
    with pytest.raises(RuntimeError, match="injected"), link:
        pass
    assert not [n for n in _leftover_namespaces() if n in link.names]
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in link.names)
