"""ZeRO stages 1 and 2: reduce-scatter each gradient bucket, 16-bit on the wire, summed in FP32.

In stage 1 DDP's reducer computes gradients into its buckets and calls this
module's comm hook per bucket as soon as the bucket is ready (overlapped
with the rest of backward); in stage 2 distamp's reducer
(:mod:`distamp.sharding.slice_reducer`) hands over its own buckets
through :meth:`ShardedGradReduce.launch`. Instead of all-reducing the bucket, the hook sends every rank
the elements of the bucket that rank owns in the flat parameter space
(:mod:`distamp.core.flat_layout`): one ``all_to_all_single`` of 16-bit
chunks with per-rank split sizes (gloo and NCCL both take split sizes), so
each element crosses the wire once, where an all-reduce sends it twice.
Each rank divides its gradients by W before the cast to the wire dtype,
as unsharded AMP's all-reduce does (an FP32 gradient in [65504, 65504 * W)
is finite once divided but inf if cast first: O1, and O2's FP32 norm
parameters), and adds the W received copies of its elements in FP32 into
its gradient slice (``grads`` of the sharded masters): an FP32
slice, where several backward passes (and gradient merge's micro-batches)
accumulate without 16-bit rounding, or in O2 without gradient merge a slice
in the model's 16-bit dtype, into which the FP32 sum is rounded once, as
unsharded O2's all-reduce leaves it in ``.grad``.

The exchanges go in rounds formed across buckets (see
:class:`ShardedGradReduce`): a round carries as many elements for every
destination rank, at most a bucket's bytes in all (:func:`reduce_bucket_bytes`)
and on gloo at most
:data:`~distamp.sharding.wire_rounds.GLOO_ROUND_BYTES` to each peer (see
:mod:`distamp.sharding.wire_rounds`), so a parameter larger than a bucket
never needs exchange buffers of its own size and every link carries as much
each way. That work runs on the backward thread: each call launches queued
rounds while fewer than :data:`MAX_IN_FLIGHT` are on the wire and finishes
those done, in order, and the last bucket's hook sends what is left and
waits for the rest, so DDP finds every future done. The stage-2 reducer
bounds the buckets open (handed over, not yet summed): when the wire is
slower than backward, a hand-over waits for the oldest rather than let the
buffers of every bucket pile up.

DDP lists a bucket's parameters in whatever order it chose (the first
iteration uses one order, later ones the order gradients became ready), so
the hook takes them from ``bucket.parameters()`` every time and caches one
plan per parameter order.

What the model's ``.grad`` holds: the hook returns the bucket zeroed, so
after ``backward`` the ``.grad`` of every parameter in a bucket is zero on
every rank; the reduced gradient exists only as the owners' slices.
"""

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distamp.distributed.comm_hooks import CommStats, Pending, add_pending_fp32
from distamp.sharding.slice_owner import SliceOwner
from distamp.sharding.wire_rounds import round_bytes
from distamp.strategy import DEFAULT_FUSE_GRAD_SIZE_IN_MB
from distamp.torch_compat import foreach_add_

__all__ = ["BUCKET_FRACTION", "MAX_IN_FLIGHT", "REDUCE_BUCKET_BYTES", "ShardedGradReduce", "bucket_future",
           "reduce_bucket_bytes", "reduce_scatter_hook"]

MAX_IN_FLIGHT = 2
"""Rounds on the wire at once, each with its packed send and W received copies."""

REDUCE_BUCKET_BYTES = 1 << 18
"""Smallest gradient bucket of sharding stages 1 and 2, in wire bytes (see :func:`reduce_bucket_bytes`)."""

BUCKET_FRACTION = 16
"""A bucket is at most this fraction of the model's 16-bit gradient (above :data:`REDUCE_BUCKET_BYTES`)."""


