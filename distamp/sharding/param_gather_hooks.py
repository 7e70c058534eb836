"""Forward hooks that finish the parameter all-gather ``overlap_param_gather`` leaves running, as the forward reads.

With ``sharding_configs["overlap_param_gather"]`` a sharded optimizer's
``step()`` launches the all-gather of the updated slices and returns; the
rounds go over the wire while the next forward computes. What keeps that
forward from reading a stale parameter:

1. Before a module runs, its pre-hook finishes the rounds up to the last one
   that writes the module's own parameters (``recurse=False``), as
   Megatron-LM's ``overlap_param_gather`` does.
2. Rule 1 misses every parameter read by code other than its own module's
   forward: torch's ``nn.MultiheadAttention`` reads ``out_proj.weight``
   without calling ``out_proj`` (so ``nn.TransformerEncoderLayer`` and
   ``nn.Transformer`` do too), and a model may read a child's or a sibling's
   weight directly. So while a round is unfinished, from the start of the
   outermost forward of a module with parameters until it returns, a torch
   function mode (:class:`_ReadGuard`) sees every torch function, ``Tensor``
   method and attribute called and first finishes the rounds of every
   parameter that shares memory with a tensor among the arguments (inside
   lists, tuples and dicts too): the parameter itself, or a view,
   ``.data`` or ``.detach()`` of it, even one made before ``step()``.
3. After the whole model's forward, and before ``state_dict()`` and
   ``load_state_dict()`` of the model (wrapped or not) or of any of its
   modules with parameters, everything left is finished: a load must not be overwritten by messages still landing (on
   gloo they write into the parameters as they arrive, and in O1 and with
   AMP off this rank's slice is sent from the parameters themselves).

Which rounds are finished depends only on the calls made (which modules run,
which torch functions get which parameters), never on timing, so ranks
running the same forward issue the same collectives in the same order. The
``state_dict()`` pre-hook is collective too: on the collective rounds (NCCL)
a ``state_dict()`` on one rank alone launches the remaining rounds there
only, and the next other collective hangs; before a one-rank save every
rank calls ``optimizer.finish_param_gather()`` (``save_checkpoint`` takes
the model's ``state_dict()`` on every rank itself).

Not covered, so stale there: code outside a forward of the model or of one
of its modules (call ``optimizer.finish_param_gather()`` first), a copy of
the model included (``copy.deepcopy`` or pickling copies the parameters as
they are, and gives the copy inert hooks); native code
or a NumPy array that reads a parameter's memory without torch's function
dispatch. Under
``torch.compile`` every hook finishes the whole gather (compiled code is not
watched op by op): a graph break at each hooked module, no overlap.

The rounds follow the optimizer's parameter order, so a model whose
parameters are listed in the order its forward uses them overlaps the most.
The optimizer defers its gather only once these hooks are installed for it
(:meth:`ForwardParamGather.attach`), so an optimizer used without
``fleet.distributed_model`` finishes its gather inside ``step()`` as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from distamp.core.attached import AttachedOptimizer
from distamp.torch_compat import DisableTorchFunction, current_function_mode_stack

__all__ = ["ForwardParamGather"]


class ForwardParamGather:
    """The hooks of one model's modules and the optimizers whose gathers they finish.

    Args:
        module: the model ``fleet.distributed_model`` wraps.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.optimizers: list[AttachedOptimizer] = []
        self.handles: list[RemovableHandle] = []
        self._guard = _ReadGuard(self)
        self._depth = 0  # hooked forwards running, nested
        self._guarding = False  # whether the guard is on the torch function mode stack
        self._stale: dict[int, list[nn.Parameter]] = {}  # by storage address: what the guard finishes on a read

    def attach(self, optimizer: AttachedOptimizer) -> None:
        """Finish ``optimizer``'s gathers in this model's forward, if it overlaps them; installs the hooks once."""
        if optimizer in self.optimizers or not optimizer.defer_param_gather(True):
            return
        self.optimizers.append(optimizer)
        if not self.handles:
            for sub in self.module.modules():
                if next(sub.parameters(), None) is None:
                    continue  # nothing to finish, and nothing it runs can read a parameter of this model
                own = list(sub.parameters(recurse=False))
                # First among the pre-hooks, so the guard also watches those registered before (weight_norm's).
                self.handles.append(sub.register_forward_pre_hook(_PreHook(self, own), prepend=True))
                self.handles.append(sub.register_forward_hook(_PostHook(self), always_call=True))
                # On every such module, not only the model: model.module.encoder.state_dict() reads its parameters.
                self.handles.append(sub.register_state_dict_pre_hook(_FinishAll(self)))
                self.handles.append(sub.register_load_state_dict_pre_hook(_FinishAll(self)))
            self.handles.append(self.module.register_forward_hook(_FinishAll(self)))

    def remove(self) -> None:
        """Remove the hooks; the optimizers finish their gathers inside ``step()`` again."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for optimizer in self.optimizers:
            optimizer.defer_param_gather(False)
        self.optimizers.clear()

    def running(self) -> list[AttachedOptimizer]:
        """The optimizers whose gather has rounds left."""
        return [o for o in self.optimizers if o.master_weights.gather_running]

    def finish(self, params: list[nn.Parameter] | None) -> None:
        """Finish every attached optimizer's gather for ``params`` (``None``: all of it)."""
        for optimizer in self.optimizers:
            optimizer.finish_param_gather(params)
        if params is None or not self.running():
            self._stale.clear()
            return
        done = {id(p) for p in params}
        with DisableTorchFunction():  # the guard must not see the look-up
            for p in params:
                key = _address(p)
                if all(id(q) in done for q in self._stale.get(key, ())):
                    self._stale.pop(key, None)

    @torch.compiler.disable
    def enter(self, own: list[nn.Parameter]) -> None:
        """A hooked module is about to run: the outermost turns the guard on if a gather is running; finish ``own``."""
        self._depth += 1
        if self._depth == 1:
            running = self.running()
            if running:
                self._stale = {}
                with DisableTorchFunction():
                    for optimizer in running:
                        for p in optimizer.master_weights.model_params:
                            key = _address(p)
                            if key:
                                self._stale.setdefault(key, []).append(p)
                self._guard.__enter__()
                self._guarding = True
        if own:
            self.finish(own)
        self._guard_off_when_done()

    @torch.compiler.disable
    def leave(self) -> None:
        """A hooked module has returned (or raised): the outermost one turns the guard off."""
        if self._depth:
            self._depth -= 1
        self._guard_off_when_done()

    def _guard_off_when_done(self) -> None:
        """Pop the guard once the outermost forward is over or no parameter is stale any more (when it is on top:
        a mode pushed later inside the forward is popped first)."""
        if self._guarding and (not self._depth or not self._stale):
            stack = current_function_mode_stack()
            if stack and stack[-1] is self._guard:
                self._stale.clear()
                self._guard.__exit__(None, None, None)
                self._guarding = False


