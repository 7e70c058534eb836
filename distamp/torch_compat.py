"""Every private or version-dependent torch name distamp uses, in one place.

distamp supports the latest five torch minors, **2.11 to 2.15** (``setup.cfg``:
``torch>=2.11,<2.16``). Everywhere else distamp uses torch's public API; what
has none lives here, each entry with why, and each checked by reading the
source of torch 2.11.0, 2.13.0 and 2.14.1 (2.15 shares 2.14's code for all of
them) and by the suite, which passed whole on 2.11.0, 2.12.1, 2.13.0, 2.14.1
and 2.15.0 and which CI runs on 2.11.0, 2.13.0 and 2.15.0
(``tests/test_torch_compat.py`` exercises every entry on the torch it runs
on; ``tests/test_private_torch_names.py`` fails when another module of
distamp names a private torch attribute or module).

A private name that torch renames fails loudly here: at import for the
module-level aliases, or with a :class:`RuntimeError` naming the name and the
torch version for the looked-up ones. Nothing here turns a check off
silently (no ``getattr(..., None)`` on a torch internal).

What only sharding stage 3 or stage 2 needs (FSDP2's communication classes,
DDP's input-moving helpers) is imported on first use, not at
``from distamp import fleet``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

__all__ = [
    "DDP_KEYWORDS",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "TORCH_DEFAULT_GRACE_PERIOD",
    "DisableTorchFunction",
    "NormBase",
    "amp_foreach_non_finite_check_and_unscale_",
    "aot_autograd_cache_keys_autocast_dtype",
    "current_function_mode_stack",
    "ddp_has_rebuilt_buckets",
    "default_store",
    "disable_aot_autograd_cache",
    "dtensor_local",
    "foreach_add_",
    "foreach_copy_",
    "foreach_div_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_zero_",
    "fsdp_param_groups",
    "fsdp_rederive_grad_dtypes",
    "fsdp_unsharded_parameters",
    "grace_period_supported",
    "group_timeout",
    "is_ddp_ready_twice_error",
    "is_mixed_dtensor_error",
    "is_view",
    "launch_config_shutdown_timeout",
    "queue_autograd_callback",
    "tensor_version",
    "to_kwargs",
    "tree_flatten",
    "tree_leaves",
    "tree_map_only",
    "unflatten_dense_tensors",
    "unhooked_step",
    "with_step_hooks",
]

# --------------------------------------------------------------------------- fused tensor-list ops
# torch's own optimizers and GradScaler are built on these; they have no public
# names. Same signatures on 2.11-2.14.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_
foreach_div_ = torch._foreach_div_
foreach_mul_ = torch._foreach_mul_
foreach_zero_ = torch._foreach_zero_
# GradScaler's fused unscale and inf/NaN check (torch/amp/grad_scaler.py): one
# kernel per device and dtype, no host sync. 2.11-2.14: (grads, found_inf, inv_scale).
amp_foreach_non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
# Views of a flat buffer shaped like each of a list of tensors, in order, made in one C++ loop
# (torch._utils._unflatten_dense_tensors calls it; DDP and Apex use it). 2.11-2.15: (flat, tensors).
unflatten_dense_tensors = torch._C._nn.unflatten_dense_tensors


def foreach_norm(tensors: list[torch.Tensor], norm_type: float = 2.0) -> list[torch.Tensor]:
    """``torch._foreach_norm``: each tensor's ``norm_type``-norm, one fused kernel, where an empty tensor's norm is 0.

    torch refuses the infinity norm of an empty tensor ("does not have an
    identity", 2.11-2.15), and distamp meets empty tensors: a stage-3 shard
    of a parameter with fewer rows than ranks. Its norm is 0 for every
    ``norm_type`` (what torch gives for the finite ones), in its own dtype.
    """
    if all(t.numel() for t in tensors):
        return list(torch._foreach_norm(tensors, norm_type))
    nonempty = [t for t in tensors if t.numel()]
    held = iter(torch._foreach_norm(nonempty, norm_type) if nonempty else ())
    return [next(held) if t.numel() else t.new_zeros(()) for t in tensors]

# --------------------------------------------------------------------------- torch-function machinery
# The context manager torch's own __torch_function__ handlers use to call
# through without re-dispatching (2.11-2.14).
DisableTorchFunction = torch._C.DisableTorchFunction


def current_function_mode_stack() -> list[Any]:
    """The active ``TorchFunctionMode`` objects, outermost first (2.11-2.14: a private helper of
    ``torch.overrides``; no public accessor exists)."""
    return torch.overrides._get_current_function_mode_stack()


# torch's pytree utilities: torch.utils.pytree (public) does not exist on 2.11-2.14.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only  # noqa: E402

# --------------------------------------------------------------------------- tensors and modules
# The base class of BatchNorm1d/2d/3d, SyncBatchNorm and InstanceNorm1d/2d/3d (2.11-2.14).
NormBase: type[nn.Module] = nn.modules.batchnorm._NormBase


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (autograd's ``_version``; 2.11-2.14)."""
    return tensor._version


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's storage (autograd's ``_base``; 2.11-2.14)."""
    return tensor._base is not None


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (what DDP's reducer and FSDP use;
    ``Variable._execution_engine.queue_callback`` on 2.11-2.14). Call only during a backward."""
    Variable._execution_engine.queue_callback(callback)


