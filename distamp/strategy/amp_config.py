"""`AmpConfig`: the typed, validated form of ``strategy.amp_configs``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from distamp.strategy.checks import (
    FLOAT32_MAX,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_names,
)
from distamp.strategy.config_base import Config
from distamp.strategy.op_checks import validate_dtype, validate_op_lists
from distamp.user_warning import warn_user

__all__ = ["AmpConfig"]

_LOSS_SCALING_KEYS = (
    "init_loss_scaling", "use_dynamic_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf",
    "incr_ratio", "decr_ratio", "loss_scaling_algorithm", "min_loss_scaling", "max_loss_scaling",
    "overflow_retries",  # a retry lowers the scale first, and a fixed one cannot fall
)
_BACKOFF_KEYS = ("incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio")
"""The settings of Paddle's backoff counters, which the log-normal scaler does not read."""
_DYNAMIC_ONLY_KEYS = ("loss_scaling_algorithm", "min_loss_scaling", "max_loss_scaling")
"""With the backoff keys, what a static loss scale does not read."""


@dataclass(frozen=True)
class AmpConfig(Config):
    """Mixed-precision settings: the typed form of ``strategy.amp_configs``.

    Keys and defaults are Paddle Fleet's (the README's ``amp_configs`` table) plus
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
            put(key, as_float(own, key, getattr(self, key), scale, lambda x: 0 < x <= FLOAT32_MAX))
        put("use_dynamic_loss_scaling", as_bool(own, "use_dynamic_loss_scaling", self.use_dynamic_loss_scaling))
        put("incr_every_n_steps", as_int(own, "incr_every_n_steps", self.incr_every_n_steps, 1))
        put("decr_every_n_nan_or_inf", as_int(own, "decr_every_n_nan_or_inf", self.decr_every_n_nan_or_inf, 1))
        put("incr_ratio", as_float(own, "incr_ratio", self.incr_ratio, "a finite float > 1", lambda x: x > 1))
        put("decr_ratio", as_float(own, "decr_ratio", self.decr_ratio, "a float in (0, 1)", lambda x: 0 < x < 1))
        put("custom_black_varnames", as_names(own, "custom_black_varnames", self.custom_black_varnames,
                                               "module-name patterns"))
        put("use_pure_fp16", as_bool(own, "use_pure_fp16", self.use_pure_fp16))
        put("dtype", validate_dtype(own, "dtype", self.dtype))
        put("loss_scaling_algorithm",
            as_choice(own, "loss_scaling_algorithm", self.loss_scaling_algorithm, ("backoff", "lognormal")))
        if self.comm_dtype is not None:
            put("comm_dtype", as_choice(own, "comm_dtype", self.comm_dtype, ("float16", "bfloat16", "float32"),
                                         dtypes=True))
        if self.gradient_predivide_factor is not None:
            put("gradient_predivide_factor", as_float(own, "gradient_predivide_factor",
                                                       self.gradient_predivide_factor,
                                                       "None or a finite float >= 1 (and at most the world size)",
                                                       lambda x: x >= 1))
        put("stuck_scale_patience", as_int(own, "stuck_scale_patience", self.stuck_scale_patience, 1))
        put("keep_norm_fp32", as_bool(own, "keep_norm_fp32", self.keep_norm_fp32))
        put("check_nan_inf", as_bool(own, "check_nan_inf", self.check_nan_inf))
        put("overflow_retries", as_int(own, "overflow_retries", self.overflow_retries, 0))
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

    def _changed(self, keys: tuple[str, ...]) -> list[str]:
        """``key=value`` for each of ``keys`` (scalar fields) set to something other than its default."""
        default = {f.name: f.default for f in fields(self)}
        return [f"{k}={getattr(self, k)!r}" for k in keys if getattr(self, k) != default[k]]

    def _warn_unused_scaling_keys(self) -> None:
        if self.dtype != "bfloat16":
            if not self.use_dynamic_loss_scaling and self.overflow_retries:
                warn_user(
                    f"amp_configs: overflow_retries={self.overflow_retries!r} has no effect with "
                    "use_dynamic_loss_scaling=False: a retry lowers the loss scale first, and a static one "
                    "cannot fall, so an overflowing step(closure) is skipped. Use dynamic loss scaling, or "
                    "remove overflow_retries."
                )
            static_ignored = self._changed(_BACKOFF_KEYS + _DYNAMIC_ONLY_KEYS)
            if not self.use_dynamic_loss_scaling and static_ignored:
                warn_user(
                    f"amp_configs: use_dynamic_loss_scaling=False keeps the loss scale at init_loss_scaling="
                    f"{self.init_loss_scaling:g}, so these settings of dynamic scaling have no effect: "
                    f"{', '.join(static_ignored)}. Remove them, or set use_dynamic_loss_scaling=True."
                )
            backoff_only = self._changed(_BACKOFF_KEYS)
            if self.use_dynamic_loss_scaling and self.loss_scaling_algorithm == "lognormal" and backoff_only:
                warn_user(
                    "amp_configs: loss_scaling_algorithm='lognormal' sets each scale from the statistics of the "
                    "gradients' maximum (an overflow halves it), so these settings of the backoff algorithm have "
                    f"no effect: {', '.join(backoff_only)}. Remove them, or use loss_scaling_algorithm='backoff'."
                )
            return
        ignored = self._changed(_LOSS_SCALING_KEYS)
        if ignored:
            warn_user(
                f"amp_configs: with dtype='bfloat16' the loss scale is fixed at 1.0 (BF16 has FP32's "
                f"range), so these loss-scaling settings have no effect: {', '.join(ignored)}. "
                f"Remove them, or use dtype='float16' for dynamic loss scaling."
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The low-precision dtype as a torch dtype (torch.float16 or torch.bfloat16)."""
        return getattr(torch, self.dtype)

    @property
    def comm_torch_dtype(self) -> torch.dtype:
        """Wire dtype of gradient communication: comm_dtype, or dtype when it is None."""
        return getattr(torch, self.comm_dtype or self.dtype)