class _ReadGuard(TorchFunctionMode):
    """Finishes the rounds of any stale parameter handed to a torch function, before the function runs."""

    def __init__(self, owner: ForwardParamGather) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        stale = self.owner._stale
        if stale:
            with DisableTorchFunction():  # modes below this one need not see the look-up
                read = [p for t in _tensors((args, kwargs)) for p in stale.get(_address(t), ())]
            if read:
                self.owner.finish(read)
        return func(*args, **kwargs)


def _address(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s memory starts: the same for a parameter and every view or detached alias of it; 0 for
    none (empty, sparse, meta)."""
    try:
        return tensor.untyped_storage().data_ptr() if tensor.numel() else 0
    except (RuntimeError, NotImplementedError):
        return 0


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, through tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _Hook:
    """A hook of :class:`ForwardParamGather`: a copy of the model (``copy.deepcopy``, pickling) gets a
    :class:`_CopiedHook` instead, as a model trained without ``overlap_param_gather`` has no hook to copy."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _CopiedHook, ()


class _CopiedHook:
    """What each hook becomes in a copy of the model (an EMA, a best-model snapshot): nothing.

    The copy has no optimizer whose gather its forward could finish, and
    copying the hook must not copy the original's optimizers (which refuse
    to be copied); the copy holds the parameters as they were when it was
    made (after ``step()``, stale until the gather is finished).
    """

    def __call__(self, *_: Any) -> None:
        return None


class _PreHook(_Hook):
    """Before a module with parameters runs: :meth:`ForwardParamGather.enter`; compiled, finish everything."""

    def __init__(self, owner: ForwardParamGather, own: list[nn.Parameter]) -> None:
        self.owner, self.own = owner, own

    def __call__(self, *_: Any) -> None:
        if torch.compiler.is_compiling():
            _finish_all(self.owner)
        else:
            self.owner.enter(self.own)


class _PostHook(_Hook):
    """After a module with parameters has returned or raised: :meth:`ForwardParamGather.leave`."""

    def __init__(self, owner: ForwardParamGather) -> None:
        self.owner = owner

    def __call__(self, *_: Any) -> None:
        if not torch.compiler.is_compiling():
            self.owner.leave()


class _FinishAll(_Hook):
    """After the model's forward and before its ``state_dict()`` or ``load_state_dict()``: finish every attached
    optimizer's gather."""

    def __init__(self, owner: ForwardParamGather) -> None:
        self.owner = owner

    def __call__(self, *_: Any) -> None:
        _finish_all(self.owner)


@torch.compiler.disable
def _finish_all(owner: ForwardParamGather) -> None:
    owner.finish(None)