def is_mixed_dtensor_error(error: BaseException) -> bool:
    """Whether ``error`` is DTensor's refusal of an op that mixes a plain tensor and a DTensor.

    torch has no exception type for it, only the message ("<op>: got mixed
    torch.Tensor and DTensor, need to convert all ...", 2.11-2.14).
    """
    return isinstance(error, RuntimeError) and "got mixed torch.Tensor and DTensor" in str(error)


def is_ddp_ready_twice_error(error: BaseException) -> bool:
    """Whether ``error`` is DDP's reducer refusing a parameter whose gradient hook fired twice in one backward.

    torch has no exception type for it, only the message ("Expected to mark a
    variable ready only once. ...", raised from C++ as ``RuntimeError``,
    2.11-2.15).
    """
    return isinstance(error, RuntimeError) and "Expected to mark a variable ready only once" in str(error)


def is_ddp_static_graph_unsynced_error(error: BaseException) -> bool:
    """Whether ``error`` is DDP's reducer asserting that its static graph's first backward communicates.

    A DDP built with ``static_graph=True`` whose first backward runs with
    ``require_backward_grad_sync`` False (inside ``no_sync()``) gets an internal
    assert, "expect_autograd_hooks_ INTERNAL ASSERT FAILED ... please report a
    bug to PyTorch", raised from C++ as ``RuntimeError`` (2.11.0, 2.13.0, 2.15.0
    checked).
    """
    return isinstance(error, RuntimeError) and "expect_autograd_hooks_ INTERNAL ASSERT FAILED" in str(error)


