"""ZeRO stage 2's gradient reducer: each rank keeps only its slice of the reduced gradient.

DDP keeps a full-size gradient bucket per parameter for the whole run, so
under it "gradients sharded" would be true of the wire only. This reducer
replaces DDP for stage 2, as DeepSpeed's stage 2 does with its IPG buckets
(``reduce_ipg_grads``) and FSDP2 does in its post-backward:

* a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``)
  copies each parameter's gradient, once autograd has accumulated it, divided by the
  world size (before the cast, as unsharded AMP divides before its wire cast) into
  its place in a 16-bit bucket and frees ``.grad`` at once;
* buckets hold consecutive parameters in reverse registration order (the
  order backward usually produces them) and are launched strictly in that
  order as each fills, so every rank issues the same collectives in the same
  order; each is reduce-scattered by
  :meth:`~distamp.sharding.reduce_scatter.ShardedGradReduce.launch`
  (16-bit on the wire, summed in FP32 into the owners' gradient slices,
  at most :data:`~distamp.sharding.reduce_scatter.MAX_IN_FLIGHT` rounds
  on the wire) while backward goes on, and freed when its exchange is done;
  at most :data:`OPEN_BUCKETS` are handed over and not yet summed;
* at the end of backward (a callback queued on autograd's engine from a
  hook on the forward's outputs, so it belongs to the outermost backward
  even under reentrant activation checkpointing) the buckets still waiting
  (those with a parameter that got no gradient) are sent and every
  exchange is finished.

Between backward and ``step()`` a rank therefore holds its gradient slice
and no ``.grad`` at all; during backward, at most the buckets being filled
plus :data:`OPEN_BUCKETS` handed over, and a gradient lent as a bucket larger
than :data:`OPEN_BUCKETS` buckets is summed before backward goes on
(:meth:`~distamp.sharding.reduce_scatter.ShardedGradReduce.launch`). Buckets are sized from the model
(:func:`~distamp.sharding.reduce_scatter.reduce_bucket_bytes`), as
DeepSpeed's ``reduce_bucket_size`` sizes its buckets independently of
anything else. A parameter alone in its bucket whose gradient already has
the wire dtype lends its gradient as the bucket (no copy).

What it does for users that DDP did: parameters and buffers are broadcast
from rank 0 when it is built, buffers again before each forward that
follows a training forward outside ``no_sync`` (``broadcast_buffers``, DDP's
rule), and with ``find_unused_parameters`` the ranks
agree which parameters got a gradient on any rank (the others keep
``grad = None`` in the optimizer, as with DDP); without it a parameter that
got no gradient counts as a zero gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.distributed.comm_hooks import CommStats, Pending
from distamp.model_views import parameters_device
from distamp.sharding.buffer_broadcast import BufferBroadcast, broadcast_from_rank0
from distamp.sharding.reduce_scatter import REDUCE_BUCKET_BYTES, ShardedGradReduce
from distamp.sharding.slice_owner import SliceOwner
from distamp.torch_compat import is_view, queue_autograd_callback, to_kwargs, tree_flatten

__all__ = ["SliceReducer"]

OPEN_BUCKETS = 3
"""Buckets handed over and not yet summed, at most: two may wait while a balanced round forms (see
:class:`~distamp.sharding.reduce_scatter.ShardedGradReduce`). On the benchmark MLP over a 1 Gbit/s link
(2 ranks) backward with its reduce-scatter took 93 ms with two (one waiting) and 61 ms with three,
where the line alone needs 52; peak memory on the 2.4M-parameter MLP went from 0.54x to 0.56x unsharded."""


@dataclass(frozen=True)
class _Bucket:
    """Consecutive parameters (reverse registration order) laid end to end in one wire-dtype buffer."""

    params: tuple[nn.Parameter, ...]
    offsets: tuple[int, ...]
    numel: int


class SliceReducer:
    """Stage 2's reducer: gradients into 16-bit buckets as they are accumulated, out as FP32 slices.

    Example (what ``DataParallel`` does with it)::

        reducer = SliceReducer(model, [optimizer.master_weights], torch.bfloat16, group)
        reducer.broadcast_from_rank0()
        reducer.before_forward(sync=True)
        args, kwargs = reducer.inputs_to_device((x,), {})
        loss = loss_fn(reducer.watch(model(*args, **kwargs)), y)
        loss.backward()        # .grad is None everywhere; the owners' FP32 slices hold the reduced sums

    The parameters' hooks hold the reducer weakly: once it is garbage, they
    are removed and the model's gradients are left alone.

    Args:
        module: the model; its parameters that require a gradient must all
            belong to ``shards``.
        shards: the sharded masters of every optimizer attached to the model.
        wire_dtype: dtype of the gradients in the buckets and on the wire.
        process_group: the data-parallel group (``None``: the world).
        pending: gradient-merge FP32 sums to add before the wire cast.
        bucket_bytes: bucket size cap in wire bytes (a larger parameter has a
            bucket of its own); also the exchange's round size.
        find_unused_parameters: agree over the ranks which parameters got a
            gradient (one small all-reduce per backward).
        broadcast_buffers: broadcast rank 0's buffers before each forward
            that will be reduced.
        device: the device this process trains on, where a CUDA model's
            inputs go (DDP's ``device_ids[0]``); ``None``: the parameters'.

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """

    def __init__(
        self,
        module: nn.Module,
        shards: Sequence[SliceOwner],
        wire_dtype: torch.dtype,
        process_group: dist.ProcessGroup | None = None,
        pending: Pending | None = None,
        bucket_bytes: int = REDUCE_BUCKET_BYTES,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        device: torch.device | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be > 0")
        self.exchange = ShardedGradReduce(shards, wire_dtype, process_group, pending, bucket_bytes, OPEN_BUCKETS)
        self.module = module
        self.device = device or parameters_device(module)
        """The model's device, where :meth:`inputs_to_device` moves a CUDA model's inputs."""
        self.shards = list(shards)
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.sync = True
        """Whether the backward of the last forward reduces (False under ``no_sync``: ``.grad`` accumulates)."""
        self._buffer_broadcast = BufferBroadcast(module, _group(process_group), broadcast_buffers)
        params = list(dict.fromkeys(p for p in reversed(list(module.parameters())) if p.requires_grad))  # by identity
        self.params = params
        self.buckets = _cut(params, max(1, bucket_bytes // wire_dtype.itemsize))
        self._slot = {id(p): (b, bucket.offsets[i])
                      for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._owner = {id(p): (shard, i) for shard in self.shards for i, p in enumerate(shard.model_params)}
        reducer = weakref.ref(self)

        def grad_ready(param: torch.Tensor) -> None:
            alive = reducer()
            if alive is not None:
                alive._grad_ready(param)

        self._handles = [p.register_post_accumulate_grad_hook(grad_ready) for p in params]
        weakref.finalize(self, _remove, self._handles)
        self._reset()

    @property
    def stats(self) -> CommStats:
        """Calls and bytes of the reduce-scatter."""
        return self.exchange.stats

    @property
    def bucket_count(self) -> int:
        """Number of buckets the gradients are cut into."""
        return len(self.buckets)

    def _reset(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the first bucket not yet launched
        self._used: set[int] = set()  # ids of the parameters that got a gradient in this backward
        self._flush_queued = False

    # ------------------------------------------------------------------ start-up and forward
    def broadcast_from_rank0(self, buffers: bool = True) -> None:
        """Every rank takes rank 0's parameters and, unless ``buffers`` is False, buffers (collective; once, when
        built). DDP with ``broadcast_buffers=False`` leaves each rank's buffers its own at build too."""
        states = [p.detach() for p in self.module.parameters()] + [b.detach() for b in self.module.buffers()
                                                                   if buffers]
        broadcast_from_rank0(states, _group(self.process_group))

    @torch.compiler.disable
    def before_forward(self, sync: bool) -> None:
        """Record whether this forward's backward reduces; broadcast rank 0's buffers first when DDP would.

        As DDP does, buffers are broadcast before a forward that follows a
        forward with gradients outside ``no_sync`` (and before the first).
        """
        if self._flush_queued:  # the last backward raised before its end: start clean
            self.exchange.finish_completed(wait=True)
            self._reset()
        self.sync = sync
        self._buffer_broadcast.before_forward()

    def inputs_to_device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """What DDP does with ``device_ids`` (and FSDP2 at its root): a CUDA model's inputs go to its device first.

        Tensors anywhere in ``args`` and ``kwargs`` (lists, dicts, dataclasses)
        are moved with DDP's own function; on a CPU model nothing changes.
        """
        if self.device.type != "cuda":
            return args, kwargs
        return to_kwargs(args, kwargs, self.device)

    @torch.compiler.disable
    def watch(self, output: Any) -> Any:
        """Hook the forward's output tensors so their backward queues the end-of-backward flush; returns ``output``."""
        if self._buffer_broadcast.after_forward(self.sync):
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._backward_started)
        return output

    # ------------------------------------------------------------------ backward
    def _backward_started(self, grad: torch.Tensor) -> None:
        self._queue_flush()

    def _queue_flush(self) -> None:
        if not self._flush_queued:
            self._flush_queued = True
            queue_autograd_callback(self._flush)

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: move ``param.grad`` into its bucket and free it."""
        if not self.sync:
            return
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise TypeError("sparse gradients are not supported by sharding stage 2; use dense gradients")
        self._queue_flush()  # a backward that did not start from a watched output
        b, offset = self._slot[id(param)]
        if b < self._next:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} received a second gradient in one backward after its "
                "bucket was sent (a parameter used both inside and outside a reentrant activation checkpoint); "
                "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        world = self.exchange.world_size
        if len(self.buckets[b].params) == 1 and _lendable(grad, self.exchange.wire_dtype):
            self._buffers[b] = grad.detach().view(-1).div_(world)  # the gradient is the bucket: no copy
            self._used.add(id(param))
            self._ready[b] = 1
            param.grad = None
            self._launch_ready()
            return
        buffer = self._buffers[b]
        if buffer is None:
            buffer = self._buffers[b] = torch.zeros(self.buckets[b].numel, dtype=self.exchange.wire_dtype,
                                                    device=grad.device)
        target = buffer[offset : offset + grad.numel()].view(grad.shape)
        if id(param) in self._used:  # a second accumulation in the same backward (reentrant checkpoint)
            _divide_into(target, grad, world, accumulate=True)
        else:
            _divide_into(target, grad, world)
            self._used.add(id(param))
            self._ready[b] += 1
        param.grad = None
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Send the filled buckets, in order, up to the first one still waiting for a gradient."""
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        buffer = self._buffers[b]
        if buffer is None:  # no parameter of it got a gradient on this rank: it still takes part, with zeros
            device = bucket.params[0].device
            buffer = torch.zeros(bucket.numel, dtype=self.exchange.wire_dtype, device=device)
        self._buffers[b] = None
        self._next = b + 1
        self.exchange.launch(buffer, bucket.params, divided=True)

    def _flush(self) -> None:
        """End of backward: send the buckets still waiting, finish every exchange, record who got a gradient."""
        for b in range(self._next, len(self.buckets)):
            self._launch(b)
        self.exchange.finish_completed(wait=True)
        arrived = self._agreed_used() if self.find_unused_parameters else self.params
        for shard in self.shards:
            shard.grads.reduced = True
            shard.grads.deliveries += 1
        for p in arrived:
            owner = self._owner.get(id(p))
            if owner is not None:
                owner[0].grads.arrived.add(owner[1])
        self._reset()

    def _agreed_used(self) -> list[nn.Parameter]:
        """The parameters that got a gradient on any rank (one all-reduce of a flag per parameter)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        flags = torch.tensor([id(p) in self._used for p in self.params], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        return [p for p, used in zip(self.params, flags.tolist(), strict=True) if used]

    def remove(self) -> None:
        """Remove the post-accumulate-grad hooks (also done when the reducer is garbage collected)."""
        _remove(self._handles)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


DIVIDE_SLAB = 1 << 15
"""Elements divided per call when a gradient is divided into a bucket of another dtype: torch computes such a
division in a temporary of the source dtype, which a slab bounds (128 KiB of FP32) instead of the gradient's size."""


