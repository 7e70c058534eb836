"""What the meta-optimizer learns once it knows its model.

``fleet.distributed_optimizer`` sees parameters, not modules. The model
arrives later: from ``fleet.distributed_model`` (either order of the two
calls) or, without it, at the model's first forward
(:class:`~distamp.optim.first_forward.FirstForwardFinder`). Then
:meth:`ModelBinding.adopt`:

* gives O2's FP32-kept parameters (normalization layers,
  ``custom_black_varnames``) their exact FP32 values back from the masters,
  or with ``keep_norm_fp32=False`` stores normalization buffers in 16 bits;
  with ``keep_norm_fp32``, warns once about modules whose class is named like
  a norm but is not one of torch's (they are stored in 16 bits), naming the
  ``custom_black_varnames`` patterns that keep them in FP32;
* learns the qualified parameter names that overflow attribution reports
  (those of the model inside ``torch.compile`` / data-parallel wrappers:
  :func:`~distamp.model_views.unwrap_model`);
* installs the ``check_nan_inf`` hooks;
* keeps the ``custom_black_varnames`` modules a first-forward adoption
  switched to FP32 (``fleet.distributed_model`` keeps its own);
* remembers whether a data-parallel wrapper all-reduces the gradients, so
  that an optimizer used without one on several ranks fails at its first
  step instead of letting each rank train on its own gradients; and, for
  torch's own ``DistributedDataParallel`` (which has no distamp comm hook),
  whether a backward runs inside its ``no_sync()`` and so leaves ``.grad``
  local until its next synced backward reduces it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.amp.black_modules import BlackModulesHandle
from distamp.amp.fp32_parameters import NORM_LAYER_TYPES, unrecognised_norms, unrecognised_norms_message
from distamp.amp.nan_inf_check import NanInfChecker
from distamp.core.master_weights import MasterWeightsSurface
from distamp.distributed.groups import group_rank, group_size
from distamp.model_views import unwrap_model
from distamp.strategy import AmpConfig
from distamp.user_warning import warn_user

__all__ = ["ModelBinding"]

_ASKED: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
"""Per data-parallel wrapper: how many times any optimizer asked it about a backward (see ``note_plain_backward``)."""


class ModelBinding:
    """Names, FP32-kept parameters and debug hooks of the model an optimizer trains.

    Args:
        master_weights: the optimizer's model-parameter / master pairing.
        config: the strategy's AMP settings.
        amp: whether AMP is on.
        step: returns the number of the step in progress (for messages).
    """

    def __init__(
        self, master_weights: MasterWeightsSurface, config: AmpConfig, amp: bool, step: Callable[[], int]
    ) -> None:
        self._master_weights = master_weights
        self._config = config
        self._amp = amp
        self._step = step
        self.adopted = False
        self.checker: NanInfChecker | None = None
        self.black_modules: BlackModulesHandle | None = None
        self.reduces_grads = False
        self._torch_ddp: weakref.ref[DistributedDataParallel] | None = None
        self._names: dict[int, str] = {}
        self._sync_sources: weakref.WeakSet = weakref.WeakSet()
        self._asked_seen: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._owned_checked = False  # check_owned passed on the adopted model's names, which never change after
        self.last_backward_local = False
        """Whether the latest backward left each rank's own gradient (inside a wrapper's ``no_sync()``)."""
        self.last_backward_bypassed = False
        """Whether the latest backward had no forward of the wrapper's DDP before it (a call of ``model.module``, or a
        second backward through one forward)."""

    def name_of(self, param: torch.Tensor, index: int) -> str:
        """The qualified name of ``param`` in the adopted model (inside any wrappers), else ``"params[index]"``."""
        return self._names.get(id(param), f"params[{index}]")

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a parameter of the adopted model (False before one is adopted)."""
        return id(param) in self._names

    def adopt(self, model: nn.Module, keep_fp32: list[nn.Parameter], *, reduces_grads: bool = True,
              black_modules: BlackModulesHandle | None = None, torch_ddp: DistributedDataParallel | None = None
              ) -> None:
        """The model is known: names, O2's FP32-kept parameters, ``check_nan_inf`` hooks (once).

        ``reduces_grads`` says whether a data-parallel wrapper all-reduces the
        model's gradients; ``black_modules`` are kept alive with the binding;
        ``torch_ddp`` is torch's own DDP wrapper around ``model``, if that is
        what reduces them.
        """
        self.reduces_grads = self.reduces_grads or reduces_grads  # wrapped after a bare first forward
        if torch_ddp is not None:
            self._torch_ddp = weakref.ref(torch_ddp)
        if self.adopted:
            return
        self.adopted = True
        self.black_modules = black_modules
        for name, param in unwrap_model(model).named_parameters(remove_duplicate=False):
            self._names.setdefault(id(param), name)
        if self._master_weights.enabled:
            self._master_weights.convert_model(keep_fp32=keep_fp32)
            if not self._config.keep_norm_fp32:
                self._norm_buffers_to_low(model, keep_fp32)
            else:
                found = unrecognised_norms(model, self._config.custom_black_varnames)
                if found:
                    warn_user(unrecognised_norms_message(found, self._config.dtype))
        if self._amp and self._config.check_nan_inf:
            self.checker = NanInfChecker(model, self._step, group_rank())

    def _norm_buffers_to_low(self, model: nn.Module, keep_fp32: list[nn.Parameter]) -> None:
        # Torch's normalization kernels want 16-bit running statistics with 16-bit parameters.
        low, kept = self._master_weights.low_dtype, {id(p) for p in keep_fp32}
        for module in model.modules():
            if isinstance(module, NORM_LAYER_TYPES) and not any(id(p) in kept for p in module.parameters()):
                for name, buffer in module.named_buffers(recurse=False):
                    if buffer.is_floating_point():
                        setattr(module, name, buffer.to(low))

    def backward_stays_local(self) -> bool:
        """Whether the backward now running leaves ``.grad`` unreduced for a later one to reduce: torch's own
        DDP inside ``no_sync()`` (its next synced backward all-reduces ``.grad``, whatever it holds)."""
        ddp = self._torch_ddp() if self._torch_ddp is not None else None
        return ddp is not None and not ddp.require_backward_grad_sync

    def watch_sync(self, source: object) -> None:
        """Ask ``source.backward_communicates()`` and ``source.backward_bypassed()`` after each backward (a
        ``fleet.distributed_model`` wrapper)."""
        self._sync_sources.add(source)

    def note_backward(self) -> None:
        """An ``optimizer.backward`` finished: remember whether it reduced the gradients over the ranks.

        A synced backward reduces what earlier local ones accumulated, so only
        the latest one counts.
        """
        sources = list(self._sync_sources)
        self.last_backward_local = self.backward_stays_local() or not all(
            source.backward_communicates() for source in sources)
        bypassed = [source.backward_bypassed() for source in sources]
        self.last_backward_bypassed = any(bypassed)  # every source read: each read uses up its forward
        for source in sources:
            _ASKED[source] = self._asked_seen[source] = _ASKED.get(source, 0) + 1

    def note_plain_backward(self) -> None:
        """A step found gradients but no ``optimizer.backward`` of this optimizer since its last step (a plain
        ``loss.backward()``): ask the wrappers as :meth:`note_backward` does, unless another optimizer of the
        model asked them since (its ``optimizer.backward`` ran the backward, and its own step checks it)."""
        sources = list(self._sync_sources)
        if all(_ASKED.get(source, 0) == self._asked_seen.get(source, 0) for source in sources):
            self.note_backward()

    def check_owned(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, start: int = 0) -> None:
        """Raise when a data-parallel wrapper reduces the model's gradients but not those of some of ``params``.

        ``params`` are optimizer parameters (numbered from ``start`` in
        messages); one that trains (``requires_grad``) and is not the
        adopted model's gets no reduction from the wrapper.

        Raises:
            RuntimeError: on several ranks, such a parameter.
        """
        if not (self.adopted and self.reduces_grads) or group_size(group) == 1:
            return
        outside = [f"params[{start + i}] {tuple(p.shape)}" for i, p in enumerate(params)
                   if p.requires_grad and not self.owns(p)]
        if outside:
            raise RuntimeError(
                f"the optimizer trains {outside} (optimizer parameter index and shape), which are not parameters of "
                f"the data-parallel model, so nothing reduces their gradients over the {group_size(group)} ranks: "
                "every rank would apply its own (sharded, each slice its owner's) and the ranks would silently "
                "diverge. Make them part of the model given to fleet.distributed_model (or torch's "
                "DistributedDataParallel), e.g. a submodule of it that its forward calls, or leave them out of "
                "the optimizer."
            )

    def check_grads_reduced(self, group: dist.ProcessGroup | None, params: Sequence[torch.Tensor] = ()) -> None:
        """Raise when several ranks would each apply their own gradients.

        Raises:
            RuntimeError: the data-parallel group has more than one rank and
                no data-parallel wrapper (``fleet.distributed_model`` or
                torch's ``DistributedDataParallel``) ran the model's forward,
                the latest backward ran inside the wrapper's ``no_sync()``, or
                some of ``params`` (the optimizer's) are not the model's (see
                :meth:`check_owned`).
        """
        if group_size(group) == 1:
            return
        if self.last_backward_local:
            raise RuntimeError(
                "optimizer.step() (or unscale_/clip_grad_norm_) after a backward inside model.no_sync() (or with "
                "model.require_backward_grad_sync = False) and no synced backward since: the gradients are each "
                f"rank's own, not reduced over the {group_size(group)} ranks, so every rank would apply its own "
                "(or, sharded, each slice its owner's) and the ranks would silently diverge. Run the forward and "
                "backward of the accumulation window's last micro-batch outside no_sync() (that backward reduces "
                "the accumulated sum), then step."
            )
        if self.last_backward_bypassed:
            raise RuntimeError(
                "optimizer.step() (or unscale_/clip_grad_norm_) after a backward whose forward did not run through "
                "the fleet.distributed_model wrapper (the model called as model.module(...)), or after a second "
                "backward through one forward (optimizer.backward(loss, retain_graph=True) and another backward): "
                "DDP reduces only the first backward of a forward it ran, so the gradients are each rank's own, not "
                f"reduced over the {group_size(group)} ranks, and every rank would apply its own (sharded, each "
                "slice its owner's) while the ranks silently diverge. Call the wrapper (model(x)) for every training "
                "forward (a submodule called through model.module in the same forward as the wrapper is reduced with "
                "it), and add the losses and call optimizer.backward once rather than once per loss. Sharding stage "
                "2 (no DDP) reduces every backward."
            )
        if self.reduces_grads:
            if not self._owned_checked:  # later parameters come through add_param_group, which checks its own
                self.check_owned(params, group)
                self._owned_checked = self.adopted
            return
        seen = "its model ran a forward outside any data-parallel wrapper" if self.adopted else (
            "no module owning all its parameters ran a forward")
        raise RuntimeError(
            f"fleet.distributed_optimizer(...) runs on {group_size(group)} ranks, but nothing all-reduces the "
            f"gradients it applies ({seen}), so every rank would train on its own gradients and the ranks would "
            "silently diverge. Wrap the model: model = fleet.distributed_model(model) (or torch's "
            "DistributedDataParallel) and call that wrapper in the forward."
        )