def reduce_bucket_bytes(gradient_bytes: int, fuse_grad_size_in_MB: float) -> int:
    """Bucket size (and round size) of the sharded stages for a gradient of ``gradient_bytes`` on the wire.

    DeepSpeed's ``reduce_bucket_size``. A ``fuse_grad_size_in_MB`` other
    than the default (:data:`~distamp.strategy.DEFAULT_FUSE_GRAD_SIZE_IN_MB`)
    is the bucket size, as DDP's ``bucket_cap_mb`` and DeepSpeed's
    ``reduce_bucket_size`` are: the user's trade of memory against time.

    At the default the size is chosen from the model: each of the
    :data:`MAX_IN_FLIGHT` exchanges holds a packed copy and the W received
    copies of this rank's share (as many bytes as the bucket), so peak
    memory holds a few buckets, which a fixed 25 MB would make most of what
    stage 2 saves on a model of a few million parameters; but every bucket
    and round costs gloo CPU time, which small buckets multiply (stage 2
    on the 6.56M-parameter benchmark MLP, 2 ranks: 512 KB buckets took
    1.46x-1.57x the CPU time of the unsharded step, an eighth of the
    gradient 1.08x-1.19x, on a shared 2-core host). An eighth left stage 2
    of O2 BF16 AdamW on the 2.40M-parameter MLP of the memory test at
    11.3 bytes per parameter on 2 ranks (0.63x of sharding off; buckets
    open and rounds in flight held 1.9 of them), above the 0.60x the
    sharded stages promise; a sixteenth (at least 256 KiB) holds half as
    much: 10.2 (0.57x), and costs CPU time: on the 6.56M MLP, loopback, 2
    ranks, stage 1 stepped in 1.17x-1.21x and stage 2 in 1.28x-1.35x of the
    unsharded time, where an eighth gave 1.04x-1.09x and 0.96x-1.26x (same
    host, runs interleaved). The memory bar is kept: a bucket is a sixteenth of
    the gradient, at least :data:`REDUCE_BUCKET_BYTES` and at most the
    default's 25 MB.
    """
    fuse_bytes = max(1, int(fuse_grad_size_in_MB * 2**20))
    if fuse_grad_size_in_MB != DEFAULT_FUSE_GRAD_SIZE_IN_MB:
        return fuse_bytes
    return min(fuse_bytes, max(REDUCE_BUCKET_BYTES, gradient_bytes // BUCKET_FRACTION))


_Entry = tuple[int, int, SliceOwner, int]  # (start in the bucket, length, slice owner, start in its grad slice)
_Part = tuple["_Exchange", int, int, SliceOwner, int]  # an entry of one handed-over bucket: (exchange, *entry)


@dataclass(frozen=True)
class _BucketPlan:
    """Where the elements of one bucket go: for each destination rank, its entries in bucket order."""

    per_rank: tuple[tuple[_Entry, ...], ...]
    numel: int


class ShardedGradReduce:
    """State of the reduce-scatter: the layouts it reduces for, the wire dtype, rounds in flight, byte counters.

    Rounds are formed from a pool of the elements handed over and not yet
    sent, kept per destination rank in hand-over order. A round takes the
    same number of elements for every destination (at most a round's share
    each), so every rank sends as much as it receives: with one contiguous
    slice per rank, a bucket of the last layers' gradients belongs mostly to
    the last rank, and sending it on its own would load one direction of
    each link (one rank's ingress) while the others idle (stage 1 on the
    benchmark MLP over a 1 Gbit/s link, 2 ranks: 78 ms for a reduce-scatter
    the line allows in 52). Elements wait in the pool until every
    destination has a round's share, at most ``max_pending`` buckets of
    them (the oldest then goes in rounds as it is), and the last bucket of
    a backward sends everything. Which rounds go out is a function of the
    buckets handed over only, never of timing, so every rank launches the
    same collectives in the same order.

    Example::

        hook = ShardedGradReduce([optimizer.master_weights], torch.bfloat16, group)
        hook.register(ddp_model)

    Args:
        shards: the sharded masters of every optimizer attached to the model;
            together they must own every parameter DDP reduces.
        wire_dtype: dtype of the gradients on the wire.
        process_group: the data-parallel group (``None``: the world).
        pending: returns gradient-merge FP32 sums to add before the wire cast
            (see :class:`~distamp.distributed.comm_hooks.PendingFp32Grads`).
        bucket_bytes: most bytes one round sends in all (see
            :func:`reduce_bucket_bytes`).
        max_open: most buckets handed over and not yet summed before
            :meth:`launch` waits for the oldest (``None``: no bound, for
            DDP's buckets, which live through backward anyway); elements of
            at most ``max_open - 1`` buckets wait for a balanced round.

    Raises:
        TypeError: an unsupported ``wire_dtype``.
        ValueError: ``max_open`` < 1.
    """

    def __init__(
        self,
        shards: Sequence[SliceOwner],
        wire_dtype: torch.dtype,
        process_group: dist.ProcessGroup | None = None,
        pending: Pending | None = None,
        bucket_bytes: int = REDUCE_BUCKET_BYTES,
        max_open: int | None = None,
    ) -> None:
        if wire_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"wire_dtype={wire_dtype!r} is not supported; use torch.float16, bfloat16 or float32")
        if max_open is not None and max_open < 1:
            raise ValueError(f"max_open={max_open!r} must be >= 1 or None")
        self.wire_dtype = wire_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.pending = pending
        self.max_open = max_open
        self.max_pending = None if max_open is None else max_open - 1
        self.stats = CommStats()
        self.open: deque[_Exchange] = deque()  # buckets handed over and not yet summed, in order
        self._pool: list[deque[_Part]] = [deque() for _ in range(self.world_size)]  # not yet in a round
        self._pool_sizes = [0] * self.world_size
        self._unsent: deque[_Exchange] = deque()  # exchanges with elements in the pool, in order
        self._queued: deque[_RoundExchange] = deque()  # rounds not yet launched, in order
        self._running: deque[_RoundExchange] = deque()  # rounds on the wire, in launch order
        self.bucket_bytes = bucket_bytes
        round_elements = max(1, bucket_bytes // wire_dtype.itemsize)
        limit = round_bytes(process_group)
        share = max(1, round_elements // self.world_size)
        self.share = share if limit is None else min(share, max(1, limit // wire_dtype.itemsize))
        """Most elements a round carries for one destination (a bucket's bytes in all; gloo's limit per peer)."""
        self._owner = {id(p): (shard, i) for shard in shards for i, p in enumerate(shard.model_params)}
        self._plans: dict[tuple[int, ...], _BucketPlan] = {}
        self._backward_numel: int | None = None  # elements DDP hands over per backward (set by register)
        self._received_numel = 0  # elements DDP handed over so far in this backward

    def finish_completed(self, wait: bool) -> None:
        """Launch queued rounds while fewer than :data:`MAX_IN_FLIGHT` run; finish those done.

        With ``wait``: first put every element still in the pool into
        rounds (the end of backward), then finish every round.

        Rounds launch and finish in order. Finishing happens here, on the
        thread that runs backward, not in a callback on the communication
        thread: the received copies are summed and freed as soon as a later
        call finds them done, and every allocation and free is seen by
        ``torch.profiler``'s memory events, which only record the profiled
        thread.
        """
        if wait:
            self._form_rounds(flush=True)
        while self._advance(block=wait):
            pass

    def _advance(self, block: bool) -> bool:
        """Launch one round if there is room, else finish the oldest if done (or ``block``); False: nothing to do."""
        if self._queued and len(self._running) < MAX_IN_FLIGHT:
            rnd = self._queued.popleft()
            rnd.start(self)
            self._running.append(rnd)
            return True
        if self._running and (block or self._running[0].is_completed()):
            self._running.popleft().finish(self.world_size)
            self._complete_done()
            return True
        return False

    def _complete_done(self) -> None:
        """Complete the buckets, oldest first, whose every element is summed."""
        while self.open and self.open[0].is_done():
            self.open.popleft().complete()

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        """Install this hook on ``ddp`` (once, before its first backward)."""
        self._backward_numel = sum(p.numel() for p in ddp_reduced_parameters(ddp))
        ddp.register_comm_hook(self, reduce_scatter_hook)

    def is_last_bucket(self, bucket: dist.GradBucket) -> bool:
        """Whether ``bucket`` is the last DDP hands over in this backward (it has then handed over every element).

        DDP hands every bucket to the hook once per backward (with
        ``find_unused_parameters`` too). ``bucket.is_last()`` alone is not
        enough: in the first backward with ``static_graph=True`` DDP hands all
        buckets over at the end under one index, 0, so none is last.
        """
        self._received_numel += bucket.buffer().numel()
        last = bucket.is_last() or (self._backward_numel is not None and self._received_numel >= self._backward_numel)
        if last:
            self._received_numel = 0
        return last

    def plan(self, params: Sequence[torch.Tensor]) -> _BucketPlan:
        """Where the elements of a bucket holding ``params`` in this order go (cached)."""
        key = tuple(id(p) for p in params)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build(params)
        return plan

    def _build(self, params: Sequence[torch.Tensor]) -> _BucketPlan:
        per_rank: list[list[_Entry]] = [[] for _ in range(self.world_size)]
        position = 0
        for p in params:
            shard, index = self._owner[id(p)]
            for rank, piece in shard.layout.owners(index):
                per_rank[rank].append((position + piece.start, piece.length, shard, piece.offset - shard.lo))
            position += p.numel()
        return _BucketPlan(per_rank=tuple(tuple(entries) for entries in per_rank), numel=position)

    def launch(self, buffer: torch.Tensor, params: Sequence[torch.Tensor],
               done: torch.futures.Future | None = None, last: bool = False, divided: bool = False) -> None:
        """Hand over ``buffer`` (the gradients of ``params``, end to end) for reduce-scattering into the owners' slices.

        The buffer is divided by the world size in place before anything is
        cast to the wire dtype, unless ``divided`` says its gradients were
        divided already (the stage-2 reducer divides each as it copies it
        into its 16-bit bucket).

        Waits first for the oldest bucket while ``max_open`` are open. When
        every element is summed, ``buffer`` is zeroed and ``done`` (DDP's
        bucket future) completed with it; without ``done`` the buffer's
        storage is freed (the stage-2 reducer's own buckets). ``last``: the
        last bucket of this backward, after which every element goes out.

        With ``max_open``, a bucket larger than ``max_open`` buckets (a
        parameter's gradient lent as its own bucket) goes out at once with
        everything waiting, and this call returns only when all is summed:
        backward then computes the next gradient after that one is freed,
        not while it is on the wire. Whether a bucket is that large depends on
        its size only, so every rank decides alike.
        """
        while self.max_open is not None and len(self.open) >= self.max_open and (self._running or self._queued):
            self._advance(block=True)  # bound the open buckets when the wire is slower than backward
        plan = self.plan(params)
        add_pending_fp32(buffer, params, self.pending)
        if not divided and self.world_size > 1:
            buffer.div_(self.world_size)
        exchange = _Exchange(buffer, done, unsent=plan.numel)  # every element has one owner
        for entries in plan.per_rank:
            for _, _, shard, _ in entries:
                shard.grads.reduced = True
        self.open.append(exchange)
        if exchange.unsent:
            self._unsent.append(exchange)
            for rank, entries in enumerate(plan.per_rank):
                self._pool[rank].extend((exchange, *entry) for entry in entries)
                self._pool_sizes[rank] += sum(entry[1] for entry in entries)
        large = self.max_open is not None and plan.numel * self.wire_dtype.itemsize > self.max_open * self.bucket_bytes
        self._form_rounds(flush=last)
        self._complete_done()  # a bucket with nothing to send
        self.finish_completed(wait=large)

    def _form_rounds(self, flush: bool) -> None:
        """Queue the rounds the pool allows: balanced ones; the oldest bucket's when too many wait; all on ``flush``."""
        while True:
            sizes = self._pool_sizes
            if min(sizes) >= self.share:
                take = [self.share] * self.world_size
            elif flush and max(sizes) > 0:
                take = [min(self.share, n) for n in sizes]
            elif self.max_pending is not None and sum(1 for e in self._unsent if e.unsent) > self.max_pending:
                oldest = self._unsent[0]
                take = [min(self.share, _front_of(pool, oldest)) for pool in self._pool]
            else:
                return
            self._queued.append(self._take(take))

    def _take(self, take: list[int]) -> "_RoundExchange":
        """A round of ``take[d]`` elements from the front of each destination ``d``'s pool."""
        parts: list[tuple[_Part, ...]] = []
        for rank, want in enumerate(take):
            pool, out = self._pool[rank], []
            self._pool_sizes[rank] -= want
            while want:
                exchange, start, length, shard, slice_start = pool[0]
                n = min(want, length)
                out.append((exchange, start, n, shard, slice_start))
                if n == length:
                    pool.popleft()
                else:
                    pool[0] = (exchange, start + n, length - n, shard, slice_start + n)
                exchange.unsent -= n
                want -= n
            parts.append(tuple(out))
        rnd = _RoundExchange(tuple(parts), tuple(take), self.rank)
        for exchange in rnd.exchanges:
            exchange.rounds_open += 1
        while self._unsent and not self._unsent[0].unsent:
            self._unsent.popleft()
        return rnd


def _front_of(pool: deque[_Part], exchange: "_Exchange") -> int:
    """Elements at the front of ``pool`` that belong to ``exchange``."""
    total = 0
    for part in pool:
        if part[0] is not exchange:
            break
        total += part[2]
    return total


# No ``from __future__ import annotations`` here: DDP checks this hook's annotations as objects.
def reduce_scatter_hook(state: ShardedGradReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook body for :class:`ShardedGradReduce` (``state`` is the instance)."""
    buffer = bucket.buffer()
    done = bucket_future(buffer)
    last = state.is_last_bucket(bucket)
    state.launch(buffer, bucket.parameters(), done, last=last)
    if last:
        state.finish_completed(wait=True)  # DDP waits for every bucket's future right after this hook
    return done


def ddp_reduced_parameters(ddp: "torch.nn.parallel.DistributedDataParallel") -> list[torch.Tensor]:
    """The parameters whose gradients ``ddp``'s reducer puts in its buckets: those requiring grad, not in
    ``ddp.parameters_to_ignore``, each once (DDP's own rule)."""
    seen: dict[int, torch.Tensor] = {}
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad and f"{module_name}.{name}" not in ddp.parameters_to_ignore:
                seen.setdefault(id(p), p)
    return list(seen.values())


def bucket_future(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The future a comm hook returns for ``buffer``, completed later on the thread that runs backward.

    DDP waits on it and reads the bucket from it. On CUDA it is told the
    device: completing it then records an event on the current stream, and
    a stream that waits on it waits for that event. A device-less future
    takes CUDA tensors without complaint but records no event (torch checks
    a result's devices only for a future given devices: ``markCompleted``
    in ``ATen/core/ivalue_inl.h``), so its waiters would not be ordered
    after the stream that wrote the bucket.
    """
    return torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)


class _RoundExchange:
    """One all-to-all: for each destination rank, in rank order, parts of handed-over buckets; then summed.

    The same on every rank but for which parts are this rank's to sum.
    """

    def __init__(self, parts: tuple[tuple[_Part, ...], ...], input_splits: tuple[int, ...], rank: int) -> None:
        self.parts = parts
        self.input_splits = input_splits
        self.received = input_splits[rank]  # every rank sends this rank as many elements as it sends anyone
        self.dest = tuple((shard, slice_start, length) for _, _, length, shard, slice_start in parts[rank])
        self.exchanges = tuple(dict.fromkeys(part[0] for rank_parts in parts for part in rank_parts))
        self.work: dist.Work | None = None
        self.send: torch.Tensor | None = None  # kept alive until the round is summed
        self.received_copies: torch.Tensor | None = None

    def _whole_bucket(self) -> torch.Tensor | None:
        """The bucket when this round sends exactly one bucket, in its own order: it goes without packing."""
        if len(self.exchanges) != 1:
            return None
        buffer, position = self.exchanges[0].buffer, 0
        for rank_parts in self.parts:
            for _, start, length, _, _ in rank_parts:
                if start != position:
                    return None
                position += length
        return buffer if position == buffer.numel() else None

    def start(self, state: ShardedGradReduce) -> None:
        """Pack this round's elements (unless it is one bucket as it is) and launch its all-to-all."""
        whole = self._whole_bucket()
        if whole is not None:
            send = whole if whole.dtype == state.wire_dtype else whole.to(state.wire_dtype)
        else:
            pieces = [exchange.buffer[start : start + length]
                      for rank_parts in self.parts for exchange, start, length, _, _ in rank_parts]
            send = torch.cat(pieces).to(state.wire_dtype)
        world = state.world_size
        device = self.exchanges[0].buffer.device
        received = torch.empty(world * self.received, dtype=state.wire_dtype, device=device)
        state.stats.calls += 1
        state.stats.bytes += send.numel() * send.element_size()
        self.work = dist.all_to_all_single(
            received, send, [self.received] * world, list(self.input_splits), group=state.process_group,
            async_op=True,
        )
        self.send, self.received_copies = send, received

    def is_completed(self) -> bool:
        """Whether the round has arrived."""
        return self.work is not None and self.work.is_completed()

    def finish(self, world: int) -> None:
        """Sum the received copies in FP32 into the owners' slices (:func:`_sum_into_slices`) and free the round's
        buffers."""
        if self.work is None or self.received_copies is None or self.send is None:
            raise RuntimeError("finish() before start()")
        self.work.wait()
        if self.received:
            _sum_into_slices(self.received_copies, self.received, self.dest, world)
        # Free the exchange buffers here and now: the communication thread may still hold them a moment
        # (and would then free them where the profiler does not look). On CUDA this is stream-safe:
        # work.wait() made the current stream (the buffers' allocation stream, whose blocks the caching
        # allocator reuses only for that stream) wait for NCCL's, and NCCL recorded its own use of them.
        buffers = {exchange.buffer.data_ptr() for exchange in self.exchanges}
        for tensor in (self.send, self.received_copies):
            if tensor.data_ptr() not in buffers:
                tensor.untyped_storage().resize_(0)
        self.send = self.received_copies = None
        for exchange in self.exchanges:
            exchange.rounds_open -= 1
        self.exchanges = ()
        self.parts = ()


SUM_SLAB = 1 << 15
"""Elements a 16-bit gradient slice receives per FP32 partial sum: a 128 KiB temporary (and as much for the cast of
each copy to FP32), whatever the round. Slabs of 8K elements saved 0.1 byte per parameter at stage 2's peak but
made its loopback step 1.3x-1.5x the unsharded one (6.56M MLP, 2 ranks), the Python loop dominating."""


def _sum_into_slices(received: torch.Tensor, n: int, dest: tuple[tuple[SliceOwner, int, int], ...],
                     world: int) -> None:
    """Add the ``world`` received copies (``n`` elements each, end to end, each already divided by the world
    size) into the owners' slices, so they receive the mean.

    Each copy is added in FP32, rank by rank. An FP32 slice takes the copies straight
    (no FP32 temporary); a 16-bit slice gets the FP32 sum of every copy
    rounded once into it, as the unsharded all-reduce on 2 ranks rounds
    ``g0/2 + g1/2`` once into the 16-bit ``.grad``, built :data:`SUM_SLAB`
    elements at a time.
    """
    lengths = [length for _, _, length in dest]
    targets = [shard.grads.buffer[start : start + length] for shard, start, length in dest]
    if all(t.dtype == torch.float32 for t in targets):
        for r in range(world):
            foreach_add_(targets, list(received[r * n : (r + 1) * n].split(lengths)))
        return
    partial = torch.empty(min(n, SUM_SLAB), dtype=torch.float32, device=received.device)
    position = 0
    for target, length in zip(targets, lengths, strict=True):
        for lo in range(0, length, SUM_SLAB):
            m = min(SUM_SLAB, length - lo)
            acc = partial[:m].zero_()
            for r in range(world):
                start = r * n + position + lo
                acc.add_(received[start : start + m])
            target[lo : lo + m].add_(acc)
        position += length


@dataclass(eq=False)
class _Exchange:
    """One bucket handed over for reduce-scattering, and what to do once all its elements are summed."""

    buffer: torch.Tensor
    done: torch.futures.Future | None  # DDP's bucket future; None: free the buffer when finished
    unsent: int  # elements not yet in a round
    rounds_open: int = 0  # rounds holding some of its elements, not yet summed

    def is_done(self) -> bool:
        """Every element is in a round and every such round is summed."""
        return self.unsent == 0 and self.rounds_open == 0

    def complete(self) -> None:
        """Zero the bucket and complete the future, or free the bucket."""
        if self.done is None:
            self.buffer.untyped_storage().resize_(0)
            return
        self.buffer.zero_()
        self.done.set_result(self.buffer)