def _divide_into(target: torch.Tensor, grad: torch.Tensor, world: int, accumulate: bool = False) -> None:
    """``target = grad / world`` (``+=`` with ``accumulate``), divided in ``grad``'s dtype before the cast to
    ``target``'s (the wire dtype), as unsharded AMP divides before its wire cast: an FP32 gradient that only
    fits FP16 once divided survives."""
    if grad.dtype == target.dtype or not grad.is_contiguous():
        if accumulate:
            target.add_(grad / world)
        else:
            torch.div(grad, world, out=target)
        return
    source, dest = grad.view(-1), target.view(-1)
    for lo in range(0, source.numel(), DIVIDE_SLAB):
        piece = dest[lo : lo + DIVIDE_SLAB]
        if accumulate:
            piece.add_(source[lo : lo + DIVIDE_SLAB] / world)
        else:
            torch.div(source[lo : lo + DIVIDE_SLAB], world, out=piece)


def _lendable(grad: torch.Tensor, wire_dtype: torch.dtype) -> bool:
    """Whether ``grad`` can serve as its bucket: the wire dtype, dense, and the sole user of its whole storage.

    Its storage is freed when the exchange is done, so it must not be a view
    (autograd may accumulate a slice of a larger gradient, e.g. of a ``cat``).
    """
    return (grad.dtype == wire_dtype and grad.is_contiguous() and not is_view(grad) and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size())


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD  # type: ignore[return-value]


def _cut(params: Sequence[nn.Parameter], bucket_elements: int) -> list[_Bucket]:
    """Consecutive parameters into buckets of at most ``bucket_elements`` (a larger parameter alone in one)."""
    buckets: list[_Bucket] = []
    members: list[nn.Parameter] = []
    offsets: list[int] = []
    size = 0
    for p in params:
        if members and size + p.numel() > bucket_elements:
            buckets.append(_Bucket(tuple(members), tuple(offsets), size))
            members, offsets, size = [], [], 0
        members.append(p)
        offsets.append(size)
        size += p.numel()
    if members:
        buckets.append(_Bucket(tuple(members), tuple(offsets), size))
    return buckets
