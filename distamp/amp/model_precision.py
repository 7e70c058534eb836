"""The forward precision ``distamp.amp`` gives a model wrapper, from a strategy.

:class:`ForwardPrecision` satisfies :class:`distamp.core.attached.ModelPrecision`,
the interface through which stage 3's ``FullyShardedModel`` learns which
modules stay FP32 without importing ``distamp.amp``.
"""

from __future__ import annotations

from torch import nn

from distamp.amp.black_modules import BlackModulesHandle, keep_in_fp32
from distamp.amp.fp32_parameters import fp32_modules
from distamp.strategy import DistributedStrategy

__all__ = ["ForwardPrecision"]


class ForwardPrecision:
    """``amp_configs``' module-level choices for one model: O2's FP32 modules, black modules in FP32.

    Args:
        strategy: the job's strategy; with ``strategy.amp`` off nothing stays
            FP32 apart and no forward is wrapped.
    """

    def __init__(self, strategy: DistributedStrategy) -> None:
        self.strategy = strategy

    def fp32_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """O2's modules whose parameters stay FP32; none outside O2."""
        cfg = self.strategy.amp_config
        if not (self.strategy.amp and cfg.use_pure_fp16):
            return []
        return fp32_modules(model, cfg.custom_black_varnames, cfg.keep_norm_fp32)

    def keep_black_modules_in_fp32(self, model: nn.Module) -> BlackModulesHandle | None:
        """Wrap the forward of ``custom_black_varnames`` modules to run in FP32 (None if there are none)."""
        cfg = self.strategy.amp_config
        if not (self.strategy.amp and cfg.custom_black_varnames):
            return None
        return keep_in_fp32(model, cfg.custom_black_varnames)
