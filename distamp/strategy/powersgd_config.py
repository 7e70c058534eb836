"""`PowerSGDConfig`: the typed, validated form of ``strategy.powersgd_configs``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from distamp.strategy.checks import as_bool, as_float, as_int
from distamp.strategy.config_base import Config

__all__ = ["PowerSGDConfig"]


@dataclass(frozen=True)
class PowerSGDConfig(Config):
    """Low-rank gradient compression: the typed form of ``strategy.powersgd_configs``.

    PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) sends,
    for a gradient viewed as an ``m x n`` matrix, two thin factors ``P``
    (``m x rank``) and ``Q`` (``n x rank``) instead of the matrix, and keeps
    what they miss as error feedback added to the next step's gradient.

    Example::

        cfg = PowerSGDConfig.from_dict({"rank": 4, "start_step": 100})
        cfg.compresses(1024, 1024)           # True: 1024*1024 / (4*2048) = 128 >= 2.0
    """

    _OWNER: ClassVar[str] = "powersgd_configs"

    rank: int = 1
    """Columns of P and Q (>= 1): higher keeps more of each gradient and sends more."""
    start_step: int = 1000
    """Applied optimizer steps of plain 16-bit all-reduce before compression starts (>= 0)."""
    min_compression_rate: float = 2.0
    """A gradient is compressed only when ``m*n / (rank*(m+n))`` reaches this (a float >= 1)."""
    warm_start: bool = True
    """Start each step's power iteration from the previous applied step's Q (one iteration then suffices)."""
    error_feedback: bool = True
    """Add what the last applied step's compression missed to the next gradient (FP32, per rank)."""

    def __post_init__(self) -> None:
        own = self._OWNER
        object.__setattr__(self, "rank", as_int(own, "rank", self.rank, 1))
        object.__setattr__(self, "start_step", as_int(own, "start_step", self.start_step, 0))
        object.__setattr__(self, "min_compression_rate", as_float(
            own, "min_compression_rate", self.min_compression_rate, "a finite float >= 1", lambda x: x >= 1))
        object.__setattr__(self, "warm_start", as_bool(own, "warm_start", self.warm_start))
        object.__setattr__(self, "error_feedback", as_bool(own, "error_feedback", self.error_feedback))

    def compression_rate(self, rows: int, cols: int) -> float:
        """``rows*cols / (rank*(rows+cols))``: how many times fewer elements P and Q have than the matrix."""
        return rows * cols / (self.rank * (rows + cols))

    def compresses(self, rows: int, cols: int) -> bool:
        """Whether an ``rows x cols`` gradient is compressed under this config."""
        return rows > 0 and cols > 0 and self.compression_rate(rows, cols) >= self.min_compression_rate
