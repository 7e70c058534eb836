"""FP32 master copies of low-precision model parameters (AMP "O2").

In O2 the model computes with FP16/BF16 parameters while the optimizer
updates FP32 copies, so that updates smaller than the 16-bit spacing are
not lost. This module owns that pairing: it makes the masters from the
original FP32 values, stores the model parameters in the low dtype
(:meth:`MasterWeights.convert_model`; the ``Parameter`` objects stay the
same, so modules, hooks and DDP still see them), moves gradients to the
masters and copies updated masters back.

What the user writes into the model's parameters between steps (loading
weights with ``model.load_state_dict``, an in-place edit under
``torch.no_grad()``) is taken into the masters before they are next read
(:meth:`MasterWeights.adopt_model_writes`), so the model trains from what it
holds, as it would without masters. A parameter's version counter says it
was written; the values decide, element by element (a write of the value an
element already held changes nothing, so the rows an ``nn.Embedding`` with
``max_norm`` renormalises are taken and the others keep their FP32 bits).
Writes through ``.data`` bypass the counter and are not seen.

Masters live in one flat FP32 buffer per device, so broadcasting,
checkpointing and copying are a few large operations instead of one per
parameter. Their FP32 gradients are not kept: the step builds them chunk by
chunk (:mod:`distamp.core.chunked_update`), and
:meth:`MasterWeights.copy_grads_to_masters` makes whole ones only on request
(``unscale_()``, clipping), freed with the masters' gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from distamp.core.chunked_update import adopt_written_values
from distamp.torch_compat import foreach_add_, foreach_copy_, foreach_zero_, tensor_version

__all__ = ["MasterWeights", "MasterWeightsSurface", "check_saved_masters", "clear_grads"]


class MasterWeightsSurface(Protocol):
    """What the optimizer and the precision plugins use of the masters, whole (:class:`MasterWeights`) or sharded.

    :class:`~distamp.sharding.sharded_masters.ShardedMasters` provides the same
    surface without subclassing :class:`MasterWeights`.
    """

    low_dtype: torch.dtype | None
    model_params: list[nn.Parameter]

    @property
    def enabled(self) -> bool: ...
    @property
    def masters(self) -> list[nn.Parameter]: ...
    def install(self, optimizer: torch.optim.Optimizer) -> None: ...
    def master_for(self, param: nn.Parameter) -> nn.Parameter: ...
    def add(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]: ...
    def convert_model(self, keep_fp32: Iterable[nn.Parameter] = ()) -> int: ...
    def exact_fp32(self) -> dict[int, torch.Tensor]: ...
    def zero_master_grads(self) -> None: ...
    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]: ...
    def zero_grads(self, set_to_none: bool = True) -> None: ...
    def finish_refresh(self, params: Iterable[nn.Parameter] | None = None) -> None: ...
    def broadcast(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None: ...
    def state_dict(self) -> list[torch.Tensor]: ...
    def load_state_dict(self, tensors: Sequence[torch.Tensor]) -> None: ...


@dataclass
class _FlatBuffers:
    """Flat FP32 storage of the masters on one device."""

    values: torch.Tensor


class MasterWeights:
    """Pairs each model parameter with the tensor the inner optimizer updates.

    With ``low_dtype=None`` (O1, or AMP off) every parameter is its own
    master and nothing is copied. With ``low_dtype`` set (O2), every FP32
    parameter (and every parameter already in ``low_dtype``) gets an FP32
    master; :meth:`convert_model` then stores the model parameters in
    ``low_dtype``, except the ones it is told to keep in FP32. Other dtypes
    (float64, integers) are left alone.

    Example::

        masters = MasterWeights(model.parameters(), torch.float16)
        masters.convert_model(keep_fp32=fp32_parameters(model))
        inner = torch.optim.SGD(masters.masters, lr=0.1)
        ...backward...
        masters.copy_grads_to_masters()
        inner.step()
        masters.copy_masters_to_model()

    Args:
        params: the model parameters, in the order the optimizer lists them.
        low_dtype: the 16-bit dtype for O2, or ``None``.
    """

    def __init__(self, params: Iterable[nn.Parameter], low_dtype: torch.dtype | None) -> None:
        self.low_dtype = low_dtype
        self.model_params: list[nn.Parameter] = []
        seen: set[int] = set()
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                self.model_params.append(p)
        self._flat: list[_FlatBuffers] = []
        # (model param, master param) for separate masters
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self._grad_buffers: list[torch.Tensor] = []  # whole FP32 master gradients, only between a request and zero
        self._master_of: dict[int, nn.Parameter] = {}
        self._keep_fp32: set[int] = set()
        # Each separate master's model parameter's version counter when the two last agreed (adopt_model_writes).
        self._versions: dict[int, int] = {}
        if low_dtype is None:
            for p in self.model_params:
                self._master_of[id(p)] = p
            return
        paired = [p for p in self.model_params if p.dtype in (torch.float32, low_dtype)]
        self._build_flat(paired)
        for p in self.model_params:
            self._master_of.setdefault(id(p), p)

    def _build_flat(self, params: Sequence[nn.Parameter]) -> None:
        by_device: dict[torch.device, list[nn.Parameter]] = {}
        for p in params:
            by_device.setdefault(p.device, []).append(p)
        for device, group in by_device.items():
            total = sum(p.numel() for p in group)
            flat = _FlatBuffers(values=torch.empty(total, dtype=torch.float32, device=device))
            self._flat.append(flat)
            offset = 0
            for p in group:
                n = p.numel()
                with torch.no_grad():
                    view = flat.values[offset : offset + n].view_as(p)
                    view.copy_(p.detach())
                master = nn.Parameter(view, requires_grad=p.requires_grad)
                self._pairs.append((p, master))
                self._master_of[id(p)] = master
                self._versions[id(p)] = tensor_version(p)
                offset += n

    @property
    def enabled(self) -> bool:
        """True when there are separate masters (O2)."""
        return bool(self._pairs)

    @property
    def masters(self) -> list[nn.Parameter]:
        """The tensors the inner optimizer updates, in model-parameter order."""
        return [self._master_of[id(p)] for p in self.model_params]

    def install(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the masters in ``optimizer`` where the model parameters were (a no-op without masters).

        State the optimizer already has moves to the masters, floating
        tensors (but ``step``) in FP32.
        """
        if not self.enabled:
            return
        old_state = dict(optimizer.state)
        for group in optimizer.param_groups:
            # Mutate in place: some optimizers keep a reference to the list.
            group["params"][:] = [self.master_for(p) for p in group["params"]]
        if old_state:
            optimizer.state.clear()
            for p, s in old_state.items():
                optimizer.state[self.master_for(p)] = {
                    k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                    for k, v in s.items()
                }

    def master_for(self, param: torch.Tensor) -> nn.Parameter:
        """The master of ``param`` (``param`` itself when it has none)."""
        try:
            return self._master_of[id(param)]
        except KeyError:
            raise ValueError(
                f"parameter of shape {tuple(param.shape)} is not managed by this optimizer"
            ) from None

    def add(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """Manage more parameters (``add_param_group``); returns their masters.

        New O2 parameters are stored in the low dtype right away, unless
        :meth:`convert_model` was told to keep them in FP32.
        """
        new = [p for p in params if id(p) not in self._master_of]
        self.model_params.extend(new)
        if self.low_dtype is None:
            for p in new:
                self._master_of[id(p)] = p
        else:
            extra = MasterWeights(new, self.low_dtype)
            extra.convert_model(keep_fp32=[p for p in new if id(p) in self._keep_fp32])
            self._flat.extend(extra._flat)
            self._pairs.extend(extra._pairs)
            self._master_of.update(extra._master_of)
            self._versions.update(extra._versions)
        return [self._master_of[id(p)] for p in new]

    def keeps_fp32(self, param: torch.Tensor) -> bool:
        """Whether :meth:`convert_model` was told to keep ``param`` in FP32."""
        return id(param) in self._keep_fp32

    def convert_model(self, keep_fp32: Iterable[nn.Parameter] = ()) -> int:
        """Store each paired model parameter in the low dtype, or in FP32 if it is in ``keep_fp32``.

        Values always come from the exact FP32 masters, so calling it again
        with more parameters to keep (once the model's normalization layers
        and ``custom_black_varnames`` modules are known) gives those back
        their exact FP32 values. A parameter keeps its memory layout
        (``channels_last``, a transposed view's strides), as ``.to(dtype)``
        keeps it. A no-op without separate masters. Returns how many
        parameters changed dtype.
        """
        self._keep_fp32 |= {id(p) for p in keep_fp32}
        changed = 0
        with torch.no_grad():
            for model_p, master in self._pairs:
                dtype = torch.float32 if id(model_p) in self._keep_fp32 else self.low_dtype
                if model_p.dtype != dtype:
                    # The master is a contiguous view of the flat buffer; the parameter keeps its own strides.
                    model_p.data = torch.empty_like(model_p, dtype=dtype).copy_(master.detach())
                    self._versions[id(model_p)] = tensor_version(model_p)
                    changed += 1
        return changed

    def adopt_model_writes(self) -> int:
        """Copy into the masters the model parameters written since they last held their masters' values.

        Called before the masters are read (the step's check, ``state_dict``,
        ``exact_fp32``). A parameter whose version counter moved is compared
        with its master rounded to its dtype; the master's elements that
        differ become the parameter's (exactly: widening to FP32 is exact).
        Returns how many masters changed.
        """
        written = [(p, m) for p, m in self._pairs if tensor_version(p) != self._versions.get(id(p))]
        adopted = 0
        with torch.no_grad():
            for model_p, master in written:
                if adopt_written_values(model_p.detach(), master):
                    adopted += 1
                self._versions[id(model_p)] = tensor_version(model_p)
        return adopted

    def copy_grads_to_masters(self) -> None:
        """Give the masters whole FP32 gradients, filled from the model's (4 bytes per parameter until zeroed).

        Masters of parameters without a gradient get ``grad = None`` so the
        inner optimizer skips them, exactly as it would skip the parameter.
        ``step()`` does not need this (it builds them chunk by chunk);
        ``unscale_()`` and clipping do, to show and change whole gradients.
        """
        if not self._pairs:
            return
        self.zero_master_grads()
        by_device: dict[torch.device, list[tuple[torch.Tensor, nn.Parameter]]] = {}
        for model_p, master in self._pairs:
            if model_p.grad is not None:
                by_device.setdefault(master.device, []).append((model_p.grad, master))
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for device, pairs in by_device.items():
            buffer = torch.empty(sum(m.numel() for _, m in pairs), dtype=torch.float32, device=device)
            self._grad_buffers.append(buffer)
            offset = 0
            for grad, master in pairs:
                view = buffer[offset : offset + master.numel()].view_as(master)
                master.grad = view
                offset += master.numel()
                dst.append(view)
                src.append(grad)
        if dst:
            foreach_copy_(dst, src)

    def pairs_with_grads(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """``(model parameter, FP32 master)`` for each separate master whose parameter has a gradient."""
        return [(model_p, master) for model_p, master in self._pairs if model_p.grad is not None]

    def own_grads(self) -> list[torch.Tensor]:
        """Gradients of the parameters that are their own masters (no separate FP32 copy: float64, ...)."""
        paired = {id(model_p) for model_p, _ in self._pairs}
        return [p.grad for p in self.model_params if id(p) not in paired and p.grad is not None]

    @property
    def has_master_grads(self) -> bool:
        """Whether :meth:`copy_grads_to_masters` made whole FP32 gradients not yet zeroed."""
        return bool(self._grad_buffers)

    def add_to_master_grads(self, extra: dict[int, torch.Tensor]) -> None:
        """Add ``extra[id(param)]`` (FP32) to the master gradient of each param that has one."""
        pairs = [(master.grad, extra[id(model_p)]) for model_p, master in self._pairs
                 if master.grad is not None and id(model_p) in extra]
        if pairs:
            foreach_add_([g for g, _ in pairs], [e.view_as(g) for g, e in pairs])

    def exact_fp32(self) -> dict[int, torch.Tensor]:
        """``{id(param): its exact FP32 value}``: the master, or the parameter itself without one."""
        self.adopt_model_writes()
        return {id(p): self.master_for(p).detach() for p in self.model_params}

    def grad_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(model grad, master grad)`` for each separate master whose parameter has a gradient."""
        return [
            (model_p.grad, master.grad)
            for model_p, master in self._pairs
            if model_p.grad is not None and master.grad is not None
        ]

    def copy_masters_to_model(self) -> None:
        """Copy (and round) the updated masters into the model parameters."""
        if not self._pairs:
            return
        with torch.no_grad():
            foreach_copy_(
                [model_p.data for model_p, _ in self._pairs],
                [master.detach() for _, master in self._pairs],
            )

    def zero_master_grads(self) -> None:
        """Drop the masters' gradients (the model's are the source of truth) and free their buffers."""
        for _, master in self._pairs:
            master.grad = None
        self._grad_buffers = []

    def reduced_grads(self) -> list[tuple[int, torch.Tensor]]:
        """Where this rank's reduced gradients are: each model parameter's ``.grad``, by index."""
        return [(i, p.grad) for i, p in enumerate(self.model_params) if p.grad is not None]

    def zero_grads(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (freed, or zeroed in place) and drop the masters'."""
        clear_grads(self.model_params, set_to_none)
        self.zero_master_grads()

    def finish_refresh(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Nothing to finish: unsharded, the model copies are written within ``step()``."""

    def broadcast(self, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
        """Make every rank's masters (and model copies) equal to rank ``src``'s."""
        for flat in self._flat:
            dist.broadcast(flat.values, src=src, group=group)
        self.copy_masters_to_model()

    def state_dict(self) -> list[torch.Tensor]:
        """The FP32 masters, one tensor per managed parameter, in order."""
        self.adopt_model_writes()
        return [self._master_of[id(p)].detach() for p in self.model_params]

    def load_state_dict(self, tensors: Sequence[torch.Tensor]) -> None:
        """Load masters saved by :meth:`state_dict` and refresh the model copies."""
        check_saved_masters(tensors, self.model_params)
        with torch.no_grad():
            for p, t in zip(self.model_params, tensors, strict=True):
                self._master_of[id(p)].copy_(t)
        self.copy_masters_to_model()


def clear_grads(params: Iterable[nn.Parameter], set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad`` for ``params``: free each ``.grad``, or zero it in place, detached."""
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
            continue
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        grads.append(p.grad)
    if grads:
        foreach_zero_(grads)


def check_saved_masters(tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> None:
    """Refuse saved masters whose count or shapes differ from the parameters they are loaded for.

    Raises:
        ValueError: naming the count, or the first parameter whose shape differs.
    """
    if len(tensors) != len(params):
        raise ValueError(
            f"checkpoint has {len(tensors)} master weights but this optimizer manages "
            f"{len(params)} parameters; was it saved from the same model?"
        )
    for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(
                f"master weight {i} has shape {tuple(t.shape)} in the checkpoint but {tuple(p.shape)} in the model"
            )
