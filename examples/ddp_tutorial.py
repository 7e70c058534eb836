"""PyTorch's DDP tutorial trainer, converted to distamp AMP as the README shows.

The structure is that of the torchrun script in the "distributed data
parallel" tutorial series of pytorch/examples (a ``Trainer`` with a random
dataset, a ``DistributedSampler`` and snapshots); every line distamp
changes carries a ``# distamp:`` comment. Run it like the original::

    distrun --nproc_per_node 2 examples/ddp_tutorial.py 10 2        # total_epochs save_every
    distrun --nproc_per_node 2 examples/ddp_tutorial.py 10 2 --pure_fp16 --dtype bfloat16
    python examples/ddp_tutorial.py 3 1                             # one process, no launcher

The snapshot holds FP32 weights in every mode (in O2 the model itself is
16-bit; the snapshot comes from the optimizer's FP32 masters). Each precision
mode has its own default snapshot, ``runs/tutorial/<o1|o2>-<dtype>/snapshot.pt``
(e.g. ``o1-float16`` for the first command above, ``o2-bfloat16`` for the
second): the optimizer state of one mode does not load into another, so a
rerun resumes the snapshot of its own mode.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from distamp import fleet  # distamp: replaces torch.distributed's init and DDP


class MyTrainDataset(Dataset):
    """``size`` random (20 features, 1 target) pairs, the same on every rank."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.size = size
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index]


class Trainer:
    """Trains one model on this rank's shard; rank 0 saves snapshots.

    Args:
        model: the model, on this process's device.
        train_data: a loader over a ``DistributedSampler``.
        optimizer: the inner torch optimizer.
        save_every: epochs between snapshots.
        snapshot_path: where rank 0 writes them.
        strategy: distamp's strategy (AMP settings).
    """

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int, snapshot_path: str, strategy: fleet.DistributedStrategy) -> None:
        self.gpu_id = fleet.device()  # distamp: cuda:LOCAL_RANK, or the CPU
        self.train_data = train_data
        self.optimizer = fleet.distributed_optimizer(optimizer, strategy)  # distamp: the AMP meta-optimizer
        self.model = fleet.distributed_model(model)  # distamp: instead of DDP(model, device_ids=[gpu_id])
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location="cpu", weights_only=True)
        self.model.module.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])  # distamp: masters, loss scale
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        with fleet.auto_cast():  # distamp: op-level mixed precision
            output = self.model(source)
            loss = F.mse_loss(output, targets)
        self.optimizer.backward(loss)  # distamp: scaled backward (was loss.backward())
        self.optimizer.step()  # distamp: unscale, inf/NaN agreed by every rank, step or skip
        return loss.item()

    def _run_epoch(self, epoch: int) -> float:
        batch_size = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {batch_size} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        losses = []
        for source, targets in self.train_data:
            losses.append(self._run_batch(source.to(self.gpu_id), targets.to(self.gpu_id)))
        return sum(losses) / len(losses)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.optimizer.fp32_state_dict(self.model),  # distamp: FP32 in every mode
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> float:
        """Run the remaining epochs; returns the last epoch's mean loss on this rank."""
        loss = float("nan")
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if fleet.is_first_worker() and epoch % self.save_every == 0:  # distamp: was gpu_id == 0
                self._save_snapshot(epoch)
        return loss


def main(argv: list[str] | None = None) -> float:
    """The tutorial's ``main``: returns the final mean loss on this rank."""
    parser = argparse.ArgumentParser(description="simple distributed training job, with distamp AMP")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default=None,
                        help="default: runs/tutorial/<o1|o2>-<dtype>/snapshot.pt, one per precision mode")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--pure_fp16", action="store_true", help="O2: 16-bit weights, FP32 masters")
    args = parser.parse_args(argv)
    if args.snapshot_path is None:  # distamp: O1 and O2 snapshots hold different optimizer state
        mode = f"{'o2' if args.pure_fp16 else 'o1'}-{args.dtype}"
        args.snapshot_path = os.path.join("runs", "tutorial", mode, "snapshot.pt")

    strategy = fleet.DistributedStrategy()  # distamp: what AMP does, set once
    strategy.amp = True
    strategy.amp_configs = {"dtype": args.dtype, "use_pure_fp16": args.pure_fp16}
    fleet.init(is_collective=True, strategy=strategy)  # distamp: was init_process_group(backend="nccl")
    os.makedirs(os.path.dirname(os.path.abspath(args.snapshot_path)), exist_ok=True)

    torch.manual_seed(0)
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1).to(fleet.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    train_data = DataLoader(dataset, batch_size=args.batch_size, pin_memory=torch.cuda.is_available(),
                            shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot_path, strategy)
    loss = trainer.train(args.total_epochs)
    print(f"final mean loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
