"""`GradientMergeConfig`: the typed, validated form of ``strategy.gradient_merge_configs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distamp.strategy.checks import as_bool, as_int
from distamp.strategy.config_base import Config

__all__ = ["GradientMergeConfig"]


@dataclass(frozen=True)
class GradientMergeConfig(Config):
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
        object.__setattr__(self, "k_steps", as_int(self._OWNER, "k_steps", self.k_steps, 1))
        object.__setattr__(self, "avg", as_bool(self._OWNER, "avg", self.avg))
