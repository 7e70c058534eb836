"""ZeRO stages 1 and 2: reduce-scatter each gradient bucket, 16-bit on the wire, summed in FP32.

In stage 1 DDP's reducer computes gradients into its buckets and calls this
module's comm hook per bucket as soon as the bucket is ready (overlapped
with the rest of backward); in stage 2 distamp's reducer
(:mod:`distamp.distributed.slice_reducer`) hands over its own buckets
through :meth:`ShardedGradReduce.launch`. Instead of all-reducing the bucket, the hook sends every rank
the elements of the bucket that rank owns in the flat parameter space
(:mod:`distamp.distributed.flat_layout`): one ``all_to_all_single`` of 16-bit
chunks with per-rank split sizes (gloo and NCCL both take split sizes), so
each element crosses the wire once, where an all-reduce sends it twice.
Each rank then adds the W received copies of its elements, divided by W,
in FP32 into its FP32 gradient slice (``grads`` of the sharded masters), where
several backward passes (and gradient
merge's micro-batches) accumulate without 16-bit rounding. A bucket's
exchange is cut into rounds that send at most a bucket's bytes
(:func:`reduce_bucket_bytes`) in all (and on gloo at most
:data:`~distamp.distributed.wire_rounds.GLOO_ROUND_BYTES` to each peer; see
:mod:`distamp.distributed.wire_rounds`), each destination's elements cut
evenly, round by round, so a parameter larger than a bucket never needs
exchange buffers of its own size. No pre-division is needed: the sum is
FP32, so it cannot overflow. That work runs on the backward thread: each
call launches queued rounds while fewer than :data:`MAX_IN_FLIGHT` are on
the wire and finishes those done, in order, and the last bucket's hook
waits for the rest, so DDP finds every future done. At most
:data:`MAX_IN_FLIGHT` buckets are open (handed over, not yet summed): when
the wire is slower than backward, a hook waits for the oldest rather than
let the buffers of every bucket pile up.

DDP lists a bucket's parameters in whatever order it chose (the first
iteration uses one order, later ones the order gradients became ready), so
the hook takes them from ``bucket.parameters()`` every time and caches one
plan per parameter order.

What the model's ``.grad`` holds: the hook returns the bucket zeroed, so
after ``backward`` the ``.grad`` of every parameter in a bucket is zero on
every rank; the reduced gradient exists only as the owners' FP32 slices.
"""

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distamp.distributed.attached import SliceOwner
from distamp.distributed.comm_hooks import CommStats, Pending, add_pending_fp32
from distamp.distributed.wire_rounds import round_bytes

__all__ = ["BUCKET_FRACTION", "MAX_IN_FLIGHT", "REDUCE_BUCKET_BYTES", "ShardedGradReduce", "bucket_future",
           "reduce_bucket_bytes", "reduce_scatter_hook"]

MAX_IN_FLIGHT = 2
"""Rounds on the wire at once (each with its packed send and W received copies), and buckets open at once."""

REDUCE_BUCKET_BYTES = 1 << 19
"""Smallest gradient bucket of sharding stages 1 and 2, in wire bytes (see :func:`reduce_bucket_bytes`)."""

BUCKET_FRACTION = 8
"""A bucket is at most this fraction of the model's 16-bit gradient (above :data:`REDUCE_BUCKET_BYTES`)."""


