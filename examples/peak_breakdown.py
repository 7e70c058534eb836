"""What is alive at one mode's memory peak, grouped by where it was allocated.

    python examples/peak_breakdown.py --mode distamp_o2_bf16 --model gpt --d_model 512 --layers 2 \\
        --vocab 16384 --seq_len 32 --batch 2 --threads 1
    python examples/peak_breakdown.py --mode torch_bf16 --model gpt ...     # the torch-native side

One process (a one-rank group, as ``examples/benchmark.py``'s probes), one
of the benchmark's modes and model families (every flag but ``--mode``,
``--steps`` and ``--top`` is the benchmark's). It records torch.profiler's
allocation events with Python stacks from building the model to the end of
``--steps`` steps, replays them in time order on the model's device (CPU
tensors, or CUDA's caching allocator's allocations on a GPU), finds the
moment the live bytes peak, and prints the tensors alive then grouped by
(the innermost frame outside torch, the outermost torch op under it), in
MB and bytes per parameter: for example the BF16 weights cast by
``Module.to``, the FP32 masters made by distamp's master-weight module,
the gradient ``EmbeddingBackward0`` returned. Tensors that were alive
before the profile began are not in the replay (none: the model is built
inside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark  # examples/ is not a package: found through the path set above


def _in_torch(frame: str) -> bool:
    """Whether a profiler Python frame (``path(line): name``) is torch's own code or a builtin."""
    return frame.startswith(("torch/", "<built-in")) or f"{os.sep}torch{os.sep}" in frame


def _labels(node) -> tuple[str, str]:
    """(innermost Python frame outside torch, outermost torch op under the innermost Python frame)."""
    op = frame = ""
    in_ops = True
    parent = node.parent
    while parent is not None:
        kind = str(parent.tag).rsplit(".", 1)[-1]
        if kind == "TorchOp" and in_ops:
            op = parent.name
        elif kind in ("PyCall", "PyCCall"):
            in_ops = False
            op = op or parent.name
            if not _in_torch(parent.name):
                frame = parent.name
                break
        parent = parent.parent
    return frame or "(no frame outside torch)", op


def _allocations(prof: torch.profiler.profile, device_type: str) -> list[tuple[int, int, int, object]]:
    """(time ns, signed bytes, pointer, node) of every allocation and free on ``device_type``, in time order."""
    events = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and torch.device(fields.device).type == device_type:
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr, node))
        nodes.extend(node.children)
    events.sort(key=lambda e: e[0])
    return events


def live_at_peak(events: Sequence[tuple[int, int, int, object]]) -> tuple[int, list[tuple[int, object]], object]:
    """Replay ``events``: (peak bytes, the (bytes, node) alive at the peak, the allocation that reached it)."""
    live: dict[int, tuple[int, object]] = {}
    current = peak = 0
    peak_index = -1
    for i, (_, size, ptr, node) in enumerate(events):
        if size > 0:
            live[ptr] = (size, node)
            current += size
            if current > peak:
                peak, peak_index = current, i
        elif ptr in live:  # a free of a tensor allocated before the profile began is not in the replay
            current -= live.pop(ptr)[0]
    live.clear()
    for _, size, ptr, node in events[:peak_index + 1]:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
    return peak, list(live.values()), events[peak_index][3] if peak_index >= 0 else None


def breakdown(args: argparse.Namespace, mode: str, steps: int) -> dict:
    """Run ``steps`` steps of ``mode`` under the profiler and group what is alive at the peak."""
    device = benchmark._init(args)
    x, y = benchmark._batch(args, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                with_stack=True) as prof:
        runner = benchmark._runner(args, mode, device)
        for _ in range(steps):
            runner.step(x, y)
        benchmark._sync(device)
    with torch.device("meta"):  # only the count: no second model in memory
        params = sum(p.numel() for p in args.family.build(0).parameters())
    peak, alive, reached = live_at_peak(_allocations(prof, device.type))
    groups: dict[tuple[str, str], list[int]] = {}
    for size, node in alive:
        entry = groups.setdefault(_labels(node), [0, 0])
        entry[0] += size
        entry[1] += 1
    rows = sorted(((size, count, frame, op) for (frame, op), (size, count) in groups.items()), reverse=True)
    dist.destroy_process_group()
    return {"mode": mode, "device": str(device), "params": params, "peak_bytes": peak,
            "peak_reached_in": " <- ".join(_labels(reached)[::-1]) if reached is not None else "",
            "groups": [{"bytes": size, "tensors": count, "frame": frame, "op": op}
                       for size, count, frame, op in rows]}


def report(result: dict, top: int) -> str:
    """The breakdown as a markdown table of the ``top`` largest groups."""
    params = result["params"]
    lines = [f"{result['mode']} on {result['device']}: peak {result['peak_bytes'] / 2**20:.1f} MiB = "
             f"{result['peak_bytes'] / params:.2f} bytes/param ({params / 1e6:.2f}M parameters), reached in "
             f"{result['peak_reached_in']}", "",
             "| MiB | bytes/param | tensors | allocated by (torch op) | under (frame outside torch) |",
             "| ---: | ---: | ---: | --- | --- |"]
    for g in result["groups"][:top]:
        lines.append(f"| {g['bytes'] / 2**20:.1f} | {g['bytes'] / params:.2f} | {g['tensors']} | {g['op'][:70]} | "
                     f"{g['frame'][:70]} |")
    rest = result["groups"][top:]
    if rest:
        lines.append(f"| {sum(g['bytes'] for g in rest) / 2**20:.1f} | {sum(g['bytes'] for g in rest) / params:.2f} "
                     f"| {sum(g['tensors'] for g in rest)} | ({len(rest)} more groups) | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``--mode``, ``--steps``, ``--top`` and ``--json``; the rest are the benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", required=True, choices=list(benchmark.bench_modes.MODES), help="the benchmark mode")
    p.add_argument("--steps", type=int, default=3, help="training steps (default: %(default)s)")
    p.add_argument("--top", type=int, default=15, help="groups to print (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the whole breakdown here")
    own, rest = p.parse_known_args(argv)
    if own.steps < 1:
        p.error(f"--steps must be >= 1, got {own.steps}")
    args = benchmark.parse_args([*rest, "--modes", own.mode])
    result = breakdown(args, own.mode, own.steps)
    print(report(result, own.top), flush=True)
    if own.json:
        with open(own.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
