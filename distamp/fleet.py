"""The Fleet-style facade: ``from distamp import fleet``.

Example::

    from distamp import fleet
    fleet.init()
    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 32768.0, "use_pure_fp16": True}
    model = Net().to(fleet.device())
    optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    model = fleet.distributed_model(model)
    for x, y in loader:
        with fleet.auto_cast():
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        optimizer.minimize(loss)
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from distamp.amp.auto_cast import auto_cast as _auto_cast
from distamp.amp.deferred_autocast import DeferredAutocast
from distamp.distributed.process_group import (
    SELECTED_GPUS_VAR,
    WorldInfo,
    default_device,
    init_process_group,
    select_device,
    validate_timeout,
    world_info_from_env,
    world_info_from_group,
)
from distamp.model.data_parallel import DataParallel
from distamp.model.ddp_preparation import refuse_stage3_kwargs
from distamp.model.forward_weight_writes import check_forward_weight_writes
from distamp.model.sparse_gradients import refuse_sparse_gradients
from distamp.optim.optimizer import AmpOptimizer
from distamp.strategy import DistributedStrategy
from distamp.strategy.applicability import check_applicable, check_same_strategy, warn_of_inert_configs

if TYPE_CHECKING:
    from distamp.sharding.fully_sharded import FullyShardedModel

__all__ = [
    "DistributedStrategy",
    "auto_cast",
    "barrier_worker",
    "device",
    "distributed_model",
    "distributed_optimizer",
    "init",
    "is_first_worker",
    "local_rank",
    "worker_index",
    "worker_num",
]


_T = TypeVar("_T")


class _Built(Generic[_T]):
    """Objects fleet built, held weakly and iterated in the order they were built.

    The order is the same on every rank, so the collectives that tying an
    optimizer to a model runs (``attach_optimizer``) come in the same order
    everywhere; a ``WeakSet`` iterates in order of memory address, which
    differs between processes.
    """

    def __init__(self) -> None:
        self._objects: weakref.WeakValueDictionary[int, _T] = weakref.WeakValueDictionary()
        self._numbers = itertools.count()

    def add(self, obj: _T) -> None:
        """Hold ``obj`` (weakly) after those added before it."""
        self._objects[next(self._numbers)] = obj

    def __iter__(self) -> Iterator[_T]:
        return iter(list(self._objects.values()))


@dataclass
class _FleetState:
    """What ``init`` learned and which objects fleet has built since."""

    world: WorldInfo | None = None
    group_timeout: timedelta | None = None  # of the group init created, if it did
    strategy: DistributedStrategy | None = None
    optimizers: _Built[Any] = field(default_factory=_Built)  # AmpOptimizer
    models: _Built[Any] = field(default_factory=_Built)  # DataParallel or FullyShardedModel


_state = _FleetState()


def init(
    role_maker: Any = None,
    is_collective: bool = True,
    strategy: DistributedStrategy | None = None,
    log_level: int | str | None = None,
    timeout: float | timedelta | None = None,
) -> None:
    """Join the job described by the launcher's environment.

    Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (set by
    ``distrun`` or ``torchrun``) and creates the process group: NCCL when
    CUDA is available (after selecting ``cuda:LOCAL_RANK``), gloo otherwise.
    Without those variables (``python train.py``) it creates a one-process
    group, so ``DistributedSampler`` and ``torch.distributed`` calls work
    unchanged; ``distributed_model`` then calls the model directly, without
    DDP. A group that already exists (e.g. created under ``mp.spawn``) is
    used as it is, and with CUDA ``cuda:LOCAL_RANK`` becomes the current
    device (:func:`device`; for a group without LOCAL_RANK, this rank's
    index on its host). Calling it again is harmless.

    Args:
        role_maker: Paddle's argument; only ``None`` is supported.
        is_collective: Paddle's argument; distamp is collective only, so it
            must be True.
        strategy: the default strategy for ``distributed_optimizer``,
            ``distributed_model`` and ``auto_cast``.
        log_level: level for the ``distamp`` logger: a name (``"DEBUG"``,
            ``"INFO"``, ``"WARNING"``, ``"ERROR"``, ``"CRITICAL"``, any case)
            or a ``logging`` int. ``"INFO"`` shows loss-scale changes and
            skipped steps. ``None`` leaves the level alone (warnings and
            above show).
        timeout: how long a collective or the rendezvous store may wait
            before raising, in seconds or as a ``datetime.timedelta``
            (positive, finite). ``None`` is 30 minutes for NCCL and gloo
            alike (torch's NCCL default of 10 minutes aborts jobs whose
            rank 0 saves or compiles while the others wait). It applies to
            the group ``init`` creates; a group that already exists keeps
            its own.

    Logs: unless logging is already configured (the ``distamp`` logger or
    the root logger has a handler), ``init`` gives the ``distamp`` logger
    one stderr handler whose lines start with ``[rankN]``.
    """
    if role_maker is not None:
        raise ValueError(
            f"role_maker={role_maker!r} is not supported: distamp reads the job from the "
            "environment set by distrun/torchrun; call fleet.init() without it"
        )
    if is_collective is not True:
        raise ValueError(
            f"is_collective={is_collective!r}: distamp supports collective (data-parallel) "
            "training only; parameter-server mode is not available. Use is_collective=True"
        )
    if strategy is not None and not isinstance(strategy, DistributedStrategy):
        raise TypeError(
            f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}"
        )
    group_timeout = validate_timeout(timeout)
    level = _validate_log_level(log_level)
    world = world_info_from_env()
    existed = dist.is_available() and dist.is_initialized()
    if existed and timeout is not None and group_timeout != _state.group_timeout:
        warnings.warn(
            f"fleet.init(timeout={timeout!r}) is not applied: a process group already exists and "
            "keeps its own timeout; pass it to the call that creates the group",
            stacklevel=2,
        )
    if init_process_group(world, group_timeout) and not existed:
        _state.group_timeout = group_timeout
    if dist.is_available() and dist.is_initialized() and not world.from_env:
        # A group created by the user (e.g. mp.spawn): its ranks, and each one's place on its host.
        # Learnt once per group: the host-name exchange is collective, and init may be called again.
        known = _state.world
        group_place = (dist.get_rank(), dist.get_world_size())
        if known is None or known.from_env or (known.rank, known.world_size) != group_place:
            known = world_info_from_group(group_timeout)
        world = known
    if existed:
        # A group made before init (mp.spawn, or the script's own init_process_group) was made without
        # selecting this rank's GPU here: select it now, as for a group init creates.
        select_device(world.local_rank)
    _state.world = world
    if level is not None:
        logging.getLogger("distamp").setLevel(level)
    _attach_log_handler(world.rank)
    if strategy is not None:
        _state.strategy = strategy


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _validate_log_level(log_level: int | str | None) -> int | None:
    """``log_level`` as a ``logging`` int (``None`` stays ``None``)."""
    if log_level is None:
        return None
    if isinstance(log_level, bool) or not isinstance(log_level, (int, str)):
        raise TypeError(
            f"log_level must be a level name or a logging int, got {type(log_level).__name__} "
            f"{log_level!r}; e.g. log_level=\"INFO\""
        )
    if isinstance(log_level, str):
        if log_level.upper() not in _LOG_LEVELS:
            raise ValueError(
                f"log_level={log_level!r} is not a logging level; use one of "
                f"{', '.join(_LOG_LEVELS)} (or a logging int such as logging.INFO)"
            )
        return getattr(logging, log_level.upper())
    if log_level < 0:
        raise ValueError(f"log_level={log_level!r} must be >= 0 (e.g. logging.INFO, which is 20)")
    return log_level


def _attach_log_handler(rank: int) -> None:
    """Give the ``distamp`` logger a stderr handler with a rank prefix, unless logging is configured.

    The package itself only adds a ``NullHandler`` (a library must not print
    on import), and that handler also keeps Python's last-resort handler
    from printing warnings, so without this nothing distamp logs is seen.
    A user who configured logging (any handler on ``distamp`` or the root)
    keeps their setup: records propagate to their handlers.
    """
    logger = logging.getLogger("distamp")
    if any(not isinstance(h, logging.NullHandler) for h in logger.handlers) or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()  # stderr
    # Under distrun each rank's output has its own file and the console tee prefixes "[rankN]: "
    # already; elsewhere (torchrun, mp.spawn) the prefix tells the ranks apart.
    prefix = "" if SELECTED_GPUS_VAR in os.environ else f"[rank{rank}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)


def _world() -> WorldInfo:
    if _state.world is None:
        init()
    world = _state.world
    assert world is not None, "fleet.init() sets the world"
    return world


def _strategy(strategy: DistributedStrategy | None) -> DistributedStrategy:
    """The strategy a fleet call builds on: ``strategy``, else the latest one, else a default one."""
    if strategy is not None:
        if not isinstance(strategy, DistributedStrategy):
            raise TypeError(
                f"strategy must be a fleet.DistributedStrategy, got {type(strategy).__name__}"
            )
        return strategy
    return _state.strategy if _state.strategy is not None else DistributedStrategy()


def _adopt(strategy: DistributedStrategy, by: str) -> None:
    """Once ``by`` has built on ``strategy``: it is in use, and the latest (``auto_cast`` follows it).

    Not before: a call that refuses its strategy leaves the latest one as it was. The first call to build
    on a strategy warns of any configs it sets for a feature that is off.
    """
    if strategy.mark_in_use(by):
        warn_of_inert_configs(strategy)
    _state.strategy = strategy


def distributed_optimizer(
    optimizer: torch.optim.Optimizer, strategy: DistributedStrategy | None = None
) -> AmpOptimizer:
    """Wrap ``optimizer`` in the AMP meta-optimizer described by ``strategy``.

    In O2 (``use_pure_fp16``) the parameters given to ``optimizer`` are
    converted to the low-precision dtype and the optimizer is given FP32
    masters. Parameters that O2 keeps in FP32 (normalization layers,
    ``custom_black_varnames`` modules) get their exact FP32 values back as
    soon as the model is known: at ``distributed_model`` (either order of the
    two calls works) or, without it, at the model's first forward.
    ``strategy`` (or, when None, the one given to ``init``) becomes the latest
    strategy, which ``auto_cast`` follows. From then on the strategy's
    settings cannot change (``ValueError``): what was built here follows them.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "build it on the model's parameters first, e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    world = _world()
    strategy = _strategy(strategy)
    check_applicable(strategy, world.world_size)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    models = [m for m in _state.models if m.owns_any(params)]
    # Stage 3 converts nothing: FSDP2 casts each all-gather to the 16-bit param_dtype.
    pure = strategy.amp and strategy.amp_config.use_pure_fp16 and not _fully_sharded(strategy)
    for model in models:
        if isinstance(model, DataParallel) and model.strategy_is_default and model.strategy is not strategy:
            refuse_sparse_gradients(model.module, strategy)
            model.follow_strategy(strategy)  # distributed_model came first, before any strategy was known
        check_same_strategy(strategy, model.strategy)
        model.check_attachable(changes_dtypes=pure)
    opt = AmpOptimizer(optimizer, strategy)
    _adopt(strategy, "fleet.distributed_optimizer")
    _state.optimizers.add(opt)
    for model in models:
        model.attach_optimizer(opt)
    return opt


