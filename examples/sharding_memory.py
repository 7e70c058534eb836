"""Peak live tensor memory per rank, sharding off / stage 1 / stage 2 / stage 3, for O2 BF16 AdamW.

Usage::

    python examples/sharding_memory.py                          # 1, 2 and 4 ranks on this host (gloo)
    python examples/sharding_memory.py --world_sizes 2 --merge_k 8

Every (world size, stage) runs in fresh processes on 127.0.0.1. Each rank
counts the peak of live tensor bytes from building the model to the end of
training with ``torch.profiler``'s ``profile_memory`` allocation events, as
``examples/benchmark.py`` does, and divides it by the parameter count.

One refinement: the profiler records allocations and frees of the profiled
thread only, but gloo frees some buffers on its own threads (those a
collective still held when the caller let go, e.g. DDP's start-up
broadcast), which would then look alive forever. So the measurement turns
on c10's ``FLAGS_caffe2_report_cpu_memory_usage``, which makes the CPU
allocator keep its byte count for every thread, and takes the peak of the
``total_allocated`` figure each recorded allocation carries (sampled at
every allocation of the profiled thread). Without that flag (another libc10
build) it falls back to summing the profiled thread's events. The model is an MLP whose optimizer state dominates
(small batch), so the table shows the bytes per parameter of the formula in
the README's "Sharding (ZeRO)" section plus what activations and transient
buffers add. Prints a Markdown table; ``--json`` also writes the numbers.
``--inf_rank R`` puts an inf into rank R's input batch at ``--inf_step``,
a step every rank then skips (the table is the maximum over ranks; the JSON
has each rank's peak)::

    python examples/sharding_memory.py --world_sizes 2 --stages 0,3 --inf_rank 1 --json peaks.json

``--checkpoint`` measures checkpoints instead: per rank, the peak of live
tensors while training, inside ``save_checkpoint``, and, in fresh
processes as a restart, inside ``load_latest_checkpoint`` of a freshly
built model and optimizer, all counting every live tensor, and the bytes
each rank wrote::

    python examples/sharding_memory.py --checkpoint --world_sizes 2,4 --stages 3 --hidden 4096 --layers 6
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import queue
import socket
from collections.abc import Sequence

import benchmark  # examples/benchmark.py, beside this file: its live-tensor peak
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STAGES = (0, 1, 2, 3)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of the measurement; ``--help`` lists every option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world_sizes", default="1,2,4", help="comma-separated rank counts (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="hidden layers (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="per rank (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default: %(default)s)")
    p.add_argument("--merge_k", type=int, default=1, help="gradient merge micro-batches (default: %(default)s)")
    p.add_argument("--bucket_mb", type=float, default=25.0,
                   help="fuse_grad_size_in_MB: the bucket size of DDP and stages 1-2 (at the default they size "
                        "their buckets from the model), not stage 3 (default: %(default)s)")
    p.add_argument("--stages", default="0,1,2,3",
                   help="comma-separated stages; 0 is sharding off, the ratios' base (default: %(default)s)")
    p.add_argument("--checkpoint", action="store_true",
                   help="measure save_checkpoint and load_latest_checkpoint against training instead (see "
                        "measure_checkpoint)")
    p.add_argument("--inf_rank", type=int, default=-1,
                   help="put an inf into this rank's input batch at step --inf_step: the step every rank skips "
                        "(default: none)")
    p.add_argument("--inf_step", type=int, default=1,
                   help="0-based iteration (micro-batch, with --merge_k) of --inf_rank's inf (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    return p.parse_args(argv)


def build_model(hidden: int, layers: int) -> nn.Module:
    """An MLP of ``layers`` hidden layers of width ``hidden`` with LayerNorm (kept FP32 in O2)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(64, hidden)]
    for _ in range(layers - 1):
        blocks += [nn.ReLU(), nn.Linear(hidden, hidden)]
    blocks += [nn.LayerNorm(hidden), nn.Linear(hidden, 10)]
    return nn.Sequential(*blocks)


def count_every_thread() -> bool:
    """Make the CPU allocator count the bytes of every thread (c10's report flag); False if unavailable."""
    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    return True


def tensor_peak(prof: torch.profiler.profile, every_thread: bool) -> int:
    """Peak bytes of live CPU tensors over a profile.

    ``every_thread``: the peak of the allocator's total (all threads) at each
    recorded allocation, minus its value when the profile began. Otherwise:
    the profiled thread's allocations minus its frees, in time order.
    """
    if every_thread:
        totals: list[tuple[int, int, int]] = []
        nodes = list(prof.profiler.kineto_results.experimental_event_tree())
        while nodes:
            node = nodes.pop()
            fields = node.extra_fields
            if type(fields).__name__ == "_ExtraFields_Allocation" and fields.alloc_size > 0:
                totals.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
            nodes.extend(node.children)
        totals.sort()
        if totals:
            return max(total for _, _, total in totals) - (totals[0][2] - totals[0][1])
    peak = benchmark.tensor_peak(prof)
    return 0 if math.isnan(peak) else int(peak)


