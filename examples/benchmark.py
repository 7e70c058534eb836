"""distamp against torch-native mixed precision, side by side, in one run.

Loopback, two ranks (``torchrun --nproc_per_node 2`` works the same way)::

    distrun --nproc_per_node 2 examples/benchmark.py                 # 6.6M MLP, batch 64
    distrun --nproc_per_node 2 examples/benchmark.py --model deep    # many small layers
    distrun --nproc_per_node 2 examples/benchmark.py --model cnn     # conv-BN-ReLU, batch 32
    distrun --nproc_per_node 2 examples/benchmark.py --model gpt --compile

One process (no launcher): neither side uses DDP, since distamp calls the
model directly in a one-process world::

    python examples/benchmark.py --model tiny_gpt --threads 1        # per-op overhead

Two "hosts" joined by a 1 Gbit/s link (root; one rank per network namespace)::

    sudo python examples/benchmark.py --link_gbit 1

Repetitions interleave the modes (in a rotated order), so machine drift
lands on every mode alike. Per mode it reports the median and interquartile
range of the step time (each step's time is the slowest rank's), the ratio
to FP32 DDP and to the torch-native counterpart, the bytes each rank sends
per step (see ``bench_modes.WireCounter``), and the peak tensor memory per rank (also in bytes per
parameter, and as ratios to FP32 and to the torch-native counterpart). Bytes and memory come
from a probe run in a fresh process per mode and rank, so one mode's
allocations cannot inflate another's: it counts every ``ProcessGroup``
collective (see ``bench_modes.WireCounter``) and takes the peak of live
tensor bytes from model construction to the last step
(``torch.cuda.max_memory_allocated`` on CUDA; on CPU, the allocation and
free events recorded by ``torch.profiler`` with ``profile_memory``).

With ``--compile`` every mode's model goes through ``torch.compile``. Each
mode's runner is then built once, stepped through its compilation before
anything is timed (the same number of steps in every mode), and kept for
all repetitions (see :func:`time_modes`); a timed step that compiles anyway
fails the run. A probe compiles in its own process before it counts bytes;
compilation traces with fake tensors, so it adds nothing to the peak.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_modes
import bench_report
import netns

_NETNS_ENV = "DISTAMP_BENCH_IN_NETNS"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; ``--help`` lists every option."""
    families = "\n".join(f"  {name:<9} {fam.describe()}; batch {fam.default_batch}"
                         for name, fam in bench_modes.FAMILIES.items())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=f"model families (--model), with their default batch:\n{families}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to compare")
    what.add_argument("--model", choices=list(bench_modes.FAMILIES), default="mlp",
                      help="model family, listed below (default: %(default)s)")
    what.add_argument("--batch", type=int, default=None, help="per rank (default: the family's, below)")
    what.add_argument("--modes", default=",".join(bench_modes.DEFAULT_MODES),
                      help=f"comma-separated, from {','.join(bench_modes.MODES)} (default: %(default)s)")
    what.add_argument("--lr", type=float, default=0.01, help="default: %(default)s")
    what.add_argument("--bucket_mb", type=float, default=25.0,
                      help="bucket size for every mode (fuse_grad_size_in_MB; at the default, distamp's "
                           "sharding stages 1-2 size theirs from the model) (default: %(default)s)")
    what.add_argument("--powersgd_rank", type=int, default=4,
                      help="rank of the *_powersgd modes (default: %(default)s)")
    what.add_argument("--powersgd_start", type=int, default=2,
                      help="steps of plain all-reduce before the *_powersgd modes compress; keep it below "
                      "--warmup so timed steps compress (default: %(default)s)")
    what.add_argument("--compile", action="store_true",
                      help="torch.compile every mode's model (compilation stays out of the timed steps)")
    sizes = p.add_argument_group("model sizes (default: the family's; each applies to the families it names)")
    for size in _size_names():
        takers = ", ".join(f"{name} {getattr(fam, size)}" for name, fam in bench_modes.FAMILIES.items()
                           if size in fam.SIZES)
        sizes.add_argument(f"--{size}", type=int, default=None, help=f"default: {takers}")
    how = p.add_argument_group("how long")
    how.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default: %(default)s)")
    how.add_argument("--steps", type=int, default=10, help="timed steps per mode and repetition (default: %(default)s)")
    how.add_argument("--warmup", type=int, default=3, help="untimed steps after each rebuild (default: %(default)s)")
    how.add_argument("--probe_steps", type=int, default=3,
                     help="steps in each memory/bytes probe; 0 skips the probes (default: %(default)s)")
    how.add_argument("--probe_timeout", type=float, default=300.0,
                     help="seconds before a probe counts as hung (default: %(default)s)")
    where = p.add_argument_group("where")
    where.add_argument("--link_gbit", type=float, default=None,
                       help="run one rank in each of two network namespaces joined by a link of this rate (root)")
    where.add_argument("--threads", type=int, default=None,
                       help="torch threads per rank (default: CPUs divided by the ranks on this box)")
    where.add_argument("--json", default=os.path.join("runs", "benchmark.json"),
                       help="where rank 0 writes the results (default: %(default)s)")
    p.add_argument("--_probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in bench_modes.MODES]
    if bad or not args.mode_list:
        p.error(f"--modes: unknown {bad!r}; choose from {','.join(bench_modes.MODES)}")
    given = {name: getattr(args, name) for name in _size_names() if getattr(args, name) is not None}
    try:
        args.family = bench_modes.family(args.model, **given)
    except ValueError as exc:
        p.error(f"--model {args.model} with {' '.join(f'--{k} {v}' for k, v in given.items())}: {exc}")
    if args.batch is None:
        args.batch = args.family.default_batch
    for name, low in (("batch", 1), ("reps", 1), ("steps", 1), ("warmup", 1), ("probe_steps", 0),
                      ("powersgd_rank", 1), ("powersgd_start", 2)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)!r}")
    if args.link_gbit is not None and not args.link_gbit > 0:
        p.error(f"--link_gbit must be > 0, got {args.link_gbit!r}")
    if "torch_bf16_powersgd" in args.mode_list and not torch.cuda.is_available():
        # torch's powerSGD_hook waits on its P and Q all-reduces inside future callbacks; on gloo two
        # buckets' callbacks can hold both of its worker threads, each waiting for a collective the
        # other holds up: the run hangs for good (seen with the default 25 MB on the 6.56M MLP).
        grad_mb = sum(param.numel() for param in args.family.build(0).parameters()) * 4 / 2**20
        if args.bucket_mb < grad_mb:
            p.error(f"--modes torch_bf16_powersgd on gloo needs one DDP bucket for the whole model: torch's "
                    f"powerSGD_hook can hang with two; this model's FP32 gradient is {grad_mb:.1f} MB, so pass "
                    f"--bucket_mb {math.ceil(grad_mb)} or more (got {args.bucket_mb})")
    return args


