"""Forward precision: ``auto_cast`` on ``torch.autocast``, custom op lists, FP32 modules.

Most users reach these through :mod:`distamp.fleet`; they are usable alone::

    from distamp.amp import auto_cast
    with auto_cast(dtype="bfloat16", custom_black_list=["gelu"]):
        y = model(x)

Modules:

- :mod:`~distamp.amp.auto_cast`: ``auto_cast()``, a ``torch.autocast`` (plus
  the custom op lists when given).
- :mod:`~distamp.amp.op_list_mode`: the torch function mode behind
  ``custom_white_list`` / ``custom_black_list``.
- :mod:`~distamp.amp.black_modules`: ``custom_black_varnames`` submodules run in FP32.
- :mod:`~distamp.amp.fp32_parameters`: which parameters O2 keeps in FP32.
- :mod:`~distamp.amp.fp32_requests`: counts where the configuration switched an
  enabled autocast off (FP32 on request).
"""

from distamp.amp.auto_cast import AutocastWithOpLists, auto_cast, default_device_type
from distamp.amp.black_modules import (
    BlackModulesHandle,
    find_black_modules,
    keep_in_fp32,
)
from distamp.amp.fp32_parameters import NORM_LAYER_TYPES, fp32_parameters
from distamp.amp.op_list_mode import OpListMode, checkpoint_context_fn

__all__ = [
    "NORM_LAYER_TYPES",
    "AutocastWithOpLists",
    "BlackModulesHandle",
    "OpListMode",
    "auto_cast",
    "checkpoint_context_fn",
    "default_device_type",
    "find_black_modules",
    "fp32_parameters",
    "keep_in_fp32",
]
