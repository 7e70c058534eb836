"""What ``benchmark.py`` reports: the per-mode summary (plain numbers, saved as JSON) and its Markdown table."""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import bench_modes
import torch
import torch.distributed as dist

__all__ = ["markdown", "summarize"]


def summarize(args: argparse.Namespace, times: dict[str, list[float]], losses: dict[str, float],
              probes: dict[str, list[dict]], device: torch.device) -> dict:
    """Everything the table shows, as plain numbers (seconds, bytes); ``device`` is where the ranks trained."""
    n_params = sum(p.numel() for p in args.family.build(0).parameters())
    rows = {}
    for mode, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples[0],) * 3
        rows[mode] = {"median_s": statistics.median(samples), "iqr_s": q3 - q1, "samples": len(samples),
                      "last_loss": losses[mode]}
        if mode in probes:
            rows[mode]["wire_bytes_per_step"] = probes[mode][0]["wire_bytes_per_step"]
            rows[mode]["wire_bytes_by_collective_per_step"] = probes[mode][0]["wire_bytes_by_collective_per_step"]
            rows[mode]["collective_calls_per_step"] = probes[mode][0]["collective_calls_per_step"]
            rows[mode]["peak_bytes_per_rank"] = [p["peak_bytes"] for p in probes[mode]]
            rows[mode]["peak_bytes_per_param"] = max(p["peak_bytes"] for p in probes[mode]) / n_params
    for mode, row in rows.items():
        if "fp32" in rows:
            row["vs_fp32"] = row["median_s"] / rows["fp32"]["median_s"]
        native = bench_modes.COUNTERPART.get(mode)
        if native in rows:
            row["vs_torch_native"] = row["median_s"] / rows[native]["median_s"]
        if "fp32" in rows and "wire_bytes_per_step" in row and rows["fp32"].get("wire_bytes_per_step"):
            row["wire_vs_fp32"] = row["wire_bytes_per_step"] / rows["fp32"]["wire_bytes_per_step"]
        for key, ref in (("peak_vs_fp32", "fp32"), ("peak_vs_torch_native", native)):
            if ref in rows and "peak_bytes_per_rank" in row and "peak_bytes_per_rank" in rows[ref]:
                row[key] = max(row["peak_bytes_per_rank"]) / max(rows[ref]["peak_bytes_per_rank"])
    sizes = {k: v for k, v in dataclasses.asdict(args.family).items() if k != "default_batch"}
    return {"config": {"model": args.model, "family": args.family.describe(), "sizes": sizes,
                       "parameters": n_params, "batch_per_rank": args.batch, "compile": args.compile,
                       "world_size": dist.get_world_size(), "reps": args.reps, "steps": args.steps,
                       "warmup": args.warmup, "link_gbit": args.link_gbit, "bucket_mb": args.bucket_mb,
                       "threads_per_rank": torch.get_num_threads(), "device": str(device),
                       "torch": torch.__version__},
            "modes": rows}


def _megabytes(nbytes: float) -> str:
    mb = nbytes / 2**20
    return f"{mb:.0f}" if mb >= 10 else f"{mb:.2f}"


def markdown(summary: dict) -> str:
    """The summary as a Markdown table."""
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    cfg = summary["config"]
    link = f"{cfg['link_gbit']:g} Gbit/s link" if cfg["link_gbit"] else "loopback"
    title = (f"model `{cfg['model']}` ({cfg['family']}; {cfg['parameters'] / 1e6:.2f}M parameters), "
             f"batch {cfg['batch_per_rank']} per rank, {'torch.compile' if cfg['compile'] else 'eager'}, "
             f"{cfg['world_size']} ranks, {link}, {cfg['reps']} x {cfg['steps']} steps per mode")
    lines = [title,
             "",
             ("| mode | step ms (median) | IQR ms | x FP32 | x torch-native | wire MB/step "
              "| peak tensor MB per rank | peak bytes/param | peak x FP32 | peak x torch-native | last loss |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in summary["modes"].items():
        peaks = r.get("peak_bytes_per_rank")
        peak = " / ".join(_megabytes(p) for p in peaks) if peaks else "-"
        wire = r.get("wire_bytes_per_step")
        lines.append(f"| {mode} | {r['median_s'] * 1e3:.1f} | {r['iqr_s'] * 1e3:.1f} | {fmt(r.get('vs_fp32'), '.2f')} "
                     f"| {fmt(r.get('vs_torch_native'), '.2f')} | {fmt(None if wire is None else wire / 1e6, '.2f')} "
                     f"| {peak} | {fmt(r.get('peak_bytes_per_param'), '.2f')} | {fmt(r.get('peak_vs_fp32'), '.2f')} "
                     f"| {fmt(r.get('peak_vs_torch_native'), '.2f')} "
                     f"| {r['last_loss']:.4f} |")
    return "\n".join(lines)