def _optimizers_of(model: nn.Module) -> list[Any]:
    """The optimizers fleet built on any of ``model``'s parameters, in the order they were built."""
    own = {id(p) for p in model.parameters()}
    return [opt for opt in _state.optimizers if any(id(p) in own for p in opt.master_weights.model_params)]


def _fully_sharded(strategy: DistributedStrategy) -> bool:
    return strategy.sharding and strategy.sharding_config.stage == 3


def distributed_model(
    model: nn.Module, strategy: DistributedStrategy | None = None, **kwargs: Any
) -> DataParallel | FullyShardedModel:
    """Make ``model`` data parallel over the group created by ``init``.

    Returns a :class:`~distamp.model.data_parallel.DataParallel` (DDP
    underneath, built at the first forward); ``model.module`` is the
    original model. ``strategy`` (default: the latest one) decides the wire
    dtype and the FP32 modules; other keyword arguments go to DDP
    (``find_unused_parameters``, ``static_graph``, ...). The model must
    already be on :func:`device` (``model.to(fleet.device())``): a
    parameter or buffer elsewhere raises ``ValueError`` naming it.

    With ``sharding_configs = {"stage": 3}`` it returns a
    :class:`~distamp.sharding.fully_sharded.FullyShardedModel` instead:
    the model is sharded now with torch's FSDP2 (collective: every rank
    calls it), on the units ``sharding_configs["units"]`` names (default:
    the model's repeated blocks); no DDP, so of DDP's keyword arguments
    only ``broadcast_buffers`` and ``forward_sync_buffers`` (torch 2.13+)
    are taken, the others are refused.

    From then on the strategy's settings cannot change (``ValueError``), as
    with ``distributed_optimizer``.
    """
    if not isinstance(model, nn.Module):  # before anything reads it as one
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    world = _world()
    default = strategy is None and _state.strategy is None
    strategy = _strategy(strategy)
    check_applicable(strategy, world.world_size)
    refuse_sparse_gradients(model, strategy)
    check_forward_weight_writes(model, world.world_size, _fully_sharded(strategy))
    if "device" in kwargs:
        raise ValueError(
            f"fleet.distributed_model(..., device={kwargs['device']!r}): the model trains on fleet.device() "
            f"({device()} here: cuda:LOCAL_RANK with CUDA, else the CPU); move it there with "
            "model.to(fleet.device()) and remove device="
        )
    optimizers = _optimizers_of(model)
    for opt in optimizers:
        check_same_strategy(opt.strategy, strategy)
    if _fully_sharded(strategy):
        refuse_stage3_kwargs(kwargs)
        # Imported here: FSDP2's private communication interfaces load only when stage 3 is used.
        from distamp.amp.model_precision import ForwardPrecision
        from distamp.sharding.fully_sharded import FullyShardedModel

        sharded = FullyShardedModel(model, strategy, ForwardPrecision(strategy), device=device(), **kwargs)
        _adopt(strategy, "fleet.distributed_model")
        for opt in list(_state.optimizers):
            if sharded.owns_any(opt.master_weights.model_params):
                sharded.attach_optimizer(opt)
        _state.models.add(sharded)
        return sharded
    wrapped = DataParallel(model, strategy, device=device(), **kwargs)
    wrapped.strategy_is_default = default
    _adopt(strategy, "fleet.distributed_model")
    wrapped.attach_optimizers(optimizers)
    _state.models.add(wrapped)
    return wrapped