def reduce_bucket_bytes(gradient_bytes: int, fuse_bytes: int) -> int:
    """Bucket size (and round size) of the sharded stages for a gradient of ``gradient_bytes`` on the wire.

    DeepSpeed's ``reduce_bucket_size``, chosen from the model: each of the
    :data:`MAX_IN_FLIGHT` exchanges holds a packed copy and the W received
    copies of this rank's share (as many bytes as the bucket), so peak
    memory holds a few buckets, which a fixed 25 MB would make most of what
    stage 2 saves on a model of a few million parameters; but every bucket
    and round costs gloo CPU time, which small buckets multiply (stage 2
    on the 6.56M-parameter benchmark MLP, 2 ranks: 512 KB buckets took
    1.46x-1.57x the CPU time of the unsharded step, an eighth of the
    gradient 1.08x-1.19x, on a shared 2-core host). So a bucket is an
    eighth of the gradient, at least :data:`REDUCE_BUCKET_BYTES` and at
    most ``fuse_bytes`` (``fuse_grad_size_in_MB``).
    """
    return max(1, min(fuse_bytes, max(REDUCE_BUCKET_BYTES, gradient_bytes // BUCKET_FRACTION)))


_Entry = tuple[int, int, SliceOwner, int]  # (start in the bucket, length, slice owner, start in its grad slice)


@dataclass(frozen=True)
class _Round:
    """One all-to-all of a bucket's exchange (the same on every rank but for ``dest``)."""

    send: tuple[tuple[int, int], ...]  # (start, length) in the bucket, grouped by owning rank in rank order
    input_splits: tuple[int, ...]
    received: int  # elements this rank owns in the round
    dest: tuple[tuple[SliceOwner, int, int], ...]  # (slice owner, start in its grad slice, length)


@dataclass(frozen=True)
class _BucketPlan:
    """Who gets which elements of one bucket, round by round, and where this rank's go."""

    rounds: tuple[_Round, ...]
    identity: bool  # one round whose send is the bucket as it is: no packing copy needed


def _window(entries: list[_Entry], lo: int, hi: int) -> list[_Entry]:
    """The part of ``entries`` (laid end to end) from element ``lo`` to ``hi``."""
    out, position = [], 0
    for start, length, shard, slice_start in entries:
        a, b = max(lo, position), min(hi, position + length)
        if b > a:
            out.append((start + a - position, b - a, shard, slice_start + a - position))
        position += length
    return out


class ShardedGradReduce:
    """State of the reduce-scatter: the layouts it reduces for, the wire dtype, rounds in flight, byte counters.

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

    Raises:
        TypeError: an unsupported ``wire_dtype``.
    """

    def __init__(
        self,
        shards: Sequence[SliceOwner],
        wire_dtype: torch.dtype,
        process_group: dist.ProcessGroup | None = None,
        pending: Pending | None = None,
        bucket_bytes: int = REDUCE_BUCKET_BYTES,
    ) -> None:
        if wire_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"wire_dtype={wire_dtype!r} is not supported; use torch.float16, bfloat16 or float32")
        self.wire_dtype = wire_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.pending = pending
        self.stats = CommStats()
        self.open: deque[_Exchange] = deque()  # buckets handed over and not yet summed, in order
        self._queued: deque[_RoundExchange] = deque()  # rounds not yet launched, in order
        self._running: deque[_RoundExchange] = deque()  # rounds on the wire, in launch order
        self.round_elements = max(1, bucket_bytes // wire_dtype.itemsize)
        """Most elements a rank sends per round, to all peers together."""
        limit = round_bytes(process_group)
        self.peer_elements = None if limit is None else max(1, limit // wire_dtype.itemsize)
        """Most elements a rank sends to one peer per round (``None``: no limit)."""
        self._owner = {id(p): (shard, i) for shard in shards for i, p in enumerate(shard.model_params)}
        self._plans: dict[tuple[int, ...], _BucketPlan] = {}

    def finish_completed(self, wait: bool) -> None:
        """Launch queued rounds while fewer than :data:`MAX_IN_FLIGHT` run; finish those done (all with ``wait``).

        Rounds launch and finish in order. Finishing happens here, on the
        thread that runs backward, not in a callback on the communication
        thread: the received copies are summed and freed as soon as a later
        call finds them done, and every allocation and free is seen by
        ``torch.profiler``'s memory events, which only record the profiled
        thread.
        """
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
            while self.open and self.open[0].done_rounds == len(self.open[0].rounds):
                self.open.popleft().complete()
            return True
        return False

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        """Install this hook on ``ddp`` (once, before its first backward)."""
        ddp.register_comm_hook(self, reduce_scatter_hook)

    def plan(self, params: Sequence[torch.Tensor]) -> _BucketPlan:
        """The plan for a bucket holding ``params`` in this order (cached)."""
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
        totals = [sum(e[1] for e in entries) for entries in per_rank]
        # The same count on every rank: it depends only on the bucket and the layout.
        count = max(1, -(-sum(totals) // self.round_elements))
        if self.peer_elements is not None:
            count = max(count, -(-max(totals) // self.peer_elements))
        rounds = []
        for j in range(count):
            parts = [_window(entries, j * n // count, (j + 1) * n // count)
                     for entries, n in zip(per_rank, totals, strict=True)]
            mine = parts[self.rank]
            rounds.append(_Round(
                send=tuple((start, length) for entries in parts for start, length, _, _ in entries),
                input_splits=tuple(sum(e[1] for e in entries) for entries in parts),
                received=sum(e[1] for e in mine),
                dest=tuple((shard, start, length) for _, length, shard, start in mine),
            ))
        send = rounds[0].send
        identity = count == 1 and (not send or send[0][0] == 0) and sum(totals) == position
        identity = identity and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(send))
        return _BucketPlan(rounds=tuple(rounds), identity=identity)

    def launch(self, buffer: torch.Tensor, params: Sequence[torch.Tensor],
               done: torch.futures.Future | None = None) -> None:
        """Queue the reduce-scatter of ``buffer`` (the gradients of ``params``, end to end) into the owners' slices.

        Waits first for the oldest bucket while :data:`MAX_IN_FLIGHT` are
        open. When every round is summed, ``buffer`` is zeroed and ``done``
        (DDP's bucket future) completed with it; without ``done`` the
        buffer's storage is freed (the stage-2 reducer's own buckets).
        """
        while len(self.open) >= MAX_IN_FLIGHT:  # bound the open buckets when the wire is slower than backward
            self._advance(block=True)
        plan = self.plan(params)
        add_pending_fp32(buffer, params, self.pending)
        exchange = _Exchange(buffer, done, plan.identity)
        exchange.rounds = [_RoundExchange(exchange, rnd) for rnd in plan.rounds]
        for rnd in plan.rounds:
            for shard, _, _ in rnd.dest:
                shard.grads.reduced = True
        self.open.append(exchange)
        self._queued.extend(exchange.rounds)
        if not exchange.rounds:
            self.open.remove(exchange)
            exchange.complete()
        self.finish_completed(wait=False)


# No ``from __future__ import annotations`` here: DDP checks this hook's annotations as objects.
def reduce_scatter_hook(state: ShardedGradReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook body for :class:`ShardedGradReduce` (``state`` is the instance)."""
    buffer = bucket.buffer()
    done = bucket_future(buffer)
    state.launch(buffer, bucket.parameters(), done)
    if bucket.is_last():
        state.finish_completed(wait=True)  # DDP waits for every bucket's future right after this hook
    return done


def bucket_future(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The future a comm hook returns for ``buffer``, completed later on the thread that runs backward.

    DDP waits on it and reads the bucket from it. On CUDA it is told the
    device: completing it then records an event on the current stream, and
    a stream that waits on it waits for that event (a device-less future
    refuses CUDA tensors).
    """
    return torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)


@dataclass(eq=False)
class _RoundExchange:
    """One round of a bucket's exchange: queued, then on the wire with its buffers, then summed."""

    exchange: "_Exchange"
    round: _Round
    work: dist.Work | None = None
    send: torch.Tensor | None = None  # kept alive until the exchange is done
    received: torch.Tensor | None = None

    def start(self, state: ShardedGradReduce) -> None:
        """Pack this round's elements (unless the bucket goes as it is) and launch its all-to-all."""
        rnd, buffer, world = self.round, self.exchange.buffer, state.world_size
        if self.exchange.identity:
            send = buffer if buffer.dtype == state.wire_dtype else buffer.to(state.wire_dtype)
        else:
            send = torch.cat([buffer[start : start + length] for start, length in rnd.send]).to(state.wire_dtype)
        received = torch.empty(world * rnd.received, dtype=state.wire_dtype, device=buffer.device)
        state.stats.calls += 1
        state.stats.bytes += send.numel() * send.element_size()
        self.work = dist.all_to_all_single(
            received, send, [rnd.received] * world, list(rnd.input_splits), group=state.process_group,
            async_op=True,
        )
        self.send, self.received = send, received

    def is_completed(self) -> bool:
        """Whether the round has arrived."""
        return self.work is not None and self.work.is_completed()

    def finish(self, world: int) -> None:
        """Sum the received copies in FP32 into the owners' slices and free the round's buffers."""
        if self.work is None or self.received is None or self.send is None:
            raise RuntimeError("finish() before start()")
        self.work.wait()
        rnd, buffer = self.round, self.exchange.buffer
        if rnd.received:
            # Each rank's 16-bit copy, divided by W, added in FP32 straight into the owners' FP32 slices
            # (no FP32 temporary): exact for a power-of-two W, where dividing is exact.
            n, lengths = rnd.received, [length for _, _, length in rnd.dest]
            targets = [shard.grads.buffer[start : start + length] for shard, start, length in rnd.dest]
            for r in range(world):
                torch._foreach_add_(targets, list(self.received[r * n : (r + 1) * n].split(lengths)), alpha=1 / world)
        # Free the exchange buffers here and now: the communication thread may still hold them a moment
        # (and would then free them where the profiler does not look). On CUDA this is stream-safe:
        # work.wait() made the current stream (the buffers' allocation stream, whose blocks the caching
        # allocator reuses only for that stream) wait for NCCL's, and NCCL recorded its own use of them.
        for tensor in (self.send, self.received):
            if tensor.data_ptr() != buffer.data_ptr():
                tensor.untyped_storage().resize_(0)
        self.send = self.received = None
        self.exchange.done_rounds += 1


@dataclass(eq=False)
class _Exchange:
    """One bucket handed over for reduce-scattering, and what to do once all its rounds are summed."""

    buffer: torch.Tensor
    done: torch.futures.Future | None  # DDP's bucket future; None: free the buffer when finished
    identity: bool  # the bucket goes out as it is (one round, no packing copy)
    rounds: list[_RoundExchange] = field(default_factory=list)
    done_rounds: int = 0

    def complete(self) -> None:
        """Every round is summed: zero the bucket and complete the future, or free the bucket."""
        self.rounds = []  # each round points back here: without this the bucket would wait for the cycle collector
        if self.done is None:
            self.buffer.untyped_storage().resize_(0)
            return
        self.buffer.zero_()
        self.done.set_result(self.buffer)
