"""`DistributedStrategy` and the validated configs behind it.

Paddle Fleet users write ``strategy.amp_configs = {...}`` with plain dicts;
distamp keeps those names but stores each config in a frozen, typed
dataclass validated when it is built, so a typo or an out-of-range value
fails at the assignment line, not thousands of steps later::

    from distamp import fleet

    strategy = fleet.DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"init_loss_scaling": 1024.0, "use_pure_fp16": True}
    strategy.amp_config.init_loss_scaling      # 1024.0, typed
    strategy.amp_configs = {"init_loss_scale": 1.0}
    # ValueError: amp_configs has no key 'init_loss_scale'. Did you mean
    # 'init_loss_scaling'? ...
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from distamp.suggest import did_you_mean

__all__ = [
    "AmpConfig",
    "DistributedStrategy",
    "GradientMergeConfig",
    "ShardingConfig",
    "validate_dtype",
    "validate_op_lists",
]

_INT64_MAX = 2**63 - 1  # counters and patience may live in int64 tensors
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the scale is a float32 tensor
_MAX_BUCKET_MB = 2**20
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


# --------------------------------------------------------------------------
# Value checks shared by the configs. Each returns the normalised value or
# raises ValueError naming ``owner[key]``, the value and what is allowed.
# --------------------------------------------------------------------------


def _show(value: Any) -> str:
    """``repr(value)`` that cannot fail or flood the message (huge ints, odd objects)."""
    try:
        text = repr(value)
    except (ValueError, TypeError, AttributeError, RuntimeError, RecursionError):
        # repr of a 5000-digit int raises ValueError in Python >= 3.11
        if isinstance(value, int):
            return f"<int with {value.bit_length()} bits>"
        text = object.__repr__(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _where(owner: str, key: str) -> str:
    """How messages name a setting: ``strategy.amp``, ``amp_configs['dtype']`` or ``auto_cast(dtype=...)``."""
    if owner == "strategy":
        return f"strategy.{key}"
    if owner.endswith("()"):
        return f"{owner[:-1]}{key}=...)"
    return f"{owner}[{key!r}]"


def _fail(owner: str, key: str, value: Any, allowed: str, hint: str = "") -> None:
    raise ValueError(f"{_where(owner, key)} must be {allowed}; got {_show(value)}.{hint}")


def _as_bool(owner: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(owner, key, value, "a bool (True or False)")
    return value


def _as_int(owner: str, key: str, value: Any, low: int) -> int:
    allowed = f"an int >= {low} (at most 2**63 - 1)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(owner, key, value, allowed)
    number = int(value)
    if not low <= number <= _INT64_MAX:
        _fail(owner, key, value, allowed)
    return number


def _as_float(owner: str, key: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    """A finite float (ints accepted, bools not) for which ``ok`` holds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(owner, key, value, allowed)
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):  # float(10**400) overflows
        number = math.inf
    if not math.isfinite(number) or not ok(number):
        _fail(owner, key, value, allowed)
    return number


def _as_choice(owner: str, key: str, value: Any, choices: tuple[str, ...], dtypes: bool = False) -> str:
    if dtypes and isinstance(value, torch.dtype) and _DTYPE_NAMES.get(value) in choices:
        return _DTYPE_NAMES[value]
    if isinstance(value, str) and value in choices:
        return value
    allowed = "one of " + ", ".join(repr(c) for c in choices)
    if dtypes:
        allowed += " (or the matching torch dtype)"
    hint = ""
    if isinstance(value, str):
        alias = _DTYPE_ALIASES.get(value.lower()) if dtypes else None
        hint = f" Did you mean {alias!r}?" if alias in choices else did_you_mean(value, choices)
    _fail(owner, key, value, allowed, hint)
    return ""  # unreachable; keeps type checkers quiet


def _as_names(owner: str, key: str, value: Any, what: str) -> tuple[str, ...]:
    """A list or tuple of non-empty strings, stored as a tuple."""
    allowed = f"a list of {what} (non-empty strings)"
    if isinstance(value, str):
        _fail(owner, key, value, allowed, f" Wrap a single name in a list: [{value!r}].")
    if not isinstance(value, (list, tuple)):
        _fail(owner, key, value, allowed)
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(
                f"{_where(owner, key)} must be {allowed}; got {_show(value)}, "
                f"whose item {_show(item)} is not a non-empty string."
            )
    return tuple(value)


