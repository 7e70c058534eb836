"""Checkpoints that survive a killed job: atomic, verified, rotated, rank-consistent.

A training loop saves every N steps and resumes from the newest usable
checkpoint at start-up::

    from distamp import fleet
    from distamp.checkpoint import load_latest_checkpoint, save_checkpoint

    fleet.init()
    model = Net().to(fleet.device())
    optimizer = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters()), strategy)
    model = fleet.distributed_model(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)

    info = load_latest_checkpoint("ckpt", model=model, optimizer=optimizer, scheduler=scheduler)
    step = info.step if info is not None else 0
    epoch = info.extra["epoch"] if info is not None else 0
    while step < total_steps:
        ...                                      # one training step
        step += 1
        if step % 100 == 0:                      # on every rank: it is collective
            save_checkpoint("ckpt", step, model=model, optimizer=optimizer,
                            scheduler=scheduler, extra={"epoch": epoch})

On disk, checkpoint ``N`` is a manifest and the payload files it names::

    ckpt/
      step-00000200.json                          the manifest: the commit point
      step-00000200.common.5d1c0e2b9a7f4c31.pt    the payload, one torch.save

The manifest (JSON) records the format (``distamp.checkpoint/2``), the step,
the world size, and per payload file its part, name, size and SHA-256, plus
``manifest_sha256``, a SHA-256 over its own content. A payload's name
carries the first 16 hex digits of its SHA-256, so a payload cannot be
swapped under a manifest without the manifest, its checksum and the name
all changing together (this catches accidents, not forgery).

A save writes the payload (temporary file, fsync, rename, directory fsync)
under a name no earlier content had, then the manifest the same way: that
rename commits the checkpoint. Only then are older checkpoints beyond
``keep`` and the files the new manifest replaced removed. So a crash at any
point, even while the same step is saved again, leaves the previous
committed checkpoint intact; a save that fails removes what it wrote.

Every checkpoint has the part ``common``, written by rank 0. With
``strategy.sharding`` each rank also writes its share of the optimizer
state (stages 1 and 2: its slice) as its own part ``rank-<R>`` (e.g.
``step-00000200.rank-00003.<hash>.pt``), with the slice's range in the flat
parameter space; rank 0 commits one manifest listing every part once all
are written, and nothing is gathered to rank 0. A reader verifies and
loads only the parts it needs: the common one and the saved slices that
overlap its own, so any world size, sharded or not, can resume any
checkpoint (:mod:`distamp.checkpoint.flat_state` re-slices). Sharding stage 3
(FSDP2) puts its DTensors (the model's FP32 parameters, which are also the
O2 masters, and the optimizer's per-element state) on
``torch.distributed.checkpoint`` (DCP, :mod:`~distamp.checkpoint.dcp_tensors`):
each rank writes its own shards into ``step-<N>.dcp-<nonce>/`` (one
``__<rank>_0.distcp`` per rank, and DCP's ``.metadata``), gathering
nothing, and the common part holds the rest with a slot where each of
those tensors goes. The manifest lists every DCP file with its size and
SHA-256, so the commit, the verification and the rotation cover them like
any payload. A stage-3 checkpoint loads at any world size and stage,
sharded or not: DCP reads into each rank's own shards at stage 3 (nothing
whole is made), whole tensors otherwise; and any checkpoint loads at stage
3.
The common payload also records the qualified name, shape and param group
of each parameter in the order the optimizer state numbers them
(:mod:`~distamp.checkpoint.param_names`), so a model that defines its
parameters in another order resumes with each one's own optimizer state.
Manifests of format ``distamp.checkpoint/1`` (``step-<N>.pt`` payloads) are
still read.

Loading reads the manifest and checks its checksum, the payload's size and
SHA-256, then ``torch.load(..., weights_only=True)`` (a stage-3 checkpoint's
DCP files: their sizes and SHA-256, then ``dcp.load``, which unpickles
``.metadata``: load those only from directories you trust). A checkpoint that
cannot be read is skipped, on every rank, with a warning naming the file,
the reason and the step, in favour of the next older one; one that reads but does
not fit the model or optimizer raises on every rank.

Rank 0 writes (and each rank its own part when sharded); every rank reads, so on several nodes ``directory`` must be
on a file system every node sees (NFS, Lustre, ...). Both functions are
collective when ``torch.distributed`` is initialised: call them on every
rank, at the same point of the loop. The ranks wait for each other on the
process group's store with a timeout of their own (30 minutes by default,
``timeout=``), not in collectives bounded by the process group's timeout.
"""

from __future__ import annotations

from .load import CheckpointInfo, load_latest_checkpoint
from .save import save_checkpoint
from .storage import list_checkpoints

__all__ = ["CheckpointInfo", "list_checkpoints", "load_latest_checkpoint", "save_checkpoint"]
