"""Which parameters stay FP32 when O2 stores the model in 16 bits.

O2 ("pure FP16/BF16") converts the model's parameters to the low-precision
dtype; two kinds stay FP32:

* the parameters of modules matched by ``custom_black_varnames`` (they run
  entirely in FP32, see :mod:`distamp.amp.black_modules`);
* with ``keep_norm_fp32`` (the default), the affine parameters of
  normalization layers, as Paddle's and Apex's O2 do. Their statistics are
  computed in FP32 by torch's mixed-dtype kernels either way, and their
  inputs and outputs stay 16-bit under autocast (FP32 on CUDA for the ops
  torch's CUDA list runs in FP32, such as ``layer_norm``), so keeping these
  few parameters FP32 costs almost no memory and avoids rounding the scale
  and shift of every channel.

Example::

    keep = fp32_parameters(model, black_patterns=["head"], keep_norm_fp32=True)
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from distamp.amp.black_modules import find_black_modules
from distamp.torch_compat import NormBase

__all__ = ["NORM_LAYER_TYPES", "fp32_parameters"]

NORM_LAYER_TYPES: tuple[type[nn.Module], ...] = (
    NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
"""Module types whose parameters ``keep_norm_fp32`` keeps in FP32."""


def fp32_parameters(
    model: nn.Module, black_patterns: Iterable[str] = (), keep_norm_fp32: bool = True
) -> list[nn.Parameter]:
    """The parameters of ``model`` that O2 leaves in FP32, each once, in ``model.parameters()`` order.

    Args:
        model: the model (its root's name is ``""`` for the patterns).
        black_patterns: ``custom_black_varnames`` patterns.
        keep_norm_fp32: include the parameters of :data:`NORM_LAYER_TYPES` modules.

    Raises:
        ValueError: a pattern matches no submodule (from
            :func:`~distamp.amp.black_modules.find_black_modules`).
    """
    keep: set[int] = set()
    for _, module in find_black_modules(model, list(black_patterns)):
        keep.update(id(p) for p in module.parameters())
    if keep_norm_fp32:
        for module in model.modules():
            if isinstance(module, NORM_LAYER_TYPES):
                keep.update(id(p) for p in module.parameters(recurse=False))
    return [p for p in model.parameters() if id(p) in keep]
