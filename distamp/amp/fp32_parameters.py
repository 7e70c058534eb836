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

Normalization layers are recognised by type (:data:`NORM_LAYER_TYPES`), so a
model's own norm class (nanoGPT's ``LayerNorm`` with an optional bias, Llama's
``RMSNorm``) is stored in 16 bits like any other module;
:func:`unrecognised_norms` finds those whose class is named like a norm, so
that O2 can say so and name the ``custom_black_varnames`` patterns that keep
them in FP32 (:func:`unrecognised_norms_message`).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from distamp.amp.black_modules import find_black_modules
from distamp.model_views import unwrap_model
from distamp.suggest import listed
from distamp.torch_compat import NormBase

__all__ = ["NORM_LAYER_TYPES", "fp32_modules", "fp32_parameters", "looks_like_norm", "unrecognised_norms",
           "unrecognised_norms_message"]

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


_NORM_NAME_PARTS = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm")
_SHOWN_MODULES = 4


def looks_like_norm(class_name: str) -> bool:
    """Whether a class named ``class_name`` is, by its name, a normalization layer (``...Norm``, ``LayerNorm2d``)."""
    return class_name.endswith("Norm") or any(part in class_name for part in _NORM_NAME_PARTS)


def _class_name(module: nn.Module) -> str:
    """The module's own class name (FSDP2's ``fully_shard`` makes a subclass named ``FSDP<class>``)."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(module).__name__


def unrecognised_norms(model: nn.Module, black_patterns: Iterable[str] = ()) -> list[tuple[str, str]]:
    """``(qualified name, class name)`` of the modules O2 would store in 16 bits though they look like norms.

    Names are those of the model inside ``torch.compile`` / data-parallel
    wrappers (:func:`~distamp.model_views.unwrap_model`), as the patterns'.

    A module counts when its class is named like a normalization layer
    (:func:`looks_like_norm`), it is not one of :data:`NORM_LAYER_TYPES`, it
    holds floating-point parameters of its own, and no ``custom_black_varnames``
    pattern already keeps it (or a module around it) in FP32.
    """
    inside_black = [f"{name}." if name else "" for name, _ in find_black_modules(model, list(black_patterns))]
    found = []
    for name, module in unwrap_model(model).named_modules():
        if (name and looks_like_norm(_class_name(module)) and not isinstance(module, NORM_LAYER_TYPES)
                and any(p.is_floating_point() for p in module.parameters(recurse=False))
                and not any(f"{name}.".startswith(prefix) for prefix in inside_black)):
            found.append((name, _class_name(module)))
    return found


def unrecognised_norms_message(found: list[tuple[str, str]], dtype: str) -> str:
    """The O2 warning for :func:`unrecognised_norms`' modules: what happens, and the patterns that fix it."""
    shown = listed([f"{name!r} ({cls})" for name, cls in found], _SHOWN_MODULES)
    # One pattern per position in a repeated block: "transformer.h.*.ln_1" for every block's ln_1.
    patterns = list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in name.split("."))
                                  for name, _ in found))
    return (
        f"O2 (use_pure_fp16=True) stores the parameters of {shown} in {dtype}: their classes are named like "
        "normalization layers, but keep_norm_fp32 keeps only torch.nn's (BatchNorm, SyncBatchNorm, InstanceNorm, "
        "LayerNorm, GroupNorm, RMSNorm and their subclasses) in FP32. To keep them in FP32 (weights and compute), "
        f"list them in custom_black_varnames: strategy.amp_configs = {{..., 'custom_black_varnames': {patterns!r}}}. "
        "If 16-bit norms are what you want, amp_configs['keep_norm_fp32'] = False stores every norm in 16 bits "
        "and silences this."
    )


def fp32_modules(model: nn.Module, black_patterns: Iterable[str], keep_norm_fp32: bool) -> list[tuple[str, nn.Module]]:
    """O2's FP32 modules that hold parameters: ``custom_black_varnames`` ones, and norms with ``keep_norm_fp32``.

    Stage 3 makes each one its own FSDP2 unit with an FP32 policy; the
    modules are those whose parameters :func:`fp32_parameters` keeps. Names
    are those of the model inside any wrappers, as :func:`find_black_modules`'.
    """
    black = find_black_modules(model, list(black_patterns))
    inside_black = [f"{name}." for name, _ in black]
    units = [(name, m) for name, m in black if name and any(True for _ in m.parameters())]
    if keep_norm_fp32:
        for name, m in unwrap_model(model).named_modules():
            if (name and isinstance(m, NORM_LAYER_TYPES) and any(True for _ in m.parameters(recurse=False))
                    and not any(name.startswith(prefix) for prefix in inside_black)):
                units.append((name, m))
    return units