def measure(rank: int, world: int, stage: int, args: argparse.Namespace) -> dict:
    """In a process of an initialised group (or alone): train and return this rank's peak tensor bytes.

    Also the peak counted from this thread's allocation events alone (``this_thread_peak_bytes``: it exceeds
    ``peak_bytes`` when other threads free what this one allocated) and the number of skipped steps.
    """
    from distamp import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True, sharding=stage > 0)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if stage:
        strategy.sharding_configs = {"stage": stage}
    if args.merge_k > 1:
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": args.merge_k}
    if stage != 3:  # stage 3 refuses it: its units set the message sizes
        strategy.fuse_grad_size_in_MB = args.bucket_mb
    g = torch.Generator().manual_seed(rank)
    every_thread = count_every_thread()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(args.hidden, args.layers)
        optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        for step in range(args.steps * args.merge_k):
            x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
            if rank == args.inf_rank and step == args.inf_step:
                x[0, 0] = math.inf
            with fleet.auto_cast():
                loss = F.cross_entropy(wrapped(x).float(), y)
            optimizer.zero_grad()
            optimizer.minimize(loss)
        skipped = optimizer.steps_skipped
        del wrapped, optimizer, model
    n_params = sum(p.numel() for p in build_model(args.hidden, args.layers).parameters())
    thread_peak = benchmark.tensor_peak(prof)
    return {"peak_bytes": tensor_peak(prof, every_thread), "params": n_params, "every_thread": every_thread,
            "this_thread_peak_bytes": 0 if math.isnan(thread_peak) else int(thread_peak), "skipped": skipped}


def allocator_peak(prof: torch.profiler.profile) -> int:
    """Peak bytes of live CPU tensors of every thread over a profile, counting those alive when it began.

    Needs :func:`count_every_thread`: the allocator's total at each recorded allocation, not a difference.
    """
    peak = 0
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.alloc_size > 0:
            peak = max(peak, fields.total_allocated)
        nodes.extend(node.children)
    return peak


def measure_checkpoint(rank: int, world: int, stage: int, args: argparse.Namespace) -> dict:
    """``args.phase`` "save": peak live tensor bytes of this rank while training and inside ``save_checkpoint``;
    "load" (in fresh processes, as a restart): while building the model and optimizer and inside
    ``load_latest_checkpoint``.

    The peaks count every tensor alive (the model and optimizer state too), so they compare directly.
    """
    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    strategy = fleet.DistributedStrategy(amp=True, sharding=stage > 0)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if stage:
        strategy.sharding_configs = {"stage": stage}
    if stage != 3:
        strategy.fuse_grad_size_in_MB = args.bucket_mb
    if not count_every_thread():
        raise RuntimeError("this libc10 cannot count every thread's bytes; the save and load peaks need it")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as building:
        model = build_model(args.hidden, args.layers)
        optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), strategy)
        wrapped = fleet.distributed_model(model, strategy)
        if args.phase == "save":
            g = torch.Generator().manual_seed(rank)
            for _ in range(args.steps):
                x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
                with fleet.auto_cast():
                    loss = F.cross_entropy(wrapped(x).float(), y)
                optimizer.zero_grad()
                optimizer.minimize(loss)
    with torch.profiler.profile(activities=activities, profile_memory=True) as checkpointing:
        if args.phase == "save":
            save_checkpoint(args.checkpoint_dir, args.steps, model=wrapped, optimizer=optimizer)
        else:
            info = load_latest_checkpoint(args.checkpoint_dir, model=wrapped, optimizer=optimizer)
            if info is None or info.step != args.steps:
                raise RuntimeError(f"rank {rank} did not load checkpoint {args.steps}: {info}")
    return {"before": allocator_peak(building), args.phase: allocator_peak(checkpointing),
            "params": sum(p.numel() for p in model.parameters())}


def written_by_rank(directory: str, world: int) -> list[int]:
    """Bytes of each saving rank's own files in ``directory``: its DCP file at stage 3 (``__<rank>_*``), its
    ``rank-<R>`` part at stages 1 and 2; the common part and DCP's ``.metadata`` (rank 0's) are left out."""
    sizes = [0] * world
    for root, _, names in os.walk(directory):
        for name in names:
            for rank in range(world):
                if name.startswith(f"__{rank}_") or f".rank-{rank:05d}." in name:
                    sizes[rank] += os.path.getsize(os.path.join(root, name))
    return sizes