def _size_names() -> list[str]:
    """Every family's overridable sizes, each once, in order of appearance."""
    return list(dict.fromkeys(size for fam in bench_modes.FAMILIES.values() for size in fam.SIZES))


# ----------------------------------------------------------------------------- process set-up

def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init(args: argparse.Namespace) -> torch.device:
    """Join the group the launcher described (a one-process world when run bare)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.compile:
        # Past the limit dynamo would quietly run a frame eagerly: an error is better than such a table.
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if any(m.startswith("distamp_") for m in args.mode_list):
        from distamp import fleet

        fleet.init(is_collective=True)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own shard, every mode the same
    return args.family.make_batch(args.batch, g, device)


def _runner(args: argparse.Namespace, mode: str, device: torch.device) -> bench_modes.Runner:
    return bench_modes.build_runner(mode, args.family, device, lr=args.lr, bucket_mb=args.bucket_mb,
                                    compiled=args.compile, powersgd_rank=args.powersgd_rank,
                                    powersgd_start=args.powersgd_start)


# ----------------------------------------------------------------------------- compilation

# Steps that may compile: the first traces the model; distamp's wrapper prepares the model at
# its first forward (builds DDP when there are ranks to reduce with), and dynamo compiles the
# wrapper's forward again once that has happened.
_COMPILE_STEPS = 2


def _compiled_frames() -> int:
    """Frames dynamo has tried to compile in this process: each cache miss counts one."""
    return torch._dynamo.utils.counters["frames"]["total"]


def compile_runner(args: argparse.Namespace, mode: str, device: torch.device,
                   x: torch.Tensor, y: torch.Tensor) -> bench_modes.Runner:
    """A runner of ``mode`` stepped through its compilation (the same steps for every mode)."""
    runner = _runner(args, mode, device)
    runner.select()
    for _ in range(_COMPILE_STEPS):
        runner.step(x, y)
    return runner


# ----------------------------------------------------------------------------- timing

def time_modes(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per mode, every timed step's duration (slowest rank) and the last loss seen.

    Without ``--compile`` every repetition rebuilds each mode's runner. With
    it, each mode's runner is built and compiled once and kept for every
    repetition: with several ranks a rebuilt distamp wrapper is compiled
    again (dynamo guards its forward on per-instance state), which would
    soon reach dynamo's recompile limit (an error here, see ``_init``).

    Raises:
        RuntimeError: with ``--compile``, a timed step compiled on some rank.
    """
    x, y = _batch(args, device)
    modes = args.mode_list
    kept = {mode: compile_runner(args, mode, device, x, y) for mode in modes} if args.compile else {}
    local: dict[str, list[float]] = {m: [] for m in modes}
    compiled_in_timing = dict.fromkeys(modes, 0)
    last_loss: dict[str, float] = {}
    for rep in range(args.reps):
        shift = rep % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            runner = kept[mode] if args.compile else _runner(args, mode, device)
            runner.select()
            for _ in range(args.warmup):
                runner.step(x, y)
            _sync(device)
            dist.barrier()
            frames = _compiled_frames()
            for _ in range(args.steps):
                start = time.perf_counter()
                loss = runner.step(x, y)
                _sync(device)
                local[mode].append(time.perf_counter() - start)
            compiled_in_timing[mode] += _compiled_frames() - frames
            last_loss[mode] = float(loss)
            if dist.get_rank() == 0:  # so a run stopped by a time limit still shows what it measured
                mine = sorted(local[mode][-args.steps:])
                print(f"timed {mode} (repetition {rep + 1}/{args.reps}): median {1e3 * mine[len(mine) // 2]:.1f} "
                      "ms/step on rank 0", file=sys.stderr, flush=True)
            del runner
            gc.collect()
    gathered: list[tuple[dict[str, list[float]], dict[str, int]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, (local, compiled_in_timing))
    recompiled = sorted({m for _, counts in gathered for m, n in counts.items() if n})
    if recompiled:
        raise RuntimeError(f"--compile: timed steps of {recompiled!r} compiled, so their times would include "
                           "compilation; raise --warmup")
    slowest = {m: [max(r[m][i] for r, _ in gathered) for i in range(len(local[m]))] for m in modes}
    return slowest, last_loss


# ----------------------------------------------------------------------------- probes

def tensor_peak(prof: torch.profiler.profile) -> float:
    """Peak bytes of live CPU tensors over a profile (allocations minus frees, in time order)."""
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return float(peak) if deltas else float("nan")


def run_probe(args: argparse.Namespace) -> dict:
    """In a fresh process: bytes on the wire per step and peak tensor memory of one mode.

    Memory is the peak of live tensor bytes from building the model to the
    end of the steps, the same quantity on both device kinds: CUDA's
    allocator statistics, or on CPU the allocation and free events of
    torch's profiler. Resident set size would also count what the C
    allocator keeps cached from freed activations, which differs by mode
    for reasons that have nothing to do with the mode.
    """
    device = _init(args)
    x, y = _batch(args, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=device.type == "cpu") as prof, \
            bench_modes.WireCounter() as counter:
        runner = _runner(args, args._probe, device)
        if runner.ddp is not None and not runner.ddp._comm_hooks:
            # DDP's built-in all-reduce bypasses ProcessGroup's Python methods; torch's
            # allreduce_hook sends the same bytes through them, so it can be counted.
            runner.ddp.register_comm_hook(None, bench_modes.default_hooks.allreduce_hook)
        # The first step also rebuilds DDP's buckets; with --compile the first ones compile; *_powersgd
        # modes count from the first compressed step.
        before = max(_COMPILE_STEPS if args.compile else 1, args.powersgd_start if "powersgd" in args._probe else 0)
        for _ in range(before):
            runner.step(x, y)
        counter.reset()
        for _ in range(args.probe_steps):
            runner.step(x, y)
        _sync(device)
    calls = {k: v / args.probe_steps for k, v in counter.calls.items()}
    by_collective = {k: v / args.probe_steps for k, v in counter.bytes.items()}
    wire = counter.total_bytes / args.probe_steps
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else tensor_peak(prof)
    dist.destroy_process_group()
    return {"wire_bytes_per_step": wire, "wire_bytes_by_collective_per_step": by_collective,
            "collective_calls_per_step": calls, "peak_bytes": peak}


def probe_modes(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, list[dict]]:
    """Run :func:`run_probe` for each mode in fresh processes (one per rank); results per rank."""
    results: dict[str, list[dict]] = {}
    for mode in args.mode_list:
        port = [_free_port() if dist.get_rank() == 0 else 0]
        dist.broadcast_object_list(port, src=0)
        # A fresh store on a fresh port, hosted by the probe of rank 0 (not the launcher's agent).
        env = {**os.environ, "MASTER_PORT": str(port[0]), "TORCHELASTIC_USE_AGENT_STORE": "False"}
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--_probe", mode]
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=args.probe_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"memory/bytes probe of {mode!r} failed on rank {dist.get_rank()}:\n{done.stderr}")
        mine = json.loads(done.stdout.strip().splitlines()[-1])
        per_rank: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(per_rank, mine)
        results[mode] = per_rank
    return results