def auto_cast(enable: bool = True) -> contextlib.AbstractContextManager:
    """Op-level mixed precision from the latest strategy: ``torch.autocast`` on ``device()``.

    The strategy is read each time the region is *entered*, not when
    ``auto_cast()`` is called: a context built once at start-up, before
    ``distributed_optimizer`` gave the strategy, and entered every step
    (``ctx = fleet.auto_cast()`` ... ``with ctx:``) casts from the first
    step after the strategy exists. The object is reusable and re-entrant.

    On entry, the dtype and the custom op lists come from the strategy given
    to ``init`` or ``distributed_optimizer`` (the latest); the device type is
    that of :func:`device`. With default lists the region is exactly
    ``torch.autocast(device().type, dtype)``. An entry while no strategy was
    given yet, or while the latest one has ``amp`` off, does nothing;
    ``enable=False`` switches autocast off inside an enabled region.
    """
    if not isinstance(enable, bool):
        raise TypeError(f"auto_cast(enable=...) must be True or False, got {enable!r}")
    return DeferredAutocast(lambda: _autocast_region(enable), _inactive_reason)


def _autocast_region(enable: bool) -> contextlib.AbstractContextManager | None:
    """The region ``auto_cast(enable)`` enters now: from the latest strategy; ``None`` when AMP is off."""
    strategy = _state.strategy
    if strategy is None or not strategy.amp:
        # Switching off what is not on is nothing to report (see _inactive_reason).
        return None if enable else contextlib.nullcontext()
    cfg = strategy.amp_config
    return _auto_cast(
        enable=enable,
        dtype=cfg.dtype,
        custom_white_list=cfg.custom_white_list,
        custom_black_list=cfg.custom_black_list,
        device_type=device().type,
    )


def _inactive_reason() -> str:
    if _state.strategy is None:
        return ("no strategy had been given yet (fleet.init(strategy=...) or fleet.distributed_optimizer(..., "
                "strategy))")
    return "the latest strategy (given to fleet.init or fleet.distributed_optimizer) has amp off"


def worker_index() -> int:
    """This worker's global rank."""
    return _world().rank


def worker_num() -> int:
    """The number of workers in the job."""
    return _world().world_size


def local_rank() -> int:
    """This worker's rank on its host."""
    return _world().local_rank


def device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    return default_device(_world().local_rank)


def is_first_worker() -> bool:
    """True on global rank 0."""
    return worker_index() == 0


def barrier_worker() -> None:
    """Wait until every worker reaches this point (no-op in one process)."""
    _world()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
