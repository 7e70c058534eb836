"""Strategy settings the chosen data-parallel path would ignore: refused before any collective.

Each key is validated on its own when assigned; whether it does anything
depends on the others (sharding stage, AMP) and on the world size, known
only when ``fleet.distributed_optimizer`` / ``fleet.distributed_model`` run.
:func:`check_applicable` refuses, there, a setting the path would accept and
silently ignore:

============================  =========================================================
setting                        applies to
============================  =========================================================
gradient_predivide_factor      the all-reduce without sharding (AMP, PowerSGD), 1..world
find_unused_parameters=True    DDP (no sharding, stage 1, PowerSGD) and stage 2's reducer
fuse_grad_size_in_MB           DDP's buckets, stages 1 and 2's buckets, PowerSGD
============================  =========================================================

Stage 3 (FSDP2) reduce-scatters unit by unit (``sharding_configs["units"]``),
with the sum taken in FP32.

:func:`warn_of_inert_configs` warns of a feature's configs set while the
feature is off (Paddle Fleet ignores them without a word).

:func:`check_same_strategy` refuses a meta-optimizer and a model wrapper
given different strategies (one of the two fleet calls without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distamp.user_warning import warn_user

if TYPE_CHECKING:
    from distamp.strategy.distributed_strategy import DistributedStrategy

__all__ = ["check_applicable", "check_same_strategy", "warn_of_inert_configs"]


def check_applicable(strategy: DistributedStrategy, world_size: int) -> None:
    """``ValueError`` for a setting of ``strategy`` that a ``world_size``-rank job would ignore or refuse later.

    Raises:
        ValueError: naming the key, its value and why, for: ``amp_configs
            ['gradient_predivide_factor']`` with sharding (any stage) or
            above ``world_size``; ``find_unused_parameters=True`` or a
            ``fuse_grad_size_in_MB`` other than 25 with sharding stage 3.
    """
    from distamp.strategy.distributed_strategy import DEFAULT_FUSE_GRAD_SIZE_IN_MB as default_bucket_mb

    stage = _stage(strategy)
    factor = strategy.amp_config.gradient_predivide_factor
    if strategy.amp and factor is not None:
        if stage:
            raise ValueError(
                f"amp_configs['gradient_predivide_factor']={factor!r} applies only without sharding (the "
                f"all-reduce of plain data parallelism and of PowerSGD); sharding stage {stage} reduce-scatters "
                "gradients with the sum taken in FP32, which cannot overflow, and divides by the world size "
                f"{'before the wire cast, as None does' if stage < 3 else 'as FSDP2 does'}. Remove the key (or "
                "set it to None)"
            )
        if world_size > 1 and factor > world_size:
            raise ValueError(
                f"amp_configs['gradient_predivide_factor']={factor!r} must be between 1 and the world size "
                f"{world_size}: the gradients are divided by it before the all-reduce and by world_size / factor "
                "after. Lower it, or remove the key (None: the world size)"
            )
    if stage != 3:
        return
    if strategy.find_unused_parameters:
        raise ValueError(
            "strategy.find_unused_parameters=True has no effect with sharding stage 3: it is DDP's option, and "
            "stage 3 uses no DDP (torch's FSDP2 reduce-scatters each unit's gradients after its backward). "
            "Set it to False"
        )
    if strategy.fuse_grad_size_in_MB != default_bucket_mb:
        raise ValueError(
            f"strategy.fuse_grad_size_in_MB={strategy.fuse_grad_size_in_MB!r} has no effect with sharding stage "
            "3: FSDP2 all-gathers and reduce-scatters one unit at a time, so sharding_configs['units'] decides "
            f"what travels together. Leave it at its default {default_bucket_mb}, or choose the units instead"
        )


# Read by one side only: the model wrapper (DDP's options) or the meta-optimizer (the replica check).
_ONE_SIDED = ("find_unused_parameters", "fuse_grad_size_in_MB", "check_replicas_every")
_FEATURE_OF = {"amp_configs": "amp", "gradient_merge_configs": "gradient_merge", "sharding_configs": "sharding",
               "powersgd_configs": "powersgd"}


def warn_of_inert_configs(strategy: DistributedStrategy) -> None:
    """A ``UserWarning`` for each ``<feature>_configs`` set away from its defaults while ``<feature>`` is False.

    Nothing reads those configs while their flag is off, so a job that set
    ``sharding_configs = {"stage": 2}`` and forgot ``sharding = True`` would
    otherwise train unsharded without a word.
    """
    for configs, feature in _FEATURE_OF.items():
        if getattr(strategy, feature):
            continue
        changed = getattr(strategy, configs[:-1]).non_defaults()
        if changed:
            settings = ", ".join(f"{key}={value!r}" for key, value in changed.items())
            warn_user(
                f"strategy.{configs} has no effect: strategy.{feature} is False, so distamp reads none of "
                f"{configs} (set away from the defaults: {settings}). Set strategy.{feature} = True, or leave "
                f"{configs} unset."
            )


def _stage(strategy: DistributedStrategy) -> int:
    """The sharding stage, 0 without sharding."""
    return strategy.sharding_config.stage if strategy.sharding else 0


def _effective(strategy: DistributedStrategy, other: DistributedStrategy) -> dict[str, object]:
    """``strategy``'s settings by name (``amp_configs['dtype']``), leaving out configs neither strategy turns on."""
    values: dict[str, object] = {}
    for name, value in strategy.to_dict().items():
        if isinstance(value, dict):
            feature = _FEATURE_OF[name]
            if getattr(strategy, feature) or getattr(other, feature):
                values.update({f"{name}[{key!r}]": item for key, item in value.items()})
        else:
            values[name] = value
    return {name: value for name, value in values.items() if name not in _ONE_SIDED}


def check_same_strategy(optimizer_strategy: DistributedStrategy, model_strategy: DistributedStrategy) -> None:
    """``ValueError`` when a meta-optimizer and the model wrapper it is tied to follow different settings.

    Both act on the same gradients: the model forwards (O2's FP32 modules)
    and communicates them (the wire dtype, PowerSGD), the optimizer scales
    the loss, unscales and steps, and ``fleet.auto_cast`` follows whichever
    strategy was given last. A strategy given to only one of the two calls
    (the other taking the default, AMP off) would run FP16 autocast without
    loss scaling. Settings only one side reads are not compared, nor are
    the others when the sharding stages differ (the stage checks report that).

    Raises:
        ValueError: naming each differing setting with both values.
    """
    if optimizer_strategy is model_strategy or _stage(optimizer_strategy) != _stage(model_strategy):
        return  # the stage checks name the stages (model/ddp_preparation, core/precision, sharding/fully_sharded)
    ours, theirs = _effective(optimizer_strategy, model_strategy), _effective(model_strategy, optimizer_strategy)
    differing = [f"{name}: optimizer {ours.get(name)!r}, model {theirs.get(name)!r}"
                 for name in ours if ours[name] != theirs.get(name)]
    if differing:
        raise ValueError(
            "fleet.distributed_optimizer and fleet.distributed_model were given different strategies for the "
            f"same model ({'; '.join(differing)}); the optimizer and the model act on the same gradients, so "
            "they must follow the same settings. Pass the same strategy to both calls (or to fleet.init and to "
            "neither call)"
        )
