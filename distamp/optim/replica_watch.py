"""When the meta-optimizer runs the replica check, and what it compares in each precision mode.

:class:`ReplicaWatch` is the step side of ``strategy.check_replicas_every``
(the hashing and the collective are :mod:`distamp.distributed.replica_check`).
The step policy tells it each agreed verdict; on every N-th applied step,
before the update, it compares:

* unsharded: each parameter, and beside it its FP32 master where O2 keeps one;
* sharding stages 1 and 2: each (full, all-gathered) parameter; the FP32
  masters are slices that one rank owns;
* stage 3: each parameter as FSDP2 gathered it for this step's forward;

then the loss scaler's state (with AMP). ``0`` turns it off at no cost.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from distamp.core.precision import FullPrecision
from distamp.distributed.groups import group_size
from distamp.distributed.replica_check import GatheredParameterHashes, compare_replicas, tensor_hash
from distamp.optim.model_binding import ModelBinding

__all__ = ["ReplicaWatch"]


class ReplicaWatch:
    """Runs the replica check every ``every`` applied steps (see the module docstring).

    Args:
        every: ``strategy.check_replicas_every`` (0: never).
        precision: the optimizer's precision plugin (what it holds).
        binding: the model's parameter names.
        applied_steps: the number of steps applied so far.
        process_group: the data-parallel group (``None``: the default one).
    """

    def __init__(self, every: int, precision: FullPrecision, binding: ModelBinding,
                 applied_steps: Callable[[], int], process_group: dist.ProcessGroup | None) -> None:
        self.every = every
        self.precision = precision
        self.binding = binding
        self.applied_steps = applied_steps
        self.process_group = process_group
        self.gathered: GatheredParameterHashes | None = None
        self.checks = 0
        """Checks run so far (each one collective)."""
        self.last_held = 0
        """Tensors this rank held and hashed at the last check (at stage 3, those gathered for the forward)."""

    def _due(self, applied_step: int) -> bool:
        return self.every > 0 and applied_step % self.every == 0

    def watch_model(self, model: nn.Module) -> None:
        """Stage 3: hash the parameters ``model``'s FSDP2 units gather in the forward of each check step (once)."""
        if self.every and self.gathered is None and self.precision.stage == 3:
            self.gathered = GatheredParameterHashes(model)
            self.follow_step_count()

    def follow_step_count(self) -> None:
        """The applied-step count was restored (``load_state_dict``): arm stage 3's hooks for the step it makes next."""
        if self.gathered is not None:
            self.gathered.arm(self._due(self.applied_steps() + 1))

    def on_verdict(self, applied: bool, step: int) -> None:
        """The ranks agreed to apply (or skip) step ``step``: on a check step compare, before the update.

        Raises:
            ReplicaDivergenceError: on every rank, when the ranks differ.
        """
        if not self.every:
            return
        applied_step = self.applied_steps() + 1
        try:
            if applied and self._due(applied_step) and group_size(self.process_group) > 1:
                names, hashes = self._what_to_compare()
                params = self.precision.master_weights.model_params
                device = params[0].device if params else torch.device("cpu")
                self.checks += 1
                self.last_held = sum(h is not None for h in hashes)
                compare_replicas(names, hashes, step=step, applied_step=applied_step, group=self.process_group,
                                 device=device)
        finally:
            if self.gathered is not None:
                self.gathered.clear()
                # The next forward belongs to the step after this one if this one is applied, else to it again.
                self.gathered.arm(self._due(applied_step + 1 if applied else applied_step))

    def _what_to_compare(self) -> tuple[list[str], list[torch.Tensor | None]]:
        masters = self.precision.master_weights
        names: list[str] = []
        hashes: list[torch.Tensor | None] = []
        params = masters.model_params
        param_names = [self.binding.name_of(p, i) for i, p in enumerate(params)]
        if self.precision.stage == 3:
            if self.gathered is not None:
                names = [f"{name} (as gathered for the forward)" for name in param_names]
                hashes = self.gathered.hashes_of(param_names)
        else:
            sharded = self.precision.stage in (1, 2)
            with torch.no_grad():
                for name, p in zip(param_names, params, strict=True):
                    names.append(name)
                    hashes.append(tensor_hash(p))
                    master = p if sharded else masters.master_for(p)
                    if master is not p:
                        names.append(f"{name} (FP32 master)")
                        hashes.append(tensor_hash(master))
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            state = scaler.state_dict()
            if state:
                device = params[0].device if params else torch.device("cpu")
                names.append(f"the loss scaler's state ({', '.join(state)})")
                hashes.append(tensor_hash(torch.tensor([float(v) for v in state.values()], dtype=torch.float64,
                                                       device=device)))
        return names, hashes
