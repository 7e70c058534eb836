"""`DistributedStrategy`: Paddle Fleet's strategy object, holding the flags and the typed configs."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar, overload

from distamp.strategy.amp_config import AmpConfig
from distamp.strategy.checks import as_bool, as_float, as_int, show
from distamp.strategy.config_base import Config
from distamp.strategy.gradient_merge_config import GradientMergeConfig
from distamp.strategy.powersgd_config import PowerSGDConfig
from distamp.strategy.sharding_config import ShardingConfig
from distamp.strategy.views import ConfigView
from distamp.suggest import did_you_mean

__all__ = ["DEFAULT_FUSE_GRAD_SIZE_IN_MB", "DistributedStrategy"]

_MAX_BUCKET_MB = 2**20

DEFAULT_FUSE_GRAD_SIZE_IN_MB = 25
"""``fuse_grad_size_in_MB`` left unset: DDP's 25 MB buckets; sharding stages 1 and 2 size theirs from the model."""

_ATTRS = ("amp", "amp_configs", "gradient_merge", "gradient_merge_configs", "sharding", "sharding_configs",
          "powersgd", "powersgd_configs", "check_replicas_every", "find_unused_parameters", "fuse_grad_size_in_MB")
_DEFAULTS = {"amp": False, "gradient_merge": False, "sharding": False, "powersgd": False,
             "find_unused_parameters": False, "fuse_grad_size_in_MB": DEFAULT_FUSE_GRAD_SIZE_IN_MB,
             "check_replicas_every": 0}


_SHARDING_WITH_POWERSGD = (
    "strategy.sharding and strategy.powersgd cannot both be True: sharding reduce-scatters gradients into "
    "per-rank slices, which PowerSGD's low-rank factors of whole gradients do not fit. Turn one off first "
    "(strategy.sharding = False or strategy.powersgd = False)."
)


_C = TypeVar("_C", bound=Config)


class _ConfigDict(Generic[_C]):
    """``strategy.<name>_configs``: the full effective config as a read-only dict; assign a dict to replace it."""

    def __init__(self, config_type: type[_C]) -> None:
        self.config_type = config_type
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name[:-1]}"  # amp_configs -> _amp_config

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _ConfigDict[_C]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> dict: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _ConfigDict[_C] | dict:
        return self if obj is None else ConfigView(getattr(obj, self.slot))

    def __set__(self, obj: object, value: Mapping) -> None:
        object.__setattr__(obj, self.slot, self.config_type.from_dict(value))


class _TypedConfig(Generic[_C]):
    """``strategy.<name>_config``: the typed config dataclass (read-only: assign ``<name>_configs`` instead)."""

    def __init__(self, config_type: type[_C]) -> None:
        self.config_type = config_type
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _TypedConfig[_C]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _C: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _TypedConfig[_C] | _C:
        return self if obj is None else getattr(obj, self.slot)


def _restore_strategy(state: tuple) -> DistributedStrategy:
    """Unpickle (and deepcopy) a strategy: its configs are frozen and already valid, so rebuilding
    them (and re-emitting warnings) is unnecessary. The copy is not in use (see ``mark_in_use``)."""
    strategy = object.__new__(DistributedStrategy)
    for slot, value in zip(_STATE_SLOTS, state, strict=True):
        object.__setattr__(strategy, slot, value)
    object.__setattr__(strategy, "_in_use_by", None)
    return strategy


# The settings, in the order pickles hold them; "_in_use_by" is not a setting and is never copied.
_STATE_SLOTS = (
    "_amp",
    "_amp_config",
    "_check_replicas_every",
    "_find_unused_parameters",
    "_fuse_grad_size_in_MB",
    "_gradient_merge",
    "_gradient_merge_config",
    "_powersgd",
    "_powersgd_config",
    "_sharding",
    "_sharding_config",
)


