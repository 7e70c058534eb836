"""Where a training step's time goes: forward, backward and update, per mode, side by side in one process.

    python examples/step_phases.py --model gpt --d_model 1024 --layers 12 --heads 16 --vocab 32768 \\
        --seq_len 1024 --batch 8 --modes torch_bf16,distamp_o2_bf16
    python examples/step_phases.py --model tiny_gpt --threads 1 --modes torch_bf16,distamp_o2_bf16

The benchmark's modes and model families (every flag but ``--steps``,
``--warmup`` and ``--json`` is ``examples/benchmark.py``'s), each mode's
step split into the three phases of ``bench_modes.Runner``: ``forward``
(the loss under the mode's autocast), ``backward`` (zeroing the gradients,
the backward with loss scaling) and ``update`` (unscaling, the inf/NaN
verdict where the mode has one, the optimizer step). On CUDA each phase is
timed by CUDA events, so it is the GPU's time from the end of the phase
before, including the GPU's idle time while the host prepares the phase's
work; on a CPU, by the host clock. One process: a one-rank group, as the
benchmark's probes. It prints the median of ``--steps`` steps per phase
after ``--warmup`` steps, and each distamp mode's ratio to its torch-native
counterpart per phase.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark  # examples/ is not a package: found through the path set above

PHASES = ("forward", "backward", "update")


class _Clock:
    """Marks on the device's timeline: CUDA events on a GPU, the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms_between(self, start: object, end: object) -> float:
        if self.cuda:
            return start.elapsed_time(end)  # type: ignore[attr-defined]
        return 1e3 * (end - start)  # type: ignore[operator]

    def sync(self) -> None:
        benchmark._sync(self.device)


def time_phases(step_parts: tuple[Callable, Callable, Callable], x: torch.Tensor, y: torch.Tensor,
                clock: _Clock, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per phase (and ``total``), the milliseconds of each of ``steps`` steps after ``warmup`` untimed ones."""
    forward, backward, update = step_parts
    times: dict[str, list[float]] = {name: [] for name in (*PHASES, "total")}
    for i in range(warmup + steps):
        marks = [clock.mark()]
        loss = forward(x, y)
        marks.append(clock.mark())
        backward(loss)
        marks.append(clock.mark())
        update()
        marks.append(clock.mark())
        clock.sync()
        if i >= warmup:
            for name, start, end in zip(PHASES, marks, marks[1:], strict=False):
                times[name].append(clock.ms_between(start, end))
            times["total"].append(clock.ms_between(marks[0], marks[-1]))
    return times


def measure(args: argparse.Namespace, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """``{mode: {phase: median ms}}`` for every mode of ``args``, one mode after the other."""
    device = benchmark._init(args)
    x, y = benchmark._batch(args, device)
    clock = _Clock(device)
    medians = {}
    for mode in args.mode_list:
        runner = benchmark._runner(args, mode, device)
        runner.select()
        times = time_phases((runner.forward, runner.backward, runner.update), x, y, clock, steps, warmup)
        medians[mode] = {name: statistics.median(values) for name, values in times.items()}
        del runner
        gc.collect()
    return medians


def report(medians: dict[str, dict[str, float]], args: argparse.Namespace, device: str) -> str:
    """A Markdown table: median ms per phase, and for distamp modes the ratio to the torch-native mode."""
    lines = [f"model `{args.model}` ({args.family.describe()}), batch {args.batch}, one process on {device}, "
             "median ms per phase",
             "",
             "| mode | " + " | ".join(PHASES) + " | total | " + " | ".join(f"{p} x torch" for p in PHASES) + " |",
             "| --- |" + " ---: |" * (2 * len(PHASES) + 1)]
    for mode, row in medians.items():
        counterpart = medians.get(benchmark.bench_modes.COUNTERPART.get(mode, ""))
        ratios = [f"{row[p] / counterpart[p]:.2f}" if counterpart and counterpart[p] > 0 else "-" for p in PHASES]
        lines.append(f"| {mode} | " + " | ".join(f"{row[p]:.2f}" for p in (*PHASES, "total")) + " | "
                     + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``--steps``, ``--warmup`` and ``--json``; the rest are the benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the medians here")
    own, rest = p.parse_known_args(argv)
    if own.steps < 1 or own.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {own.steps} and {own.warmup}")
    args = benchmark.parse_args(rest)
    medians = measure(args, own.steps, own.warmup)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(report(medians, args, device), flush=True)
    if own.json:
        with open(own.json, "w") as f:
            json.dump(medians, f, indent=1)


if __name__ == "__main__":
    main()
