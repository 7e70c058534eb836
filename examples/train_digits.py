"""Train a small CNN on scikit-learn's handwritten digits with distamp AMP.

The README's main job::

    distrun --nproc_per_node 2 examples/train_digits.py            # FP16, O1
    distrun --nproc_per_node 2 examples/train_digits.py --pure_fp16
    distrun --nproc_per_node 2 examples/train_digits.py --dtype bfloat16
    distrun --nproc_per_node 2 examples/train_digits.py --no_amp   # FP32 baseline
    distrun --nproc_per_node 2 examples/train_digits.py --pure_fp16 --sharding_stage 2   # ZeRO-2
    distrun --nproc_per_node 2 examples/train_digits.py --pure_fp16 --sharding_stage 3   # ZeRO-3 (FSDP2)
    distrun --nproc_per_node 2 examples/train_digits.py --powersgd_rank 2 --check_replicas_every 50   # PowerSGD

The data (1,797 8x8 images) ships inside scikit-learn, so nothing is
downloaded. Every rank splits it with the same seed, trains on its
``DistributedSampler`` shard and evaluates the whole test set. Rank 0 shows
a progress bar, prints ``test_accuracy=...`` and writes ``history.json`` and
``history.png`` into ``--out_dir``: per step the loss, the loss scale with
the skipped steps, and the telemetry of ``optimizer.stats()`` (the global
gradient norm ``clip_grad_norm_`` computes, and the running count of
overflows).

With ``--checkpoint_dir DIR`` the job saves every ``--checkpoint_every``
steps (model, AMP optimizer with its FP32 masters and loss scale, every
rank's RNG state and the data position; the last two are kept) and resumes
from the newest intact checkpoint when it starts, so
``distrun --max_restarts 1 ... --checkpoint_dir DIR`` survives a killed
worker and finishes bitwise as if nothing had happened. The shuffle depends
only on (seed, epoch), and the position is saved as samples seen in the
epoch: resumed with another number of workers, the epoch continues after
the same prefix of that epoch's order (rounded down to a whole global
batch, so at most one global batch is seen twice) and each rank draws its
new shard of the rest; the per-rank RNG streams start afresh.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distamp import fleet
from distamp.checkpoint import load_latest_checkpoint, save_checkpoint


class DigitsNet(nn.Module):
    """Two 3x3 convolutions, a max-pool and two linear layers for 8x8 digits.

    Deliberately tiny: FP16 convolutions on CPU are about ten times slower
    than FP32, and the default run must finish well inside a minute on two
    CPU ranks.
    """

    def __init__(self, channels: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch, 10)`` for images of shape ``(batch, 1, 8, 8)``."""
        return self.classifier(self.features(x))


@dataclass
class History:
    """What rank 0 records per optimizer step (rank 0's local loss)."""

    loss: list[float] = field(default_factory=list)
    loss_scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    overflows: list[int] = field(default_factory=list)

    def record(self, loss: float, scale: float, skipped: bool, stats: dict) -> None:
        """Append one step; ``stats`` is ``optimizer.stats()`` after it."""
        self.loss.append(loss)
        self.loss_scale.append(scale)
        self.skipped.append(skipped)
        norm = stats["grad_norm"]
        self.grad_norm.append(float("nan") if norm is None or skipped else norm)
        self.overflows.append(stats["overflows"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of the example; ``--help`` lists every option."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    amp = p.add_argument_group("precision")
    amp.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                     help="low-precision type (default: %(default)s)")
    amp.add_argument("--pure_fp16", action="store_true",
                     help="O2: 16-bit weights with FP32 masters (default: O1)")
    amp.add_argument("--no_amp", action="store_true", help="FP32 baseline, AMP off")
    amp.add_argument("--init_loss_scaling", type=float, default=32768.0,
                     help="first loss scale for float16 (default: %(default)s)")
    amp.add_argument("--sharding_stage", type=int, choices=(0, 1, 2, 3), default=0,
                     help="ZeRO stage: 1 optimizer state sharded, 2 gradients too, 3 parameters too (FSDP2); "
                          "0: off, the default")
    amp.add_argument("--powersgd_rank", type=int, default=0, metavar="R",
                     help="compress gradients with PowerSGD at rank R (0: off, the default)")
    amp.add_argument("--powersgd_start", type=int, default=50, metavar="N",
                     help="with --powersgd_rank: applied steps of plain all-reduce first (default: %(default)s)")
    amp.add_argument("--check_replicas_every", type=int, default=0, metavar="N",
                     help="every N applied steps the ranks compare hashes of their parameters and stop together "
                          "if they differ (strategy.check_replicas_every; 0: off, the default)")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=20, help="default: %(default)s")
    train.add_argument("--max_steps", type=int, default=None,
                       help="stop after this many optimizer steps (default: all epochs)")
    train.add_argument("--batch_size", type=int, default=32, help="per rank (default: %(default)s)")
    train.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: %(default)s)")
    train.add_argument("--clip_grad_norm", type=float, default=math.inf, metavar="MAX",
                       help="clip the global gradient norm to MAX (default: no clipping; the norm is "
                       "still computed and plotted)")
    train.add_argument("--seed", type=int, default=0, help="split, init and shuffle seed (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--out_dir", default=os.path.join("runs", "digits"),
                     help="where rank 0 writes history.json and history.png (default: %(default)s)")
    out.add_argument("--save_params", default=None, metavar="PATH",
                     help="rank 0 saves the final model state_dict here")
    out.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint_dir", default=None, metavar="DIR",
                      help="save every --checkpoint_every steps (last two kept) and resume "
                      "from the newest intact checkpoint in DIR at start-up")
    ckpt.add_argument("--checkpoint_every", type=int, default=50, metavar="N",
                      help="optimizer steps between checkpoints (default: %(default)s)")
    args = p.parse_args(argv)
    if args.powersgd_rank < 0 or args.powersgd_start < 0:
        p.error(f"--powersgd_rank and --powersgd_start must be >= 0, got {args.powersgd_rank!r} and "
                f"{args.powersgd_start!r}")
    if args.check_replicas_every < 0:
        p.error(f"--check_replicas_every must be >= 0, got {args.check_replicas_every!r}")
    if args.powersgd_rank and args.sharding_stage:
        p.error("--powersgd_rank and --sharding_stage cannot be combined; use one of them")
    for name in ("epochs", "batch_size", "checkpoint_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)!r}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max_steps must be >= 1, got {args.max_steps!r}")
    if args.lr <= 0 or not math.isfinite(args.lr):
        p.error(f"--lr must be a positive number, got {args.lr!r}")
    if args.no_amp and args.pure_fp16:
        p.error("--no_amp and --pure_fp16 contradict each other; use one of them")
    return args


