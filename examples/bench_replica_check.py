"""What one replica check (``strategy.check_replicas_every``) costs, per model and sharding stage.

    distrun --nproc_per_node 2 examples/bench_replica_check.py

For each model (the digits example's ``DigitsNet``, and the benchmark's
6.6M-parameter MLP) and each stage (0, 2, 3) it trains a few O2 BF16 steps
with the check on every step, then times what one check does on this rank,
median of ``--reps``: hashing the tensors the check compares (unsharded: the
16-bit parameters and their FP32 masters; stage 2: the 16-bit parameters;
stage 3: the 16-bit parameters as FSDP2 gathers them for the forward, which
the check hashes in its forward hooks) and the all-gather of the hashes. For
scale it also prints the median time of a training step without the check.
Rank 0 prints.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import FAMILIES
from train_digits import DigitsNet

from distamp import fleet
from distamp.distributed.replica_check import compare_replicas, tensor_hash


def _strategy(stage: int, every: int) -> fleet.DistributedStrategy:
    strategy = fleet.DistributedStrategy(amp=True, check_replicas_every=every)
    strategy.amp_configs = {"use_pure_fp16": True, "dtype": "bfloat16"}
    if stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": stage}
    return strategy


def _models():
    mlp = FAMILIES["mlp"]
    yield ("digits CNN", lambda: DigitsNet(), lambda: (torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))))
    cpu = torch.device("cpu")
    yield ("MLP", lambda: mlp.build(0), lambda: mlp.make_batch(64, torch.Generator().manual_seed(0), cpu))


def _train(build, batch, stage: int, every: int, steps: int):
    """The optimizer and model after ``steps`` steps, and the median step time in seconds."""
    model = build()
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3), _strategy(stage, every))
    wrapped = fleet.distributed_model(model)
    x, y = batch()
    times = []
    for _ in range(steps):
        fleet.barrier_worker()
        start = time.perf_counter()
        with fleet.auto_cast():
            loss = F.cross_entropy(wrapped(x).float(), y)
        optimizer.zero_grad()
        optimizer.backward(loss)
        optimizer.step()
        times.append(time.perf_counter() - start)
    assert optimizer.replicas.checks == (steps if every else 0)
    return optimizer, statistics.median(times[2:])  # the first steps build buckets and caches


def _compared_tensors(optimizer, stage: int) -> list[torch.Tensor]:
    """What a check hashes on this rank (stage 3: the gathered 16-bit parameters, built here untimed)."""
    params = optimizer.master_weights.model_params
    if stage == 3:
        return [p.full_tensor().to(torch.bfloat16) for p in params]
    if stage == 2:
        return [p.detach() for p in params]
    tensors = []
    for p in params:
        master = optimizer.master_weights.master_for(p)
        tensors += [p.detach()] if master is p else [p.detach(), master.detach()]
    return tensors


def _check_seconds(tensors: list[torch.Tensor], reps: int) -> float:
    """Median seconds of one check: hash every tensor, all-gather and compare the hashes."""
    names = [str(i) for i in range(len(tensors))]
    times = []
    for _ in range(reps):
        fleet.barrier_worker()
        start = time.perf_counter()
        compare_replicas(names, [tensor_hash(t) for t in tensors], step=1, applied_step=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; too few steps or reps to take a median of exits 2 before any process group."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12,
                   help="training steps without the check, the first two untimed (at least 3; default: %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="checks timed (at least 1; default: %(default)s)")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be at least 3 (the first two build buckets and caches and are not timed); "
                f"got {args.steps}")
    if args.reps < 1:
        p.error(f"--reps must be at least 1; got {args.reps}")
    return args


def main() -> None:
    """Time one check for each model and stage; rank 0 prints a table."""
    args = parse_args()
    fleet.init()
    rows = []
    for name, build, batch in _models():
        for stage in (0, 2, 3):
            _, step = _train(build, batch, stage, 0, args.steps)
            optimizer, _ = _train(build, batch, stage, 1, 4)
            tensors = _compared_tensors(optimizer, stage)
            check = _check_seconds(tensors, args.reps)
            params = sum(p.numel() for p in optimizer.master_weights.model_params)
            rows.append((name, params, stage, len(tensors), sum(t.nbytes for t in tensors), step, check))
    if fleet.is_first_worker():
        print(f"{'model':10} {'params':>9} stage tensors {'MB':>6} {'step ms':>8} {'check ms':>8}")
        for name, params, stage, count, nbytes, step, check in rows:
            print(f"{name:10} {params:9d} {stage:5d} {count:7d} {nbytes / 1e6:6.1f} {step * 1e3:8.1f} "
                  f"{check * 1e3:8.2f}")


if __name__ == "__main__":
    main()