def _worker(rank: int, world: int, port: int, stage: int, args: argparse.Namespace, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, (measure_checkpoint if args.checkpoint else measure)(rank, world, stage, args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, stage: int, args: argparse.Namespace, timeout: float = 600.0) -> list[dict]:
    """Measure ``stage`` on ``world`` fresh processes; one result per rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, stage, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = {}
        while len(out) < world:
            try:
                rank, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{world} ranks, stage {stage}: no result within {timeout}s") from None
            if isinstance(value, str):  # the worker's exception, as text
                raise RuntimeError(f"rank {rank} ({world} ranks, stage {stage}) failed: {value}")  # noqa: TRY004
            out[rank] = value
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def markdown(table: dict[tuple[int, int], list[dict]]) -> str:
    """Peak MB per rank (max over ranks), bytes per parameter and ratio to sharding off, per world size."""
    worlds = sorted({w for w, _ in table})
    stages = sorted({s for _, s in table})
    header = ["sharding off" if s == 0 else f"stage {s}" for s in stages]
    lines = [f"| ranks | {' | '.join(header)} |", "| ---: |" + " ---: |" * len(stages)]
    for world in worlds:
        cells = []
        base = max(r["peak_bytes"] for r in table[world, 0])
        for stage in stages:
            peak = max(r["peak_bytes"] for r in table[world, stage])
            per_param = peak / table[world, stage][0]["params"]
            ratio = "" if stage == 0 else f", {peak / base:.2f}x"
            cells.append(f"{peak / 2**20:.1f} MB ({per_param:.1f} B/param{ratio})")
        lines.append(f"| {world} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checkpoint_markdown(table: dict[tuple[int, int], list[dict]], written: dict[tuple[int, int], list[int]]) -> str:
    """Per (world size, stage): training, save and load peaks (max over ranks) and the bytes each rank wrote."""
    lines = ["| ranks | stage | training peak | save peak | load peak | bytes each rank wrote |",
             "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for (world, stage), ranks in sorted(table.items()):
        train = max(r["train"] for r in ranks)
        save, load = max(r["save"] for r in ranks), max(r["load"] for r in ranks)
        sizes = ", ".join(f"{b / 2**20:.1f}" for b in written[world, stage])
        lines.append(f"| {world} | {stage} | {train / 2**20:.1f} MB | {save / 2**20:.1f} MB ({save / train:.2f}x) | "
                     f"{load / 2**20:.1f} MB ({load / train:.2f}x) | {sizes} MB |")
    return "\n".join(lines)


def checkpoint_peaks(world: int, stage: int, args: argparse.Namespace, directory: str) -> tuple[list[dict], list[int]]:
    """Train and save into ``directory`` on ``world`` fresh processes, then load it on ``world`` others; per rank
    the peaks (``"train"``, ``"save"``, ``"build"``, ``"load"``, bytes), and the bytes each rank wrote."""
    args.checkpoint_dir = directory
    args.phase = "save"
    saved = run(world, stage, args)
    written = written_by_rank(directory, world)
    args.phase = "load"  # in fresh processes, as a restart
    loaded = run(world, stage, args)
    peaks = [{"train": s["before"], "save": s["save"], "build": r["before"], "load": r["load"], "params": s["params"]}
             for s, r in zip(saved, loaded, strict=True)]
    return peaks, written


def main_checkpoint(args: argparse.Namespace, worlds: list[int], stages: list[int]) -> None:
    """``--checkpoint``: measure save and load against training for every (world size, stage)."""
    import tempfile

    table, written = {}, {}
    for world in worlds:
        for stage in stages:
            with tempfile.TemporaryDirectory() as directory:
                table[world, stage], written[world, stage] = checkpoint_peaks(world, stage, args, directory)
    params = table[worlds[0], stages[0]][0]["params"]
    print(f"O2 BF16 AdamW, MLP {args.layers}x{args.hidden} ({params / 1e6:.2f}M parameters), batch {args.batch} "
          f"per rank, {args.steps} steps; peak live tensors per rank (max over ranks)")
    print(checkpoint_markdown(table, written))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{w},{s}": {"ranks": v, "written": written[w, s]} for (w, s), v in table.items()}, f,
                      indent=1)


def main(argv: Sequence[str] | None = None) -> None:
    """Measure every (world size, stage) and print the table."""
    args = parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    if args.checkpoint:
        main_checkpoint(args, worlds, stages)
        return
    if 0 not in stages or any(s not in STAGES for s in stages):
        raise SystemExit(f"--stages {args.stages!r}: give stages from {STAGES}, 0 included (the ratios' base)")
    table = {(w, s): run(w, s, args) for w in worlds for s in stages}
    params = table[worlds[0], 0][0]["params"]
    print(f"O2 BF16 AdamW, MLP {args.layers}x{args.hidden} ({params / 1e6:.2f}M parameters), batch {args.batch} "
          f"per rank, {args.steps} steps, gradient merge K={args.merge_k}, bucket {args.bucket_mb} MB")
    print(markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{w},{s}": v for (w, s), v in table.items()}, f, indent=1)


if __name__ == "__main__":
    main()