def load_digits_split(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as (train, test) datasets, 80/20, stratified by ``seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype("float32") / 16.0  # pixel values are 0..16
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)

    def as_dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(y).long())

    return as_dataset(x_tr, y_tr), as_dataset(x_te, y_te)


def build_strategy(args: argparse.Namespace) -> fleet.DistributedStrategy:
    """The distamp strategy the command line asks for."""
    strategy = fleet.DistributedStrategy()
    strategy.amp = not args.no_amp
    strategy.check_replicas_every = args.check_replicas_every
    if args.sharding_stage:
        strategy.sharding = True
        strategy.sharding_configs = {"stage": args.sharding_stage}
    if args.powersgd_rank:
        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": args.powersgd_rank, "start_step": args.powersgd_start}
    if strategy.amp:
        strategy.amp_configs = {
            "init_loss_scaling": args.init_loss_scaling,
            "use_pure_fp16": args.pure_fp16,
            "dtype": args.dtype,
        }
    return strategy


def train(model, optimizer, loader: DataLoader, sampler: DistributedSampler,
          args: argparse.Namespace, resume: dict | None = None) -> History:
    """Run ``args.epochs`` epochs (or ``args.max_steps`` steps) and return rank 0's history."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    total = len(loader) * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    first = fleet.is_first_worker()
    resume = resume or {"step": 0, "epoch": 0, "samples_in_epoch": 0, "history": {}}
    history = History(**resume["history"])
    step = resume["step"]
    global_batch = args.batch_size * fleet.worker_num()
    bar = tqdm(total=total, initial=step, disable=not first or args.no_progress, unit="step", dynamic_ncols=True)
    # distamp's log lines (a skipped step, a scale change) go through tqdm.write, not glued onto the bar.
    with logging_redirect_tqdm(loggers=[logging.getLogger("distamp")]):
        device = fleet.device()
        model.train()
        for epoch in range(resume["epoch"], args.epochs):
            sampler.set_epoch(epoch)  # a different shuffle per epoch, the same on every rank
            # The order depends only on (seed, epoch): skipping what the checkpoint saw resumes it exactly.
            done = resume["samples_in_epoch"] // global_batch if epoch == resume["epoch"] else 0
            for batch, (x, y) in enumerate(itertools.islice(loader, done, None), start=done + 1):
                if step == total:
                    break
                x, y = x.to(device), y.to(device)
                with fleet.auto_cast():
                    loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad()
                optimizer.backward(loss)
                optimizer.clip_grad_norm_(args.clip_grad_norm)  # unscaled; with inf it only measures
                scale = float(optimizer.get_loss_scaling())     # the scale this step used
                applied = optimizer.step()
                step += 1
                if first:
                    history.record(loss.item(), scale, not applied, optimizer.stats())
                    bar.set_postfix(epoch=epoch, loss=f"{history.loss[-1]:.4f}", scale=f"{scale:g}")
                    bar.update()
                if args.checkpoint_dir and step % args.checkpoint_every == 0:
                    save_checkpoint(args.checkpoint_dir, step, model=model, optimizer=optimizer, extra={
                        "step": step, "epoch": epoch, "samples_in_epoch": batch * global_batch,
                        "history": asdict(history)})
    bar.close()
    return history


@torch.no_grad()
def evaluate(model, dataset: TensorDataset) -> float:
    """Accuracy on the whole of ``dataset``; every rank computes the same number."""
    model.eval()
    x, y = (t.to(fleet.device()) for t in dataset.tensors)
    with fleet.auto_cast():
        predictions = model(x).argmax(dim=1)
    model.train()
    return (predictions == y).float().mean().item()


def whole_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` with whole tensors: at sharding stage 3 each is gathered (collective)."""
    from torch.distributed.tensor import DTensor

    state = getattr(model, "module", model).state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def write_history(out_dir: str, history: History, summary: dict) -> tuple[str, str]:
    """Write ``history.json`` and ``history.png`` (loss and loss scale per step)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training hosts
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "history.json")
    png_path = os.path.join(out_dir, "history.png")
    with open(json_path, "w") as f:
        json.dump({**summary, "step": list(range(1, len(history.loss) + 1)), **asdict(history)}, f, indent=1)

    steps = range(1, len(history.loss) + 1)
    fig, (ax_loss, ax_scale, ax_norm) = plt.subplots(3, 1, sharex=True, figsize=(7, 7))
    ax_loss.plot(steps, history.loss, lw=1)
    ax_loss.set_ylabel("training loss (rank 0)")
    ax_loss.set_yscale("log")
    ax_scale.step(steps, history.loss_scale, where="post")
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_yscale("log", base=2)
    skipped = [s for s, skip in zip(steps, history.skipped, strict=True) if skip]
    if skipped:
        ax_scale.plot(skipped, [history.loss_scale[s - 1] for s in skipped], "rx", label="skipped step")
        ax_scale.legend()
    ax_norm.plot(steps, history.grad_norm, lw=1, label="global gradient norm")
    ax_norm.set_ylabel("gradient norm")
    ax_norm.set_yscale("log")
    ax_overflows = ax_norm.twinx()
    ax_overflows.step(steps, history.overflows, where="post", color="tab:red", label="overflows so far")
    ax_overflows.set_ylabel("overflows", color="tab:red")
    ax_norm.set_xlabel("optimizer step")
    fig.suptitle(f"digits, {summary['precision']}: test accuracy {summary['test_accuracy']:.4f}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path


def precision_name(args: argparse.Namespace) -> str:
    """A short label such as ``fp32``, ``float16-O1`` or ``bfloat16-O2``."""
    if args.no_amp:
        return "fp32"
    return f"{args.dtype}-{'O2' if args.pure_fp16 else 'O1'}"


def main(argv: Sequence[str] | None = None) -> float:
    """Train, evaluate, and on rank 0 report and save; returns the test accuracy."""
    args = parse_args(argv)
    strategy = build_strategy(args)
    fleet.init(is_collective=True, strategy=strategy)
    train_set, test_set = load_digits_split(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=fleet.worker_num(),
                                 rank=fleet.worker_index(), shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(args.seed)  # the same initial weights everywhere, before any broadcast
    model = DigitsNet().to(fleet.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = fleet.distributed_optimizer(optimizer, strategy)
    model = fleet.distributed_model(model)

    resume = None
    if args.checkpoint_dir:
        info = load_latest_checkpoint(args.checkpoint_dir, model=model, optimizer=optimizer)
        resume = info.extra if info is not None else None
    history = train(model, optimizer, loader, sampler, args, resume)
    accuracy = evaluate(model, test_set)
    params = whole_state_dict(model) if args.save_params else None  # collective at stage 3
    if fleet.is_first_worker():
        stats = optimizer.stats()
        summary = {"precision": precision_name(args), "sharding_stage": args.sharding_stage,
                   "powersgd_rank": args.powersgd_rank, "bytes_sent_last_step": stats["bytes_sent"],
                   "compression_rate": stats["compression_rate"], "world_size": fleet.worker_num(),
                   "epochs": args.epochs, "max_steps": args.max_steps, "lr": args.lr,
                   "seed": args.seed, "batch_size_per_rank": args.batch_size,
                   "skipped_steps": sum(history.skipped), "test_accuracy": accuracy}
        json_path, png_path = write_history(args.out_dir, history, summary)
        if args.save_params:
            torch.save(params, args.save_params)
        print(f"precision={summary['precision']} steps={len(history.loss)} "
              f"skipped={summary['skipped_steps']} history={json_path} plot={png_path}", flush=True)
        if args.powersgd_rank:
            print(f"powersgd_rank={args.powersgd_rank} bytes_sent_last_step={stats['bytes_sent']} "
                  f"compression_rate={stats['compression_rate']}", flush=True)
        print(f"test_accuracy={accuracy:.4f}", flush=True)
    fleet.barrier_worker()
    return accuracy


if __name__ == "__main__":
    main()