def _canonical_ops(owner: str, key: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """Canonical op names (``"torch.matmul"`` -> ``"matmul"``); unknown and in-place ones raise."""
    if not names:
        return names
    # Imported here, not at module level: distamp.amp imports this module.
    from distamp.amp.op_names import (
        canonical_op_name,
        is_inplace_op_name,
        known_op_names,
    )

    known = known_op_names()
    canonical = tuple(canonical_op_name(name) for name in names)
    for name, op in zip(names, canonical):
        if op not in known:
            hint = did_you_mean(op, known) or " Ops are torch function names such as 'matmul' or 'softmax'."
            raise ValueError(
                f"{_where(owner, key)} contains {name!r}, which is not an op distamp knows.{hint} "
                f"The full list is distamp.amp.op_names.known_op_names()."
            )
        if is_inplace_op_name(op):
            raise ValueError(
                f"{_where(owner, key)} contains {name!r}, an in-place op: in-place ops write into their "
                f"input and keep its dtype, as under torch.autocast. List the out-of-place op "
                f"{op.rstrip('_')!r} instead."
            )
    return canonical


def validate_op_lists(owner: str, white: Any, black: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Check a custom white and black list; returns them as tuples of canonical op names.

    ``owner`` names the caller in messages (``"amp_configs"``, ``"auto_cast()"``).

    Raises:
        ValueError: not a list of strings, an unknown or in-place op (with the
            closest valid name), or an op on both lists (after expanding aliases
            such as ``"conv"``).
    """
    from distamp.amp.op_names import expand_op_names

    lists = []
    for key, value in (("custom_white_list", white), ("custom_black_list", black)):
        lists.append(_canonical_ops(owner, key, _as_names(owner, key, value, "op names")))
    both = sorted(expand_op_names(lists[0]) & expand_op_names(lists[1]))
    if both:
        raise ValueError(
            f"{_where(owner, 'custom_white_list')} and {_where(owner, 'custom_black_list')} both contain "
            f"{both!r}; an op can be forced to only one precision. Remove it from one of the lists."
        )
    return lists[0], lists[1]


def validate_dtype(owner: str, key: str, value: Any) -> str:
    """``"float16"`` or ``"bfloat16"`` from a name or a torch dtype; anything else raises ValueError."""
    return _as_choice(owner, key, value, ("float16", "bfloat16"), dtypes=True)


def _user_stacklevel() -> int:
    """Stack level of the first frame outside this module (and dataclass __init__)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename in (__file__, "<string>"):
        frame, level = frame.f_back, level + 1
    return level


# --------------------------------------------------------------------------
# Typed configs.
# --------------------------------------------------------------------------


class _Config:
    """Dict conversion shared by the config dataclasses."""

    _OWNER: ClassVar[str] = ""
    _RETIRED: ClassVar[Mapping] = {}  # Paddle keys distamp does not implement -> advice

    @classmethod
    def from_dict(cls, mapping: Any):
        """Build from a dict of keys; unknown keys raise ValueError with a suggestion.

        Unset keys take their defaults. An instance of the class is returned as is.
        """
        if isinstance(mapping, cls):
            return mapping
        names = [f.name for f in fields(cls)]
        if not isinstance(mapping, Mapping):
            # DESIGN.md section 2: any bad configuration, wrong types included, is a ValueError.
            raise ValueError(  # noqa: TRY004
                f"{cls._OWNER} must be a dict of config keys; got {_show(mapping)} "
                f"({type(mapping).__name__}). Valid keys: {', '.join(names)}."
            )
        for key in mapping:
            if not isinstance(key, str) or key not in names:
                advice = cls._RETIRED.get(key, "") if isinstance(key, str) else ""
                hint = f" {advice}" if advice else did_you_mean(key, names)
                raise ValueError(
                    f"{cls._OWNER} has no key {_show(key)}.{hint} Valid keys: {', '.join(names)}."
                )
        return cls(**mapping)

    def to_dict(self) -> dict:
        """Every key with its value; tuples become lists so the dict is plain JSON."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def non_defaults(self) -> dict:
        """Only the keys whose value differs from the default, as in :meth:`to_dict`."""
        default = type(self)().to_dict()
        return {k: v for k, v in self.to_dict().items() if v != default[k]}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class AmpConfig(_Config):
    """Mixed-precision settings: the typed form of ``strategy.amp_configs``.

    Keys and defaults are Paddle Fleet's (DESIGN.md section 2) plus
    ``comm_dtype``, ``gradient_predivide_factor`` and ``stuck_scale_patience``.
    Every field is validated on construction; a bad one raises ``ValueError``
    naming it, the value and what is allowed. Lists are stored as tuples.

    Example::

        cfg = AmpConfig(init_loss_scaling=1024.0, custom_black_list=["softmax"])
        cfg.torch_dtype                      # torch.float16
        AmpConfig.from_dict({"dtype": "bfloat16"}).to_dict()["dtype"]   # 'bfloat16'

    With ``dtype="bfloat16"`` the loss scale is fixed at 1.0; setting the
    loss-scaling keys to non-default values then emits one ``UserWarning``.
    """

    _OWNER: ClassVar[str] = "amp_configs"
    _RETIRED: ClassVar[Mapping] = {
        "use_pure_bf16": "distamp spells it dtype='bfloat16' with use_pure_fp16=True.",
        "use_fp16_guard": "distamp has no static-graph guard; keep modules in FP32 with custom_black_varnames.",
        "use_bf16_guard": "distamp has no static-graph guard; keep modules in FP32 with custom_black_varnames.",
        "use_optimizer_fp16": "distamp always keeps optimizer state in FP32.",
    }

    init_loss_scaling: float = 32768.0
    """First loss scale (> 0); the whole scale when use_dynamic_loss_scaling is False."""
    use_dynamic_loss_scaling: bool = True
    """False: the scale stays at init_loss_scaling."""
    incr_every_n_steps: int = 1000
    """Consecutive finite steps before the scale grows (>= 1)."""
    decr_every_n_nan_or_inf: int = 2
    """Consecutive non-finite steps before the scale shrinks (>= 1)."""
    incr_ratio: float = 2.0
    """Growth factor (> 1)."""
    decr_ratio: float = 0.5
    """Shrink factor, in (0, 1)."""
    custom_white_list: tuple[str, ...] = ()
    """Ops forced to low precision."""
    custom_black_list: tuple[str, ...] = ()
    """Ops forced to FP32; sharing an op with custom_white_list is an error."""
    custom_black_varnames: tuple[str, ...] = ()
    """Module-name patterns of submodules kept entirely in FP32."""
    use_pure_fp16: bool = False
    """True is "O2" (low-precision weights, FP32 masters); False is "O1"."""
    dtype: str = "float16"
    """"float16" or "bfloat16" (torch dtypes are accepted and stored as names)."""
    loss_scaling_algorithm: str = "backoff"
    """Dynamic algorithm: "backoff" (Paddle) or "lognormal" (OpenSeq2Seq LogMax)."""
    min_loss_scaling: float = 1.0
    """Lower bound of the dynamic scale."""
    max_loss_scaling: float = 2.0**24
    """Upper bound of the dynamic scale."""
    comm_dtype: str | None = None
    """Wire dtype of the gradient all-reduce: None means dtype; else "float16", "bfloat16", "float32"."""
    gradient_predivide_factor: float | None = None
    """Divide gradients by this (>= 1, at most the world size) before the all-reduce and by
    world/factor after; None means the world size (everything pre-divided, no FP16 overflow)."""
    stuck_scale_patience: int = 20
    """Consecutive skipped steps at the minimum scale before raising an error (>= 1)."""
    keep_norm_fp32: bool = True
    """O2: keep the parameters of normalization layers (BatchNorm, SyncBatchNorm, InstanceNorm, LayerNorm,
    GroupNorm, RMSNorm) in FP32, as Paddle's and Apex's O2 do; their inputs and outputs stay 16-bit."""
    check_nan_inf: bool = False
    """Paddle's FLAGS_check_nan_inf: check every module's forward output and every local gradient before
    communication; the first non-finite one raises FloatingPointError naming it, the rank, the step and the
    dtype. Costs a host sync per module and per parameter: for debugging."""
    overflow_retries: int = 0
    """With ``optimizer.step(closure)``: an overflowing step lowers the scale at once and calls the closure
    again, up to this many times, on every rank together, so the batch is not dropped (>= 0)."""

    def __post_init__(self) -> None:
        own, put = self._OWNER, self._put
        scale = "a finite float > 0 within float32 range (the scale is a float32 tensor)"
        for key in ("init_loss_scaling", "min_loss_scaling", "max_loss_scaling"):
            put(key, _as_float(own, key, getattr(self, key), scale, lambda x: 0 < x <= _FLOAT32_MAX))
        put("use_dynamic_loss_scaling", _as_bool(own, "use_dynamic_loss_scaling", self.use_dynamic_loss_scaling))
        put("incr_every_n_steps", _as_int(own, "incr_every_n_steps", self.incr_every_n_steps, 1))
        put("decr_every_n_nan_or_inf", _as_int(own, "decr_every_n_nan_or_inf", self.decr_every_n_nan_or_inf, 1))
        put("incr_ratio", _as_float(own, "incr_ratio", self.incr_ratio, "a finite float > 1", lambda x: x > 1))
        put("decr_ratio", _as_float(own, "decr_ratio", self.decr_ratio, "a float in (0, 1)", lambda x: 0 < x < 1))
        put("custom_black_varnames", _as_names(own, "custom_black_varnames", self.custom_black_varnames,
                                               "module-name patterns"))
        put("use_pure_fp16", _as_bool(own, "use_pure_fp16", self.use_pure_fp16))
        put("dtype", validate_dtype(own, "dtype", self.dtype))
        put("loss_scaling_algorithm",
            _as_choice(own, "loss_scaling_algorithm", self.loss_scaling_algorithm, ("backoff", "lognormal")))
        if self.comm_dtype is not None:
            put("comm_dtype", _as_choice(own, "comm_dtype", self.comm_dtype, ("float16", "bfloat16", "float32"),
                                         dtypes=True))
        if self.gradient_predivide_factor is not None:
            put("gradient_predivide_factor", _as_float(own, "gradient_predivide_factor",
                                                       self.gradient_predivide_factor,
                                                       "None or a finite float >= 1 (and at most the world size)",
                                                       lambda x: x >= 1))
        put("stuck_scale_patience", _as_int(own, "stuck_scale_patience", self.stuck_scale_patience, 1))
        put("keep_norm_fp32", _as_bool(own, "keep_norm_fp32", self.keep_norm_fp32))
        put("check_nan_inf", _as_bool(own, "check_nan_inf", self.check_nan_inf))
        put("overflow_retries", _as_int(own, "overflow_retries", self.overflow_retries, 0))
        self._check_op_lists()
        self._check_scale_bounds()
        self._warn_unused_scaling_keys()

    def _put(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)  # frozen: normalise once, here

    def _check_op_lists(self) -> None:
        white, black = validate_op_lists(self._OWNER, self.custom_white_list, self.custom_black_list)
        self._put("custom_white_list", white)
        self._put("custom_black_list", black)

    def _check_scale_bounds(self) -> None:
        own, low, high = self._OWNER, self.min_loss_scaling, self.max_loss_scaling
        if low > high:
            raise ValueError(
                f"{own}['min_loss_scaling'] = {low!r} is greater than {own}['max_loss_scaling'] = "
                f"{high!r}; the bounds must satisfy min_loss_scaling <= max_loss_scaling."
            )
        if self.use_dynamic_loss_scaling and not low <= self.init_loss_scaling <= high:
            raise ValueError(
                f"{own}['init_loss_scaling'] = {self.init_loss_scaling!r} is outside "
                f"[min_loss_scaling, max_loss_scaling] = [{low!r}, {high!r}]; with dynamic loss "
                f"scaling the scale must start inside its bounds. Change init_loss_scaling or the bounds."
            )

    def _warn_unused_scaling_keys(self) -> None:
        if self.dtype != "bfloat16":
            return
        default = AmpConfig()
        ignored = [f"{k}={getattr(self, k)!r}" for k in _LOSS_SCALING_KEYS if getattr(self, k) != getattr(default, k)]
        if ignored:
            warnings.warn(
                f"amp_configs: with dtype='bfloat16' the loss scale is fixed at 1.0 (BF16 has FP32's "
                f"range), so these loss-scaling settings have no effect: {', '.join(ignored)}. "
                f"Remove them, or use dtype='float16' for dynamic loss scaling.",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The low-precision dtype as a torch dtype (torch.float16 or torch.bfloat16)."""
        return getattr(torch, self.dtype)

    @property
    def comm_torch_dtype(self) -> torch.dtype:
        """Wire dtype of gradient communication: comm_dtype, or dtype when it is None."""
        return getattr(torch, self.comm_dtype or self.dtype)


_LOSS_SCALING_KEYS = (
    "init_loss_scaling", "use_dynamic_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf",
    "incr_ratio", "decr_ratio", "loss_scaling_algorithm", "min_loss_scaling", "max_loss_scaling",
)


@dataclass(frozen=True)
class GradientMergeConfig(_Config):
    """Gradient merge (accumulation): the typed form of ``strategy.gradient_merge_configs``.

    Example::

        cfg = GradientMergeConfig.from_dict({"k_steps": 4})
        cfg.k_steps, cfg.avg                 # (4, True)
    """

    _OWNER: ClassVar[str] = "gradient_merge_configs"

    k_steps: int = 1
    """Micro-batches accumulated before one communication and optimizer step (>= 1)."""
    avg: bool = True
    """True: the merged gradient is the mean of the k_steps micro-batch gradients; False: their sum."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_steps", _as_int(self._OWNER, "k_steps", self.k_steps, 1))
        object.__setattr__(self, "avg", _as_bool(self._OWNER, "avg", self.avg))


@dataclass(frozen=True)
class ShardingConfig(_Config):
    """Sharded optimizer state (ZeRO): the typed form of ``strategy.sharding_configs``.

    Each rank owns a balanced contiguous slice of the flat parameter space
    and keeps the FP32 masters, the FP32 gradients and the inner optimizer's
    state of that slice only (ZeRO, https://arxiv.org/abs/1910.02054).

    Example::

        cfg = ShardingConfig.from_dict({"stage": 2})
        cfg.stage                            # 2
    """

    _OWNER: ClassVar[str] = "sharding_configs"
    _STAGES: ClassVar[tuple[int, ...]] = (1, 2)

    stage: int = 1
    """1: optimizer state, FP32 masters and FP32 gradients sharded, gradients all-reduced;
    2: gradients reduce-scattered instead (16-bit on the wire, summed in FP32)."""

    def __post_init__(self) -> None:
        value = self.stage
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) not in self._STAGES:
            hint = " Stage 3 (sharded parameters) is not implemented; stage 2 saves the most memory." if (
                not isinstance(value, bool) and value == 3) else ""
            _fail(self._OWNER, "stage", value, "one of " + ", ".join(str(s) for s in self._STAGES), hint)
        object.__setattr__(self, "stage", int(value))


# --------------------------------------------------------------------------
# Read-only views returned by strategy.amp_configs, gradient_merge_configs and
# sharding_configs.
# Writing into them would be silently lost (the typed config is the source
# of truth), so every mutation raises and says how to do it instead.
# --------------------------------------------------------------------------


def _read_only_message(owner: str, key: Any = None) -> str:
    example = f"{{**strategy.{owner}, {key!r}: ...}}" if key is not None else f"{{**strategy.{owner}, 'key': ...}}"
    return (
        f"strategy.{owner} is a read-only view of the effective config; assign a whole dict "
        f"instead, e.g. strategy.{owner} = {example}"
    )


class _ReadOnlyList(list):
    """A list value inside a config view; mutation raises TypeError."""

    def __init__(self, items, owner: str, key: str) -> None:
        super().__init__(items)
        self._message = _read_only_message(owner, key)

    def _refuse(self, *args, **kwargs):
        raise TypeError(self._message)

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse

    def __reduce__(self):
        return (list, (list(self),))  # copies are ordinary, editable lists


class _ConfigView(dict):
    """The full effective config as a dict; mutation raises TypeError."""

    def __init__(self, config: _Config) -> None:
        owner = config._OWNER
        super().__init__(
            (k, _ReadOnlyList(v, owner, k) if isinstance(v, list) else v) for k, v in config.to_dict().items()
        )
        self._owner = owner

    def _refuse(self, key: Any = None, *args, **kwargs):
        raise TypeError(_read_only_message(self._owner, key if isinstance(key, str) else None))

    __setitem__ = __delitem__ = setdefault = pop = _refuse

    def update(self, *args, **kwargs):
        self._refuse()

    def clear(self):
        self._refuse()

    def popitem(self):
        self._refuse()

    def __ior__(self, other):
        self._refuse()

    def copy(self) -> dict:
        """An ordinary, editable dict (with ordinary lists) to change and assign back."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self.items()}

    def __reduce__(self):
        return (dict, (self.copy(),))


# --------------------------------------------------------------------------
# The strategy.
# --------------------------------------------------------------------------

_ATTRS = ("amp", "amp_configs", "gradient_merge", "gradient_merge_configs", "sharding", "sharding_configs",
          "find_unused_parameters", "fuse_grad_size_in_MB")
_DEFAULTS = {"amp": False, "gradient_merge": False, "sharding": False, "find_unused_parameters": False,
             "fuse_grad_size_in_MB": 25}


def _restore_strategy(state: tuple) -> DistributedStrategy:
    # Used by pickle/deepcopy: the configs are frozen and already valid, so
    # rebuilding them (and re-emitting warnings) is unnecessary.
    strategy = object.__new__(DistributedStrategy)
    for slot, value in zip(DistributedStrategy.__slots__, state):
        object.__setattr__(strategy, slot, value)
    return strategy


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
    * ``find_unused_parameters`` (bool, False): passed to DDP.
    * ``fuse_grad_size_in_MB`` (number > 0, 25): DDP's gradient bucket size.

    ``amp_config``, ``gradient_merge_config`` and ``sharding_config`` return
    the typed configs.

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

    __slots__ = (
        "_amp",
        "_amp_config",
        "_find_unused_parameters",
        "_fuse_grad_size_in_MB",
        "_gradient_merge",
        "_gradient_merge_config",
        "_sharding",
        "_sharding_config",
    )
    __hash__ = None  # mutable

    def __init__(self, **attributes: Any) -> None:
        object.__setattr__(self, "_amp", False)
        object.__setattr__(self, "_amp_config", AmpConfig())
        object.__setattr__(self, "_gradient_merge", False)
        object.__setattr__(self, "_gradient_merge_config", GradientMergeConfig())
        object.__setattr__(self, "_sharding", False)
        object.__setattr__(self, "_sharding_config", ShardingConfig())
        object.__setattr__(self, "_find_unused_parameters", False)
        object.__setattr__(self, "_fuse_grad_size_in_MB", _DEFAULTS["fuse_grad_size_in_MB"])
        for name, value in attributes.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ATTRS:
            object.__setattr__(self, name, value)  # goes through the property setter
            return
        if name in ("amp_config", "gradient_merge_config", "sharding_config"):
            raise ValueError(
                f"DistributedStrategy.{name} is read-only; assign a dict to {name}s instead, "
                f"e.g. strategy.{name}s = {{...}}."
            )
        raise ValueError(
            f"DistributedStrategy has no attribute {name!r}.{did_you_mean(name, _ATTRS)} "
            f"distamp supports only: {', '.join(_ATTRS)}. Paddle Fleet's other strategy flags "
            f"(recompute, pipeline, dgc, ...) are not implemented by distamp."
        )

    # -- flags ---------------------------------------------------------------

    @property
    def amp(self) -> bool:
        """Mixed-precision training on or off (bool, default False)."""
        return self._amp

    @amp.setter
    def amp(self, value: bool) -> None:
        object.__setattr__(self, "_amp", _as_bool("strategy", "amp", value))

    @property
    def gradient_merge(self) -> bool:
        """Accumulate gradient_merge_configs['k_steps'] micro-batches per step (bool, default False)."""
        return self._gradient_merge

    @gradient_merge.setter
    def gradient_merge(self, value: bool) -> None:
        object.__setattr__(self, "_gradient_merge", _as_bool("strategy", "gradient_merge", value))

    @property
    def sharding(self) -> bool:
        """Shard the optimizer state over the data-parallel ranks as sharding_configs says (bool, default False)."""
        return self._sharding

    @sharding.setter
    def sharding(self, value: bool) -> None:
        object.__setattr__(self, "_sharding", _as_bool("strategy", "sharding", value))

    @property
    def find_unused_parameters(self) -> bool:
        """Passed to DistributedDataParallel (bool, default False)."""
        return self._find_unused_parameters

    @find_unused_parameters.setter
    def find_unused_parameters(self, value: bool) -> None:
        object.__setattr__(self, "_find_unused_parameters", _as_bool("strategy", "find_unused_parameters", value))

    @property
    def fuse_grad_size_in_MB(self) -> float:
        """DDP gradient bucket size in MB (number > 0, default 25)."""
        return self._fuse_grad_size_in_MB

    @fuse_grad_size_in_MB.setter
    def fuse_grad_size_in_MB(self, value: float) -> None:
        number = _as_float("strategy", "fuse_grad_size_in_MB", value, f"a number in (0, {_MAX_BUCKET_MB}]",
                           lambda x: 0 < x <= _MAX_BUCKET_MB)
        if isinstance(value, numbers.Integral):
            number = int(value)
        object.__setattr__(self, "_fuse_grad_size_in_MB", number)

    # -- configs -------------------------------------------------------------

    @property
    def amp_configs(self) -> dict:
        """The full effective AMP config as a read-only dict; assign a dict to replace it."""
        return _ConfigView(self._amp_config)

    @amp_configs.setter
    def amp_configs(self, value: Mapping) -> None:
        object.__setattr__(self, "_amp_config", AmpConfig.from_dict(value))

    @property
    def amp_config(self) -> AmpConfig:
        """The typed AMP config (read-only)."""
        return self._amp_config

    @property
    def gradient_merge_configs(self) -> dict:
        """The full effective gradient-merge config as a read-only dict; assign a dict to replace it."""
        return _ConfigView(self._gradient_merge_config)

    @gradient_merge_configs.setter
    def gradient_merge_configs(self, value: Mapping) -> None:
        object.__setattr__(self, "_gradient_merge_config", GradientMergeConfig.from_dict(value))

    @property
    def gradient_merge_config(self) -> GradientMergeConfig:
        """The typed gradient-merge config (read-only)."""
        return self._gradient_merge_config

    @property
    def sharding_configs(self) -> dict:
        """The full effective sharding config as a read-only dict; assign a dict to replace it."""
        return _ConfigView(self._sharding_config)

    @sharding_configs.setter
    def sharding_configs(self, value: Mapping) -> None:
        object.__setattr__(self, "_sharding_config", ShardingConfig.from_dict(value))

    @property
    def sharding_config(self) -> ShardingConfig:
        """The typed sharding config (read-only)."""
        return self._sharding_config

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
            "find_unused_parameters": self.find_unused_parameters,
            "fuse_grad_size_in_MB": self.fuse_grad_size_in_MB,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> DistributedStrategy:
        """Build a strategy from :meth:`to_dict`'s output (missing keys take defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(  # noqa: TRY004 (bad configuration, as in _Config.from_dict)
                f"DistributedStrategy.from_dict needs a dict of strategy attributes; got "
                f"{_show(data)} ({type(data).__name__}). Valid keys: {', '.join(_ATTRS)}."
            )
        for key in data:
            if not isinstance(key, str) or key not in _ATTRS:
                raise ValueError(
                    f"DistributedStrategy.from_dict: unknown key {_show(key)}.{did_you_mean(key, _ATTRS)} "
                    f"Valid keys: {', '.join(_ATTRS)}."
                )
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return all(getattr(self, slot) == getattr(other, slot) for slot in self.__slots__)

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
        return (_restore_strategy, (tuple(getattr(self, slot) for slot in self.__slots__),))
