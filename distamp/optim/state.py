"""The meta-optimizer's checkpoint state: tensors and plain numbers only.

``AmpOptimizer.state_dict()`` holds the inner optimizer's class name and
state, the FP32 masters (O2), the loss scaler's type and state, the step counters and
(``strategy.powersgd``) this rank's compressor state, so
``torch.load(..., weights_only=True)`` reads it back and a resumed run
continues bitwise like an uninterrupted one.

At sharding stage 3 ``state_dict()`` gathers the DTensor state whole
(collective); ``local_state_dict()`` (``optimizer_state(opt, local=True)``)
holds this rank's shards instead, with their layout under ``"sharding"``,
and is what checkpoints save (see :mod:`distamp.sharding.dtensor_state`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from distamp.compression.powersgd import fit_state_to_world
from distamp.core.precision import FullPrecision
from distamp.distributed.groups import group_rank, group_size
from distamp.optim.accumulation import GradientMerge
from distamp.optim.step_policy import StepPolicy
from distamp.strategy import DistributedStrategy
from distamp.user_warning import warn_user


class StatefulOptimizer(Protocol):
    """What checkpoint state reads and writes of a meta-optimizer (``AmpOptimizer`` satisfies it)."""

    policy: StepPolicy
    inner_opt: torch.optim.Optimizer
    precision: FullPrecision
    merge: GradientMerge
    strategy: DistributedStrategy

    @property
    def master_weights(self) -> Any: ...
    _pending_compressor_state: dict | None

    def state_dict(self) -> dict: ...

    def local_state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

__all__ = ["STATE_FORMAT", "check_optimizer_state", "load_optimizer_state", "optimizer_state",
           "refuse_pending_gradients"]

STATE_FORMAT = "distamp.AmpOptimizer/1"


def optimizer_state(opt: StatefulOptimizer, *, local: bool = False) -> dict:
    """``opt.state_dict()`` (``local``: ``opt.local_state_dict()``): see the module docstring."""
    policy = opt.policy
    precision, inner = opt.precision.checkpoint_state(opt.inner_opt, local)
    sharding = {"sharding": precision["sharding"]} if "sharding" in precision else {}
    compressor = opt.policy.compressor
    compressor_state = compressor.state_dict() if compressor is not None else opt._pending_compressor_state
    powersgd = {"powersgd": compressor_state} if compressor_state is not None else {}
    return {
        **powersgd,
        **sharding,
        "format": STATE_FORMAT,
        "inner_type": type(opt.inner_opt).__name__,
        "inner": inner,
        "master_weights": precision.get("master_weights", []),
        "loss_scaler_type": precision["loss_scaler_type"],
        "loss_scaler": precision["loss_scaler"],
        "counters": {
            "steps_applied": policy.steps_applied,
            "steps_skipped": policy.steps_skipped,
            "consecutive_stuck": opt.precision.consecutive_stuck,
            "micro_steps": opt.merge.micro_steps,
            "retries": policy.retries,
            **policy.overflow.state_dict(),
        },
    }


def check_optimizer_state(opt: StatefulOptimizer, state_dict: Any) -> None:
    """Raise unless ``opt`` can take ``state_dict`` now: checks what :func:`load_optimizer_state` checks
    before it loads anything (no gradients waiting for their step, a distamp state, the inner optimizer class,
    ``use_pure_fp16``), changing nothing.

    Raises:
        RuntimeError: gradients of an ``optimizer.backward`` wait for their
            ``step()`` (see :func:`refuse_pending_gradients`).
        ValueError: not a distamp optimizer state, or saved around another
            inner optimizer class or with another ``use_pure_fp16``.
    """
    refuse_pending_gradients(opt)
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        how = ("use optimizer.inner_opt.load_state_dict(...)" if opt.precision.stage not in (1, 2) else
               f"at sharding stage {opt.precision.stage} the inner optimizer holds this rank's slice, which a whole "
               "torch state does not fit: load it with sharding off (optimizer.inner_opt.load_state_dict(...)), "
               "save with distamp.checkpoint.save_checkpoint, and resume that checkpoint here, which re-slices it")
        raise ValueError(
            f"not a distamp AmpOptimizer state_dict (keys: {keys}); to load a bare torch optimizer's state {how}"
        )
    _check_inner_type(opt, state_dict.get("inner_type"))
    masters = state_dict["master_weights"]
    if bool(masters) != opt.master_weights.enabled:
        raise ValueError(
            "checkpoint and optimizer disagree on use_pure_fp16 (O2 master weights "
            f"{'present' if masters else 'absent'} in the checkpoint); build the optimizer "
            "with the strategy the checkpoint was saved with"
        )


def load_optimizer_state(opt: StatefulOptimizer, state_dict: dict) -> None:
    """``opt.load_state_dict(state_dict)``; the model copies of the masters are refreshed.

    The next step starts afresh: nothing is unscaled yet, misuse detection
    compares with the loaded gradients, and sync listeners hear the merge
    window's position.

    Raises:
        ValueError: not a distamp optimizer state, or saved around another
            inner optimizer class, with another loss scaler or another
            ``use_pure_fp16``.
        RuntimeError: called between ``optimizer.backward`` and the
            ``step()`` that applies its gradients (see
            :func:`refuse_pending_gradients`).
    """
    check_optimizer_state(opt, state_dict)
    opt.precision.load_checkpoint_state(opt.inner_opt, state_dict)
    counters, policy = state_dict["counters"], opt.policy
    policy.steps_applied = int(counters["steps_applied"])
    policy.steps_skipped = int(counters["steps_skipped"])
    same_scaler = state_dict["loss_scaler_type"] == opt.precision.scaler_kind
    opt.precision.consecutive_stuck = int(counters["consecutive_stuck"]) if same_scaler else 0
    opt.merge.micro_steps = int(counters["micro_steps"])
    if opt.merge.is_accumulating:  # saved by optimizer.state_dict() in the middle of a window
        warn_user(
            f"the loaded optimizer state was saved inside a gradient-merge window (micro-batch "
            f"{opt.merge.micro_steps} of {opt.merge.k_steps}); the gradients accumulated before it were not saved, "
            "so this window's step applies only the micro-batches run from now on. Save after the step that "
            "completes a window"
        )
    policy.retries = int(counters.get("retries", 0))
    policy.overflow.load_state_dict(counters)
    _load_compressor_state(opt, state_dict.get("powersgd"))
    policy.unscaled = False
    policy.watch.after_step()  # the loaded state is the baseline misuse detection compares with
    opt.merge.publish()


def refuse_pending_gradients(opt: StatefulOptimizer) -> None:
    """``RuntimeError`` when gradients of an ``optimizer.backward`` wait for their ``step()``.

    They were scaled by the loss scale of the state being replaced, and a
    PowerSGD step's error feedback is computed from that state; a load keeps
    neither, and takes the gradients present as the baseline the next
    ``step()`` compares with, which would then find nothing new and drop
    them. A backward whose gradients were changed since (zeroed) has nothing
    pending.
    """
    policy = opt.policy
    if not (policy.unscaled or policy.watch.kept_since_backward()):
        return
    if opt.merge.is_accumulating:
        where = f"inside a gradient-merge window (micro-batch {opt.merge.micro_steps} of {opt.merge.k_steps})"
        fate = "the window's step would apply them to the loaded state with its scale"
    else:
        where = "before the step() that applies them"
        fate = "the next step() would find nothing new and drop them"
    raise RuntimeError(
        f"optimizer state loaded (optimizer.load_state_dict, load_latest_checkpoint) after optimizer.backward(loss), "
        f"{where}: those gradients were "
        f"scaled by the loss scale of the state being replaced (with PowerSGD, compressed with its error "
        f"feedback), and {fate}. Load the state before backward() or after step() (a checkpoint: after the step "
        "that completes a window)"
    )


def _check_inner_type(opt: StatefulOptimizer, saved: Any) -> None:
    """``ValueError`` when the state was saved around another inner optimizer class.

    torch's ``Optimizer.load_state_dict`` checks only the parameter counts,
    so AdamW's state loads into SGD (which then fails at its first step on
    a missing ``momentum``) or into Adam (which then trains with AdamW's
    hyperparameters as L2 decay): refused here, before anything is loaded.
    States saved before the class was recorded (no ``inner_type``) load as
    they did.
    """
    own = type(opt.inner_opt).__name__
    if saved is not None and saved != own:
        raise ValueError(
            f"the saved optimizer state is of an AmpOptimizer around {saved}, this one is around {own}; "
            f"give fleet.distributed_optimizer the saving run's optimizer class, {saved}"
        )


def _load_compressor_state(opt: StatefulOptimizer, state: dict | None) -> None:
    """This rank's PowerSGD state, to its compressor now or when ``fleet.distributed_model`` builds it.

    A checkpoint marker without the state, or a strategy without
    ``powersgd``, leaves the compressor as it is. State held for a
    compressor not built yet is fitted to the world size now (error
    feedback of another world size dropped, with its one warning). One
    process builds no compressor (there is no DDP to hook), so there the
    state is dropped whole: saved again, it would pass another world size's
    state off as this job's.
    """
    if state is None or "format" not in state or not opt.strategy.powersgd:
        return
    compressor = opt.policy.compressor
    if compressor is not None:
        compressor.load_state_dict(state)
        return
    world_size = group_size(opt.policy.process_group)
    state = fit_state_to_world(state, world_size, group_rank(opt.policy.process_group))
    opt._pending_compressor_state = state if world_size > 1 else None