# ----------------------------------------------------------------------------- entry points

def run_ranks(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """What every rank does: time, probe, and on rank 0 print and save."""
    device = _init(args)
    times, losses = time_modes(args, device)
    probes = probe_modes(args, argv) if args.probe_steps else {}
    summary = bench_report.summarize(args, times, losses, probes, device)
    if dist.get_rank() == 0:
        print(bench_report.markdown(summary), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"results: {args.json}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_linked(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Make two namespaces, run rank ``i`` in namespace ``i``, always clean up; the exit code."""
    reason = netns.why_unavailable()
    if reason:
        print(f"benchmark.py: --link_gbit needs network namespaces, but {reason}.", file=sys.stderr)
        return 2
    # SIGTERM takes the same clean-up path as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    procs: list[subprocess.Popen] = []
    if args.threads is None:
        # Both ranks share this box's CPUs, though each sees itself as the only local rank.
        argv = [*argv, "--threads", str(max(1, (os.cpu_count() or 1) // 2))]
    try:
        with netns.LinkedNamespaces(args.link_gbit) as link:
            try:
                port = str(_free_port())
                for rank in range(2):
                    env = {**os.environ, _NETNS_ENV: "1", "RANK": str(rank), "LOCAL_RANK": "0",
                           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": link.hostname(0),
                           "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
                    procs.append(link.popen(rank, [sys.executable, os.path.abspath(__file__), *argv], env))
                codes = [p.wait() for p in procs]
            finally:  # stop the ranks before their namespaces go away
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
    except KeyboardInterrupt:
        print("benchmark.py: interrupted; ranks stopped and namespaces removed", file=sys.stderr)
        return 130
    return next((c for c in codes if c != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch: probe process, namespace orchestrator, or rank; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._probe:
        print(json.dumps(run_probe(args)), flush=True)
        return 0
    if args.link_gbit is not None and os.environ.get(_NETNS_ENV) != "1":
        if "RANK" in os.environ:
            print("benchmark.py: --link_gbit starts its own two ranks; run it with plain python "
                  "(as root), not under distrun/torchrun.", file=sys.stderr)
            return 2
        return run_linked(args, argv)
    run_ranks(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