class DistributedStrategy:
    """What to apply on top of data parallelism: Paddle Fleet's strategy object.

    Supported attributes (anything else raises ``ValueError``):

    * ``amp`` (bool, False): mixed-precision training.
    * ``amp_configs`` (dict): see :class:`AmpConfig`. Assigning validates
      every key and *replaces* the previous config (unset keys go back to
      their defaults). Reading returns the full effective config as a
      read-only dict; to change one key assign a whole dict, e.g.
      ``s.amp_configs = {**s.amp_configs, "incr_ratio": 4.0}``.
    * ``gradient_merge`` (bool, False) and ``gradient_merge_configs``
      (dict): see :class:`GradientMergeConfig`; same rules as amp_configs.
    * ``sharding`` (bool, False) and ``sharding_configs`` (dict): shard the
      optimizer state over the data-parallel ranks (ZeRO stage 1 or 2); see
      :class:`ShardingConfig`; same rules as amp_configs.
    * ``powersgd`` (bool, False) and ``powersgd_configs`` (dict): low-rank
      gradient compression with error feedback that survives overflows; see
      :class:`PowerSGDConfig`; same rules as amp_configs. Not with ``sharding``.
    * ``find_unused_parameters`` (bool, False): passed to DDP.
    * ``fuse_grad_size_in_MB`` (number > 0, 25): the gradient bucket size of DDP
      and of sharding stages 1 and 2; at the default 25 those stages size
      their buckets from the model (see
      :func:`distamp.sharding.reduce_scatter.reduce_bucket_bytes`).
    * ``check_replicas_every`` (int >= 0, 0): every N applied steps the ranks
      compare a hash of the parameters they hold and stop together when they
      differ (0: off); see :mod:`distamp.distributed.replica_check`.

    ``amp_config``, ``gradient_merge_config``, ``sharding_config`` and ``powersgd_config`` return
    the typed configs.

    Once given to ``fleet.distributed_optimizer`` or ``fleet.distributed_model``
    (:meth:`mark_in_use`), the strategy is in use: an assignment that would
    change a setting raises ``ValueError``; ``copy.deepcopy`` gives a copy
    that is not in use.

    Example::

        strategy = DistributedStrategy()
        strategy.amp = True
        strategy.amp_configs = {"init_loss_scaling": 1024.0, "use_pure_fp16": True}
        strategy.gradient_merge = True
        strategy.gradient_merge_configs = {"k_steps": 4}
        strategy            # DistributedStrategy(amp=True, amp_configs={...}, ...)
        same = DistributedStrategy.from_dict(json.loads(json.dumps(strategy.to_dict())))
        assert same == strategy

    Keyword arguments to the constructor set the same attributes.
    """

    __slots__ = (*_STATE_SLOTS, "_in_use_by")
    # Declared for the type checker only: no values here, which __slots__ would refuse.
    _amp: bool
    _amp_config: AmpConfig
    _check_replicas_every: int
    _find_unused_parameters: bool
    _fuse_grad_size_in_MB: float
    _gradient_merge: bool
    _gradient_merge_config: GradientMergeConfig
    _powersgd: bool
    _powersgd_config: PowerSGDConfig
    _sharding: bool
    _sharding_config: ShardingConfig
    _in_use_by: str | None

    # Mutable, so unhashable; typeshed declares list.__hash__ this way, with the same ignore.
    __hash__: ClassVar[None] = None  # type: ignore[assignment]

    def __init__(self, **attributes: Any) -> None:
        object.__setattr__(self, "_amp", False)
        object.__setattr__(self, "_amp_config", AmpConfig())
        object.__setattr__(self, "_gradient_merge", False)
        object.__setattr__(self, "_gradient_merge_config", GradientMergeConfig())
        object.__setattr__(self, "_sharding", False)
        object.__setattr__(self, "_sharding_config", ShardingConfig())
        object.__setattr__(self, "_powersgd", False)
        object.__setattr__(self, "_powersgd_config", PowerSGDConfig())
        object.__setattr__(self, "_find_unused_parameters", False)
        object.__setattr__(self, "_fuse_grad_size_in_MB", _DEFAULTS["fuse_grad_size_in_MB"])
        object.__setattr__(self, "_check_replicas_every", _DEFAULTS["check_replicas_every"])
        object.__setattr__(self, "_in_use_by", None)
        for name, value in attributes.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ATTRS:
            if self._in_use_by is not None:
                self._refuse_change(name, value)
                return
            object.__setattr__(self, name, value)  # goes through the property setter
            return
        if name in ("amp_config", "gradient_merge_config", "sharding_config", "powersgd_config"):
            raise ValueError(
                f"DistributedStrategy.{name} is read-only; assign a dict to {name}s instead, "
                f"e.g. strategy.{name}s = {{...}}."
            )
        raise ValueError(
            f"DistributedStrategy has no attribute {name!r}.{did_you_mean(name, _ATTRS)} "
            f"distamp supports only: {', '.join(_ATTRS)}. Paddle Fleet's other strategy flags "
            f"(recompute, pipeline, dgc, ...) are not implemented by distamp."
        )

    def mark_in_use(self, by: str) -> bool:
        """Refuse, from now on, any change of a setting: ``by`` (e.g. ``"fleet.distributed_optimizer"``) built on them.

        Returns True when this call put the strategy in use (False when an
        earlier call had).

        What ``fleet.distributed_optimizer`` and ``fleet.distributed_model``
        build reads the settings once (the parameters' dtype, the loss
        scaler, the reducer) or at every step (``auto_cast``, closure
        retries); a later change would reach some of those parts and not the
        others. A copy (``copy.deepcopy``, ``from_dict(to_dict())``) is not in use.
        """
        if self._in_use_by is not None:
            return False
        object.__setattr__(self, "_in_use_by", by)
        return True

    def _refuse_change(self, name: str, value: Any) -> None:
        """Accept an assignment to a strategy in use only when it changes nothing; else raise ``ValueError``."""
        trial = _restore_strategy(tuple(getattr(self, slot) for slot in _STATE_SLOTS))
        setattr(trial, name, value)  # validates the value as usual
        if trial == self:
            return
        raise ValueError(
            f"strategy.{name} = {show(value)} cannot change this strategy: it was given to {self._in_use_by}, "
            f"which has built the optimizer or model on its settings; a change now would reach some of what "
            f"was built and not the rest. Set strategy.{name} before that call, or use a copy for a new "
            f"optimizer and model (copy.deepcopy(strategy) can be changed)."
        )

    # -- flags ---------------------------------------------------------------

    @property
    def amp(self) -> bool:
        """Mixed-precision training on or off (bool, default False)."""
        return self._amp

    @amp.setter
    def amp(self, value: bool) -> None:
        object.__setattr__(self, "_amp", as_bool("strategy", "amp", value))

    @property
    def gradient_merge(self) -> bool:
        """Accumulate gradient_merge_configs['k_steps'] micro-batches per step (bool, default False)."""
        return self._gradient_merge

    @gradient_merge.setter
    def gradient_merge(self, value: bool) -> None:
        object.__setattr__(self, "_gradient_merge", as_bool("strategy", "gradient_merge", value))

    @property
    def sharding(self) -> bool:
        """Shard the optimizer state over the data-parallel ranks as sharding_configs says (bool, default False)."""
        return self._sharding

    @sharding.setter
    def sharding(self, value: bool) -> None:
        value = as_bool("strategy", "sharding", value)
        if value and self._powersgd:
            raise ValueError(_SHARDING_WITH_POWERSGD)
        object.__setattr__(self, "_sharding", value)

    @property
    def powersgd(self) -> bool:
        """Compress gradients with PowerSGD as powersgd_configs says (bool, default False)."""
        return self._powersgd

    @powersgd.setter
    def powersgd(self, value: bool) -> None:
        value = as_bool("strategy", "powersgd", value)
        if value and self._sharding:
            raise ValueError(_SHARDING_WITH_POWERSGD)
        object.__setattr__(self, "_powersgd", value)

    @property
    def find_unused_parameters(self) -> bool:
        """Passed to DistributedDataParallel (bool, default False)."""
        return self._find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        object.__setattr__(self, "_find_unused_parameters", as_bool("strategy", "find_unused_parameters", value))

    @property
    def fuse_grad_size_in_MB(self) -> float:
        """Gradient bucket size in MB (number > 0, default 25; sharding stages 1-2 choose theirs at the default)."""
        return self._fuse_grad_size_in_MB

    @fuse_grad_size_in_MB.setter
    def fuse_grad_size_in_MB(self, value: float) -> None:
        number = as_float("strategy", "fuse_grad_size_in_MB", value, f"a number in (0, {_MAX_BUCKET_MB}]",
                           lambda x: 0 < x <= _MAX_BUCKET_MB)
        if isinstance(value, numbers.Integral):
            number = int(value)
        object.__setattr__(self, "_fuse_grad_size_in_MB", number)

    @property
    def check_replicas_every(self) -> int:
        """Compare the ranks' parameter hashes every N applied steps (int >= 0, default 0: off)."""
        return self._check_replicas_every

    @check_replicas_every.setter
    def check_replicas_every(self, value: int) -> None:
        object.__setattr__(self, "_check_replicas_every", as_int("strategy", "check_replicas_every", value, 0))

    # -- configs -------------------------------------------------------------
    # Each config lives in the slot ``_<name>_config``: ``<name>_configs`` reads it as a read-only dict and
    # replaces it from an assigned dict; ``<name>_config`` returns the typed dataclass.

    amp_configs = _ConfigDict(AmpConfig)
    amp_config = _TypedConfig(AmpConfig)
    gradient_merge_configs = _ConfigDict(GradientMergeConfig)
    gradient_merge_config = _TypedConfig(GradientMergeConfig)
    sharding_configs = _ConfigDict(ShardingConfig)
    sharding_config = _TypedConfig(ShardingConfig)
    powersgd_configs = _ConfigDict(PowerSGDConfig)
    powersgd_config = _TypedConfig(PowerSGDConfig)

    # -- conversion ------------------------------------------------------------

    def to_dict(self) -> dict:
        """Every attribute as plain JSON-serialisable values (configs as full dicts)."""
        return {
            "amp": self.amp,
            "amp_configs": self.amp_config.to_dict(),
            "gradient_merge": self.gradient_merge,
            "gradient_merge_configs": self.gradient_merge_config.to_dict(),
            "sharding": self.sharding,
            "sharding_configs": self.sharding_config.to_dict(),
            "powersgd": self.powersgd,
            "powersgd_configs": self.powersgd_config.to_dict(),
            "find_unused_parameters": self.find_unused_parameters,
            "fuse_grad_size_in_MB": self.fuse_grad_size_in_MB,
            "check_replicas_every": self.check_replicas_every,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> DistributedStrategy:
        """Build a strategy from :meth:`to_dict`'s output (missing keys take defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(  # noqa: TRY004 (bad configuration, as in Config.from_dict)
                f"DistributedStrategy.from_dict needs a dict of strategy attributes; got "
                f"{show(data)} ({type(data).__name__}). Valid keys: {', '.join(_ATTRS)}."
            )
        for key in data:
            if not isinstance(key, str) or key not in _ATTRS:
                raise ValueError(
                    f"DistributedStrategy.from_dict: unknown key {show(key)}.{did_you_mean(key, _ATTRS)} "
                    f"Valid keys: {', '.join(_ATTRS)}."
                )
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return all(getattr(self, slot) == getattr(other, slot) for slot in _STATE_SLOTS)

    def __repr__(self) -> str:
        parts = []
        for name in _ATTRS:
            if name.endswith("_configs"):
                changed = getattr(self, name[:-1]).non_defaults()
                if changed:
                    parts.append(f"{name}={changed!r}")
            elif getattr(self, name) != _DEFAULTS[name]:
                parts.append(f"{name}={getattr(self, name)!r}")
        return f"DistributedStrategy({', '.join(parts)})"

    def __reduce__(self):
        return (_restore_strategy, (tuple(getattr(self, slot) for slot in _STATE_SLOTS),))