def dtensor_local(tensor: DTensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor, the same object FSDP2 updates (not an autograd view).

    ``DTensor.to_local()`` returns the stored local tensor itself when grad
    mode is off (2.11-2.14), so no private attribute is needed.
    """
    with torch.no_grad():
        return tensor.to_local()


# --------------------------------------------------------------------------- optimizer step hooks
# torch.optim.Optimizer wraps each optimizer class's ``step`` once
# (``_patch_step_function``: ``Optimizer.profile_hook_step``, with ``functools.wraps``, and marks it
# ``hooked``), and that wrapper runs the global step hooks and the optimizer's own before and after
# every call. A chunked update calls the inner ``step`` once per chunk; these two let it run the
# hooks once around the whole update and each chunk without them. Same code on 2.11-2.15
# (torch/optim/optimizer.py).
def with_step_hooks(update: Callable[[torch.optim.Optimizer], None]) -> Callable[[torch.optim.Optimizer], None]:
    """``update(optimizer)`` wrapped as torch wraps ``Optimizer.step``: the step pre-hooks (global, then
    the optimizer's own) before it, the post-hooks (its own, then global) after it, and the profiler
    range ``Optimizer.step#<class>.step`` around it."""
    return torch.optim.Optimizer.profile_hook_step(update)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    """``optimizer.step`` without torch's hook wrapper: the class's own ``step``, bound to ``optimizer``.

    Raises:
        RuntimeError: the class's ``step`` is not torch's hooked wrapper (it is
            one for every optimizer ``torch.optim.Optimizer.__init__`` has run on).
    """
    step: Any = type(optimizer).step
    if step.__dict__.get("hooked") is not True or "__wrapped__" not in step.__dict__:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step is not torch's hooked step wrapper (no 'hooked' and '__wrapped__' "
            f"attributes) on torch {torch.__version__}: torch.optim.Optimizer._patch_step_function changed, or "
            "the class's step was replaced after the optimizer was built; distamp cannot step it in chunks "
            "without running its step hooks once per chunk"
        )
    return step.__wrapped__.__get__(optimizer)


def tell_lr_schedulers_it_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` as stepped for the LR schedulers built on it, as their wrapper of its ``step`` does.

    ``LRScheduler.__init__`` replaces ``optimizer.step`` on the instance by a
    wrapper that sets ``optimizer._opt_called = True``, and its first
    ``step()`` warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" unless that flag is set (torch/optim/lr_scheduler.py,
    2.13.0 checked). A chunked update runs the class's step (:func:`unhooked_step`)
    and never that wrapper, so it sets the flag itself. On a torch that reads
    something else the flag is an unused attribute.
    """
    optimizer._opt_called = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- torch.compile
def aot_autograd_cache_keys_autocast_dtype() -> bool:
    """Whether AOTAutograd's compiled-graph cache key holds the autocast dtype, not only whether autocast
    is on: from torch 2.13 (2.13.0, 2.14.1, 2.15.0 checked; 2.11.0 and 2.12.1 lack it)."""
    return bool(torch.__version__ >= "2.13")


def disable_aot_autograd_cache() -> None:
    """Switch AOTAutograd's local and remote compiled-graph caches off for this process.

    ``torch._functorch.config`` has no public switch read after import (2.11-2.14:
    ``enable_autograd_cache``, ``enable_remote_autograd_cache``).
    """
    import torch._functorch.config as aot_autograd_config

    aot_autograd_config.enable_autograd_cache = False
    aot_autograd_config.enable_remote_autograd_cache = False


# --------------------------------------------------------------------------- process groups and DDP
# DDP's default size of its first bucket; torch.compile's DDPOptimizer assumes it (2.11-2.14: 1 MiB).
DEFAULT_FIRST_BUCKET_BYTES: int = dist._DEFAULT_FIRST_BUCKET_BYTES

# The keyword arguments of the installed torch's DDP, in its order. They differ across 2.11-2.15:
# forward_sync_buffers and batched_grad_copy came in 2.13, lazy_bucket_allocation in 2.15.
DDP_KEYWORDS: tuple[str, ...] = tuple(
    name for name in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    if name not in ("self", "module")
)


def default_store() -> dist.Store:
    """The store ``init_process_group`` built or was given (no public accessor on 2.11-2.14)."""
    return dist.distributed_c10d._get_default_store()


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> Any:
    """The timeout (a ``timedelta``) of ``group``'s backend for ``device`` (2.11-2.14)."""
    return group._get_backend(device).options._timeout


def ddp_has_rebuilt_buckets(ddp: nn.Module) -> bool:
    """Whether DDP has rebuilt its buckets after the first backward (2.11-2.14)."""
    return bool(ddp._has_rebuilt_buckets)


def ddp_ignored_names(module: nn.Module) -> set[str]:
    """Names ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` told DDP to skip (2.11-2.15)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def to_kwargs(
    args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """DDP's own move of a forward's inputs (any nesting) to ``device`` (2.11-2.14)."""
    from torch.distributed.utils import _to_kwargs

    moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, False)
    return moved_args[0], moved_kwargs[0]


# --------------------------------------------------------------------------- FSDP2 (sharding stage 3)
# FSDP2's AllGather and ReduceScatter interfaces for custom collectives: a private module path on
# 2.11-2.14 (torch.distributed.fsdp._fully_shard._fsdp_api). Imported on first access of the names
# (module __getattr__ below), so that only sharding stage 3 loads it.
_LAZY_FSDP_NAMES = {"FSDPAllGather": "AllGather", "FSDPReduceScatter": "ReduceScatter"}

if TYPE_CHECKING:
    pass


def __getattr__(name: str) -> Any:
    if name in _LAZY_FSDP_NAMES:
        from torch.distributed.fsdp._fully_shard import _fsdp_api

        return getattr(_fsdp_api, _LAZY_FSDP_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: one optional group on 2.11, a list from 2.12 on."""
    if hasattr(state, "_fsdp_param_groups"):  # 2.12+ (2.12.1, 2.13.0, 2.14.1, 2.15.0 checked)
        return list(state._fsdp_param_groups)
    if hasattr(type(state), "_fsdp_param_group") or "_fsdp_param_group" in vars(state):  # 2.11
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        f"torch {torch.__version__}: FSDP2's state has neither _fsdp_param_groups nor _fsdp_param_group; "
        "distamp's sharding stage 3 supports torch 2.11-2.15 (distamp/torch_compat.py)"
    )


def _fsdp_groups_under(root: nn.Module) -> Iterator[Any]:
    """The FSDP2 parameter groups of every ``fully_shard``ed module under ``root``."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            yield from _fsdp_param_groups(module._get_fsdp_state())


def fsdp_param_groups(root: nn.Module) -> list[tuple[Any, list[nn.Parameter]]]:
    """Each FSDP2 parameter group under ``root`` with the sharded parameters it manages."""
    return [(group, [fsdp_param.sharded_param for fsdp_param in group.fsdp_params])
            for group in _fsdp_groups_under(root)]


def fsdp_rederive_grad_dtypes(group: Any) -> None:
    """Make an FSDP2 parameter group derive its gradient dtypes again, from the parameters trainable now.

    FSDP2 derives a group's original and reduce dtypes once, at its lazy
    init (the root's first forward), from the parameters trainable then
    (``FSDPParamGroup._init_mp_dtypes``; 2.11.0, 2.13.0 and 2.15.0 checked).
    A group with none gets neither, so when its parameters are made
    trainable later, their reduced gradients keep the gathered dtype: with
    16-bit gathered parameters torch then fails assigning a 16-bit gradient
    to the FP32 shard, and with FP32 ones the group reduces in FP32 instead
    of the policy's ``reduce_dtype``. torch 2.15 derives them from every
    floating-point parameter when none is trainable, so there this changes
    nothing. Call between steps, with none of the group's collectives in
    flight.
    """
    init = getattr(type(group), "_init_mp_dtypes", None)
    if init is None:
        raise RuntimeError(
            f"torch {torch.__version__}: FSDP2's parameter group has no _init_mp_dtypes; "
            "distamp's sharding stage 3 supports torch 2.11-2.15 (distamp/torch_compat.py)"
        )
    init(group)


def fsdp_unsharded_parameters(root: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(sharded parameter, unsharded parameter)`` for each FSDP2 parameter under ``root`` that has
    been all-gathered at least once (FSDP2 then keeps reusing that unsharded ``Parameter``).

    Raises :class:`RuntimeError` when FSDP2 holds parameters but none has the
    attribute this reads (``FSDPParam._unsharded_param``, 2.11-2.14), so a
    rename in a newer torch cannot silently switch a check off. Call it after
    a forward has run.
    """
    seen = found = 0
    for group in _fsdp_groups_under(root):
        for fsdp_param in group.fsdp_params:
            seen += 1
            if "_unsharded_param" in vars(fsdp_param):
                found += 1
                yield fsdp_param.sharded_param, fsdp_param._unsharded_param
    if seen and not found:
        raise RuntimeError(
            f"torch {torch.__version__}: none of FSDP2's {seen} parameters has _unsharded_param after a forward; "
            "distamp's sharding stage 3 supports torch 2.11-2.15 (distamp/torch_compat.py)"
        )


# --------------------------------------------------------------------------- the elastic launcher
def launch_config_shutdown_timeout(seconds: int) -> dict[str, Any]:
    """``LaunchConfig`` keyword arguments for a ``seconds`` grace period between SIGTERM and SIGKILL.

    ``LaunchConfig.shutdown_timeout`` exists from torch 2.12 on (2.12.1,
    2.13.0, 2.14.1 and 2.15.0 checked); torch 2.11's agent always waits 30 seconds, so there
    the argument is left out and ``--grace_period`` other than 30 is refused
    (:func:`grace_period_supported`).
    """
    return {"shutdown_timeout": seconds} if grace_period_supported() else {}


def grace_period_supported() -> bool:
    """Whether this torch's ``LaunchConfig`` takes a shutdown timeout (2.12+)."""
    from torch.distributed.launcher.api import LaunchConfig

    return any(field.name == "shutdown_timeout" for field in dataclasses.fields(LaunchConfig))


TORCH_DEFAULT_GRACE_PERIOD = 30
"""Seconds torch's elastic agent waits between SIGTERM and SIGKILL when not told (2.11-2.14)."""
