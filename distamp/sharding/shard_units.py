"""Which modules sharding stage 3 shards as one unit each (one ``fully_shard`` call per unit).

A unit's parameters are all-gathered together before it runs and its
gradients reduce-scattered together after its backward, so at any moment a
rank holds the whole (unsharded) parameters of about one unit, plus the
prefetched next one. Units the size of the model's repeated blocks keep that
transient small without paying a collective per tiny tensor.

Default (``sharding_configs["units"]`` empty): every child holding
parameters of each ``nn.ModuleList`` or ``nn.Sequential`` (a transformer's
blocks, an MLP's layers), the outermost containers first; a block's own
containers are not searched again. A model with no such container: the
outermost submodules holding parameters of their own, each with everything
below it (``nn.MultiheadAttention`` reads ``out_proj.weight`` in its own
forward, so splitting ``out_proj`` off would leave it sharded when read). The
root is always sharded last and holds what no unit took.

Names (the units', the patterns') are those of the model inside
``torch.compile`` / data-parallel wrappers
(:func:`~distamp.model_views.unwrap_model`): ``"blocks.0"`` for a model
compiled before ``fleet.distributed_model`` too.

Example::

    units = choose_units(model, patterns=())            # default
    units = choose_units(model, patterns=["blocks.*"])  # each transformer block
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from distamp.model_views import unwrap_model
from distamp.strategy.name_patterns import ModulePatterns

__all__ = ["choose_units", "shared_parameters"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def choose_units(model: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of each unit of ``model``, in ``named_modules()`` order; never the root.

    Args:
        model: the model to shard.
        patterns: ``sharding_configs["units"]``: qualified module names or
            fnmatch patterns; empty for the default described in the module
            docstring.

    Raises:
        ValueError: a pattern matches no submodule (the message lists the
            model's module names).
    """
    user = unwrap_model(model)
    named = [(name, module) for name, module in user.named_modules() if name]
    if patterns:
        matcher = ModulePatterns(model, [name for name, _ in named], patterns, "sharding_configs['units']",
                                 "the model's modules")
        return [(name, module) for name, module in named if matcher.matches(name) and _holds_parameters(module)]
    units = _repeated_blocks(user) or _outermost_owners(named)
    while shared := shared_parameters(model, units):
        dropped = {holder for _, holders in shared for holder in holders}
        units = [(name, module) for name, module in units if name not in dropped]
    return units


def shared_parameters(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, list[str]]]:
    """Parameters of ``model`` that more than one of ``units`` (or a unit and the root) hold.

    A parameter is held by the innermost unit above the module it is
    registered on, or by the root (``""``) when no unit is. Returns
    ``(qualified name, holders)`` per shared parameter, the name as
    ``named_parameters()`` of the model inside any wrappers gives it (the
    units' names are those too, as :func:`choose_units` gives them).
    """
    unit_names = sorted({name for name, _ in units}, key=len, reverse=True)  # innermost first
    holders: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for qualified, param in unwrap_model(model).named_parameters(remove_duplicate=False):
        path = qualified.rpartition(".")[0]
        holder = next((u for u in unit_names if path == u or path.startswith(f"{u}.")), "")
        first_name.setdefault(id(param), qualified)
        if holder not in holders.setdefault(id(param), []):
            holders[id(param)].append(holder)
    return [(first_name[key], names) for key, names in holders.items() if len(names) > 1]


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _outermost_owners(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of ``named`` holding parameters of their own that lie inside no other such module."""
    owners: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(name.startswith(f"{taken}.") for taken, _ in owners):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            owners.append((name, module))
    return owners


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Parameter-holding children of the outermost ``ModuleList`` / ``Sequential`` containers (the root included)."""
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(f"{t}.") for t in taken):
            continue
        if isinstance(module, _CONTAINERS):
            for child_name, child in module.named_children():
                if _holds_parameters(child):
                    qualified = f"{name}.{child_name}" if name else child_name
                    blocks.append((qualified, child))
                    taken.append(qualified)
    return blocks
