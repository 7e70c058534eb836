"""PowerSGD gradient compression as a DDP comm hook whose error feedback survives skipped steps.

torch's ``powerSGD_hook`` keeps its error feedback in scaled units and
updates it in the hook, before anyone knows whether the step will be
applied. Under FP16 loss scaling one inf on one rank then enters the error
memory, every later gradient is inf, every later step is skipped and the
scale falls forever. :class:`PowerSGD` keeps that state apart from the
step that produced it:

* the error feedback and the warm-start Q are FP32, per rank, in unscaled
  units: the hook divides the (scaled) gradient by the current loss scale
  before adding the error and multiplies the result back, so the rest of
  the pipeline unscales as before and a scale change does not change what
  the state means;
* the hook computes the new state *tentatively*; the optimizer, once the
  ranks agreed on the verdict, calls :meth:`PowerSGD.resolve`: an applied
  step commits it, a skipped (or retried) one discards it, so the state
  after a skipped step is bitwise the state before it.
* several communicating backward passes before one step (accumulation
  without ``no_sync``) compress what one communication of the summed
  gradient would: each later pass adds what the earlier ones' compression
  missed (their residual ``M - P Q^T``) instead of the committed error,
  which the first pass already sent, so the error feedback enters the step
  once; :meth:`PowerSGD.gradients_replaced` drops that residual when the
  gradients were cleared in between.

The optimizer talks to the hook only through the :class:`GradCompressor`
protocol defined here (the dependency goes from the optimizer to
``distamp.distributed``, never back).

Per bucket, gradients of >= 2 dims whose compression rate reaches
``min_compression_rate`` are compressed (Vogels et al., 2019,
https://arxiv.org/abs/1905.13727, Algorithm 1 with error feedback):
``M = grad / scale + error``, ``P = M Q``, all-reduce P (sum),
orthogonalise, ``Q = M^T P``, all-reduce Q (mean), ``approx = P Q^T``,
``error' = M - approx``. P and Q cross the wire in FP32. The other
gradients (biases, norms) are all-reduced in the wire dtype as
:class:`~distamp.distributed.comm_hooks.LowPrecisionAllReduce` does, as is
everything during the first ``start_step`` applied steps.

On CPU the matrix work runs in compiled kernels
(:mod:`distamp.compression.low_rank_kernels`: three passes over each
gradient), when every rank built kernels that give the same bits on a fixed
input; elsewhere, and on GPUs, in torch ops. The ranks agree on one path
when the hook is built.

Why the ranks end every step with the same bits, on either path and
whatever each rank's instruction set: after the all-reduce of P every rank
holds the same P, and after that of Q the same Q. What each rank computes
from them must then be exactly the same function on every host: the
orthogonalised P (from which the ranks' Q contributions and the written
gradient are made) and ``P Q^T`` scaled and rounded into the gradient. The
kernels state their order of operations and are compiled without
contraction; the torch-op path uses
:func:`~distamp.compression.low_rank.orthogonalize_` and
:func:`~distamp.compression.low_rank.fixed_order_product`, built from
elementwise ops only (one IEEE rounding each on any CPU or GPU), never a
torch reduction or matrix product, whose summation order depends on the
vector width, the BLAS and the GPU. The rest (``M = G / scale + E``,
``M Q``, ``P^T M``, the error) is each rank's own and may round as its
hardware does: it only enters the sums. Sharing the orthogonalised P
instead would cost a third collective per bucket and would still leave
``P Q^T``; recomputing it in a fixed order costs one elementwise pass per
rank term. Products are FP32 (a BF16 matrix product runs in software on
CPUs without ``avx512_bf16``).
"""

# No ``from __future__ import annotations``: DDP reads the hook's annotations
# at registration and refuses a string where it expects dist.GradBucket.
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distamp.compression import low_rank_kernels
from distamp.compression.low_rank import (
    effective_rank,
    fixed_order_product,
    is_power_of_two,
    matrix_shape,
    orthogonalize_,
    start_q,
)
from distamp.compression.low_rank_kernels import LowRankKernels
from distamp.core.attached import GradCompressor
from distamp.distributed.comm_hooks import CommStats, Pending, add_fp32_sums
from distamp.distributed.grad_layout import as_indexed, memory_order, relayout
from distamp.model_views import known_name
from distamp.strategy import PowerSGDConfig
from distamp.user_warning import warn_user

__all__ = ["GradCompressor", "PowerSGD", "fit_state_to_world", "powersgd_hook", "refuse_optimizers"]

logger = logging.getLogger("distamp")

STATE_FORMAT = "distamp.PowerSGD/2"
# Before /2 the matrices followed each parameter's memory format (grad_layout): loaded as the code then read them.
_MEMORY_ORDER_FORMAT = "distamp.PowerSGD/1"
# FP32 elements of one row block of the torch-op write-back (128 KiB): its four tiles stay in a core's L2.
_CACHE_BLOCK_ELEMENTS = 32 * 1024
# What the fallback costs, as measured (examples/README.md, "PowerSGD's CPU kernels").
_TORCH_OPS_COST = ("The same algorithm, the ranks still agree bit for bit; the hook takes longer (measured on a "
                   "2048 x 2048 BF16 gradient: 1.8x the kernels' time at rank 1, 3.2x at rank 4).")


def fit_state_to_world(state: dict, world_size: int, rank: int) -> dict:
    """:meth:`PowerSGD.state_dict`'s ``state`` as rank ``rank`` of a job of ``world_size`` ranks may use it.

    Saved by this rank at this world size it is returned as it is. At
    another world size, the error feedback (one rank's residual of a sum
    over the saving ranks, with no counterpart now) is dropped, rank 0
    warning once. Saved by another rank at this world size (every rank
    loading rank 0's ``optimizer.state_dict()``, as with torch's DDP), the
    error feedback is that rank's residual, not this one's: it is dropped,
    this rank warning. Either way the state is labelled with ``world_size``
    and ``rank``; Q and the step count, the same on every rank, are kept.
    The optimizer calls it too when it holds the state for a compressor not
    built yet, so the warning comes at load either way.

    Raises:
        ValueError: not a PowerSGD state.
    """
    if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, _MEMORY_ORDER_FORMAT):
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a distamp PowerSGD state (found {found!r}); expected format {STATE_FORMAT!r} "
                         f"(or {_MEMORY_ORDER_FORMAT!r})")
    saved_world, saved_rank = int(state["world_size"]), int(state["rank"])
    if saved_world == world_size and saved_rank == rank:
        return state
    if saved_world != world_size and rank == 0 and state["error"]:
        warn_user(
            f"PowerSGD error feedback dropped: the checkpoint was saved by {saved_world} rank(s) and is "
            f"resumed by {world_size}; each rank's error is its residual of a sum over the saving "
            "ranks and has no counterpart now, so it restarts from zero (Q and the step count are kept)"
        )
    elif saved_world == world_size and state["error"]:
        warn_user(
            f"PowerSGD error feedback dropped on rank {rank}: it loaded the state saved by rank {saved_rank}, "
            "whose error feedback is that rank's own residual, so this rank's restarts from zero (Q and the "
            "step count are kept). To resume it, save and load each rank's optimizer.state_dict() "
            "(fleet's checkpoints do)"
        )
    return {**state, "world_size": world_size, "rank": rank, "error": {}}


def refuse_optimizers(count: int) -> None:
    """Raise unless ``count`` (the optimizers a compressed model would have) is at most one.

    ``fleet.distributed_model`` calls it as each optimizer is attached,
    before any collective.

    Raises:
        RuntimeError: more than one optimizer: the state is committed on one
            verdict per step, so one optimizer must own the model.
    """
    if count > 1:
        raise RuntimeError(
            "strategy.powersgd needs exactly one fleet.distributed_optimizer per model: its error feedback "
            f"is kept or dropped on that optimizer's step verdict, and {count} optimizers were attached. "
            "Put every parameter in one optimizer (param groups), or turn powersgd off"
        )


@dataclass
class _Matrix:
    """One compressed gradient of a bucket while the hook works on it."""

    name: str
    grad: torch.Tensor  # the gradient in the bucket, indexed as the parameter (strided where the parameter is)
    m: torch.Tensor  # FP32, unscaled, error added; becomes the new error
    p: torch.Tensor  # rows x rank
    qt: torch.Tensor  # Q transposed: rank x cols


class PowerSGD:
    """DDP comm-hook state: PowerSGD compression with verdict-gated error feedback and warm start.

    Built by ``fleet.distributed_model`` when ``strategy.powersgd`` is set;
    the optimizer of ``fleet.distributed_optimizer`` binds itself to it::

        strategy.powersgd = True
        strategy.powersgd_configs = {"rank": 4, "start_step": 100}
        optimizer = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
        model = fleet.distributed_model(model)
        ...
        optimizer.stats()["bytes_sent"], optimizer.stats()["compression_rate"]

    Args:
        config: the PowerSGD settings.
        params: the model's parameters by qualified name (the keys of the saved state).
        wire_dtype: dtype of the uncompressed gradients on the wire; ``None`` (AMP off): FP32, and
            float64 gradients in float64, so that nothing is rounded (as DDP's all-reduce sends them).
        predivide_factor: as in :class:`~distamp.distributed.comm_hooks.LowPrecisionAllReduce`.
        process_group: the data-parallel group; ``None`` is the world.
        pending: gradient merge's FP32 sums to add to a bucket first (O2), or None.
        device: where the gradients (and so the state) live.

    Cost: per compressed gradient an FP32 copy (the error) plus its tentative
    successor (and an FP32 work matrix for FP16 gradients, and for every
    gradient on torch ops, plus one more of the largest size there at rank > 1), and two
    extra small all-reduces per bucket, issued from the backward thread in the
    same order on every rank. Building it on CPU is collective (the ranks agree
    on the CPU kernels); the first build of the kernels on a host takes about
    a second.
    """

    def __init__(
        self,
        config: PowerSGDConfig,
        params: Mapping[str, torch.Tensor],
        wire_dtype: torch.dtype | None,
        predivide_factor: float | None = None,
        process_group: dist.ProcessGroup | None = None,
        pending: Pending | None = None,
        device: torch.device | None = None,
    ) -> None:
        if wire_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"wire_dtype={wire_dtype!r} is not supported; use torch.float16, torch.bfloat16 "
                            "or torch.float32, or None for FP32 with float64 kept")
        self.config = config
        self.params = dict(params)
        self.names = {id(p): name for name, p in self.params.items()}
        self.wire_dtype = wire_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        factor = float(self.world_size if predivide_factor is None else predivide_factor)
        if not 1.0 <= factor <= self.world_size:
            raise ValueError(f"gradient_predivide_factor={predivide_factor!r} must be between 1 and the world "
                             f"size {self.world_size}")
        self.predivide_factor, self.postdivide_factor = factor, self.world_size / factor
        self.pending = pending
        self.device = device if device is not None else torch.device("cpu")
        self.stats = CommStats()
        self.applied_steps = 0
        self.error: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self._tentative: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        # What this step's earlier communications missed (M - P Q^T, FP32, unscaled), per gradient: a later
        # backward pass before the step re-sends the gradient they wrote, so it adds this, not the error.
        self._residual: dict[str, torch.Tensor] = {}
        # Work buffers kept between steps: M (which becomes the next error) and P Q^T.
        self._spare: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}
        self._term = torch.empty(0)  # torch ops at rank > 1: one term of P Q^T, shared by all gradients
        self._loss_scale: Callable[[], float] = lambda: 1.0
        self._bound = False
        self._sent = self._dense_equivalent = 0
        self._report: tuple[int | None, float | None] = (None, None)
        self.kernels = _agreed_kernels(self.device, process_group, self.rank)

    # -- wiring -------------------------------------------------------------------

    def register(self, ddp: "torch.nn.parallel.DistributedDataParallel") -> None:
        """Install this hook on ``ddp`` (once, before its first backward)."""
        ddp.register_comm_hook(self, powersgd_hook)

    def bind(self, loss_scale: Callable[[], float]) -> None:
        """Called once by the optimizer that decides the steps.

        Raises:
            RuntimeError: a second optimizer tries to bind: the state is
                committed on one verdict per step, so one optimizer must own the model.
        """
        refuse_optimizers(2 if self._bound else 1)
        self._bound = True
        self._loss_scale = loss_scale

    @property
    def compressing(self) -> bool:
        """True once ``start_step`` steps were applied (before: plain all-reduce in the wire dtype)."""
        return self.applied_steps >= self.config.start_step

    # -- the verdict -------------------------------------------------------------

    def discard_attempt(self) -> None:
        """Drop what this step's communications computed; the step goes on (``overflow_retries``).

        The bytes already sent stay in the step's count: the retried
        attempt's communication crossed the wire too.
        """
        self._tentative, self._residual = {}, {}

    def resolve(self, applied: bool) -> None:
        """Commit the state the last communication computed (``applied``) or drop it; end the step's count."""
        tentative = self._tentative
        self.discard_attempt()
        if applied:
            for name, (error, q) in tentative.items():
                if error is not None:
                    # The buffer the hook wrote becomes the error; the old error is the next step's buffer.
                    old = self.error.get(name)
                    self.error[name] = error
                    if old is not None:
                        self._spare[name] = old
                if q is not None:
                    self.q[name] = q
            self.applied_steps += 1
        if self._dense_equivalent:
            self._report = (self._sent, self._dense_equivalent / self._sent if self._sent else None)
        self._sent = self._dense_equivalent = 0

    def gradients_replaced(self) -> None:
        """The gradients were cleared or replaced since this step's last communication.

        The next backward pass then holds none of what the earlier ones
        wrote, so it adds the committed error again, not their residual.
        """
        self._residual = {}

    def step_report(self) -> tuple[int | None, float | None]:
        """``(bytes sent, compression rate)`` of the last resolved step; (None, None) before any.

        Bytes are this rank's payload (uncompressed gradients in the wire
        dtype plus P and Q in FP32); the rate is what an all-reduce of every
        gradient in the wire dtype would have sent, divided by that.
        """
        return self._report

    # -- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's committed state: applied steps, and per parameter name the error feedback and Q^T (FP32).

        ``q`` holds Q transposed (``rank x n``), the layout the hook computes it in.
        Both index the parameter as "first dim x the rest" whatever its
        memory format, so a run may resume under another one.
        """
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "applied_steps": self.applied_steps,
            "error": {name: t.detach().cpu().clone() for name, t in self.error.items()},
            "q": {name: t.detach().cpu().clone() for name, t in self.q.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; at another world size the error feedback is dropped.

        The error feedback is one rank's residual of a sum over that many
        ranks: it has no counterpart once the ranks change, so it restarts
        from zero (rank 0 warns once), as it does on a rank that loads
        another rank's state (that rank warns). The warm-start Q and the
        step count are the same on every rank and are kept. A state of the
        format before (``distamp.PowerSGD/1``, whose matrices followed each
        parameter's memory format) is taken to be in the current format, as
        that code took it, and moved to "first dim x the rest" (a Q whose
        rows were not the first dim restarts).

        Raises:
            ValueError: not a PowerSGD state.
        """
        state = fit_state_to_world(state, self.world_size, self.rank)
        device = self.device
        self.applied_steps = int(state["applied_steps"])
        # known_name: a state saved when a compiled model's names carried torch.compile's "_orig_mod." fits too.
        self.q = {known_name(name, self.params): t.to(device, torch.float32) for name, t in state["q"].items()}
        self.error = {known_name(name, self.params): t.to(device, torch.float32).clone()
                      for name, t in state["error"].items()}
        if state["format"] == _MEMORY_ORDER_FORMAT:
            for name, param in self.params.items():
                self._out_of_memory_order(name, param)
        self._tentative, self._spare, self._residual = {}, {}, {}

    def _out_of_memory_order(self, name: str, param: torch.Tensor) -> None:
        """Move ``name``'s loaded error and Q from ``param``'s memory order to "first dim x the rest"."""
        saved, logical = memory_order(param), tuple(range(param.dim()))
        if saved == logical:
            return
        error = self.error.get(name)
        if error is not None and error.numel() == param.numel():
            self.error[name] = relayout(error.reshape(-1), param.shape, saved, logical).view(error.shape)
        qt = self.q.get(name)
        if qt is not None:
            if saved[0] == 0 and qt.shape[-1] * param.shape[0] == param.numel():
                # Rows were the first dim (channels_last): Q's columns are the rest of the parameter, permuted.
                self.q[name] = relayout(qt, param.shape[1:], [d - 1 for d in saved[1:]], logical[:-1])
            else:
                del self.q[name]  # the rows were other elements: no Q of these to start from

    # -- the hook's work -------------------------------------------------------------

    def wire_for(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``dtype`` gradients crosses the wire in."""
        if self.wire_dtype is not None:
            return self.wire_dtype
        return torch.float64 if dtype == torch.float64 else torch.float32

    def split(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> tuple[list, list]:
        """``(compressed [(name, grad, rows, cols)], dense grads)`` of a bucket at this step."""
        compressed, dense = [], []
        for grad, param in zip(grads, params, strict=True):
            shape = matrix_shape(grad.shape)
            # The factors are FP32 (and the C kernels read FP32 or BF16): a float64 gradient is sent
            # whole rather than rounded. (A complex one arrives as DDP's real view, FP32, and is factored.)
            if (self.compressing and shape is not None and grad.dtype in _FACTORED_DTYPES
                    and self.config.compresses(*shape)):
                compressed.append((self.names[id(param)], as_indexed(grad, param), *shape))
            else:
                dense.append(grad)
        return compressed, dense

    def merge_pending(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                      factored: set[str]) -> dict[str, torch.Tensor]:
        """Divide the bucket's dense gradients by the pre-division factor, with gradient merge's FP32 sums added.

        Returns the merged FP32 sums of the ``factored`` gradients by name:
        the matrices are built from them, so a window's sum is never rounded
        to 16 bits before it is compressed. A dense gradient's sum is divided
        in FP32 and rounded once (one beyond the 16-bit range whose quotient
        fits stays finite), as the 16-bit hook does.
        """
        sums = self.pending(params) if self.pending is not None else None
        if sums is None and not factored:
            buffer.div_(self.predivide_factor)
            return {}
        merged, dense, dense_sums = {}, [], []
        for grad, param, total in zip(grads, params, sums or [None] * len(params), strict=True):
            name = self.names[id(param)]
            if name not in factored:
                dense.append(as_indexed(grad, param))
                dense_sums.append(total)
            elif total is not None:
                merged[name] = total.add_(as_indexed(grad, param))
        add_fp32_sums(dense, dense_sums, self.predivide_factor)
        return merged

    def count(self, nbytes: int, dense_equivalent: int) -> None:
        """Record ``nbytes`` sent (for the payload of ``dense_equivalent`` bytes in the wire dtype)."""
        self.stats.calls += 1
        self.stats.bytes += nbytes
        self._sent += nbytes
        self._dense_equivalent += dense_equivalent

    def compress(self, compressed: list, scale: float, merged: Mapping[str, torch.Tensor] | None = None) -> None:
        """All-reduce the low-rank factors of ``compressed`` and write the mean approximation back (scaled).

        ``merged``: by name, gradient merge's FP32 sum of the window (this
        micro-batch's gradient included), read instead of the 16-bit gradient.

        Collective and synchronous: the two all-reduces are issued from the
        backward thread, so every rank issues them in the same order as the
        buckets' other collectives (torch's hook issues them from future
        callbacks, which on gloo hangs once a model has two buckets).
        """
        if not compressed:
            return
        cfg = self.config
        merged = merged or {}
        matrices = [self._start(name, grad, rows, cols, scale, merged.get(name))
                    for name, grad, rows, cols in compressed]
        p_total = sum(x.p.numel() for x in matrices)
        q_total = sum(x.qt.numel() for x in matrices)
        self.count(4 * (p_total + q_total),
                   sum(x.grad.numel() * _size(self.wire_for(x.grad.dtype)) for x in matrices))
        # P is orthogonalised next, so its sum need not be divided by the world size.
        _all_reduce_each([x.p for x in matrices], self.process_group)
        for x in matrices:
            if self.kernels is None:
                orthogonalize_(x.p)
                x.qt = torch.matmul(x.p.t(), x.m)
            else:
                self.kernels.orthogonalize_columns_(x.p)
                x.qt = torch.empty_like(x.qt)
                self.kernels.project(x.m, x.p, x.qt)
        _all_reduce_each([x.qt for x in matrices], self.process_group)
        for x in matrices:
            x.qt.div_(self.world_size)
            # The residual M - P Q^T is kept even without error feedback: a later pass of this step needs it.
            if self.kernels is not None:
                residual = self._write_fused(self.kernels, x, scale)
            else:
                residual = self._write_exact(x, scale)
            self._residual[x.name] = residual
            self._tentative[x.name] = (residual if cfg.error_feedback else None,
                                       x.qt.clone() if cfg.warm_start else None)

    def _start(self, name: str, grad: torch.Tensor, rows: int, cols: int, scale: float,
               source: torch.Tensor | None = None) -> _Matrix:
        """``M = grad / scale + error`` (FP32) and this rank's ``P = M Q`` for one gradient.

        ``source``: what to read instead of ``grad`` (gradient merge's FP32 sum, indexed as ``grad``).
        """
        read = grad if source is None else source
        cfg = self.config
        # M lives in a buffer kept between steps (a fresh 4 bytes per element each step costs more in page
        # faults on CPU than the whole low-rank product).
        residual = self._residual.get(name)
        m = self._buffer(self._spare, name, rows, cols, grad.device, avoid=(self.error.get(name), residual))
        # A later pass of this step: the gradient holds what the earlier ones wrote, which carried the error.
        error = residual if residual is not None else self.error.get(name) if cfg.error_feedback else None
        qt_old = self._start_qt(name, rows, cols, grad.device)
        if self.kernels is not None:
            p = torch.empty(rows, qt_old.shape[0], dtype=torch.float32, device=grad.device)
            if read.dtype == torch.float16 or not read.is_contiguous():
                matrix = m.view(grad.shape).copy_(read).view(rows, cols)
            else:
                matrix = read.view(rows, cols)
            self.kernels.start(matrix, error, m, qt_old, p, scale)
            return _Matrix(name, grad, m, p, qt_old)
        # The widening copy and an FP32 add are faster on CPU than one add of mixed dtypes.
        m.view(grad.shape).copy_(read)
        if error is not None and is_power_of_two(scale):
            # Multiplying by 1/scale is exact for a power of two: the same bits as m / scale + error.
            torch.add(error, m, alpha=1.0 / scale, out=m)
        else:
            if scale != 1.0:
                m.div_(scale)
            if error is not None:
                m.add_(error)
        # The products read tensors of their own, never views at a packing offset: BLAS kernels may round
        # differently at other alignments, and the packing follows DDP's buckets, which are rebuilt after a
        # job's first iteration (a resumed run would then drift).
        return _Matrix(name, grad, m, torch.matmul(m, qt_old.t().contiguous()), qt_old)

    def _start_qt(self, name: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """This step's Q^T (``rank x cols``, contiguous): the last applied step's, orthogonalised, or a fresh one."""
        r = effective_rank(rows, cols, self.config.rank)
        # Q is kept transposed (rank x cols): Q^T = P^T M is a fast product, M^T P a slow one.
        qt = self.q.get(name) if self.config.warm_start else None
        if qt is None or qt.shape != (r, cols):
            return start_q(name, cols, r, self.applied_steps, device).t().contiguous()
        if self.kernels is not None:
            return self.kernels.orthogonalize_rows_(qt.clone())
        # A copy whatever the shape: for a 1 x n Q^T, .t().contiguous() is Q^T's own storage, and the
        # committed Q would be orthogonalised in place (a skipped step would then change the state).
        return orthogonalize_(qt.t().clone(memory_format=torch.contiguous_format)).t().contiguous()

    def _write_fused(self, kernels: LowRankKernels, x: _Matrix, scale: float) -> torch.Tensor:
        """:meth:`_write_exact` in one pass with the CPU kernels (FP16 and strided gradients through an FP32 buffer)."""
        rows, cols = x.m.shape
        if x.grad.dtype == torch.float16 or not x.grad.is_contiguous():
            approx = self._buffer(self._scratch, x.name, rows, cols, x.m.device)
            kernels.finish(approx, x.m, x.p, x.qt, scale)
            x.grad.copy_(approx.view(x.grad.shape))
        else:
            kernels.finish(x.grad.view(rows, cols), x.m, x.p, x.qt, scale)
        return x.m

    def _write_exact(self, x: _Matrix, scale: float) -> torch.Tensor:
        """Write ``scale * P Q^T`` into the gradient (any dtype); return ``M - P Q^T`` (in ``x.m``).

        ``P Q^T`` is :func:`~distamp.compression.low_rank.fixed_order_product`,
        so every rank writes the same bits (module docstring); the scaling
        and the rounding to the gradient's dtype are elementwise.
        """
        rows, cols = x.m.shape
        approx = self._buffer(self._scratch, x.name, rows, cols, x.m.device)
        grad = x.grad.view(rows, cols) if x.grad.is_contiguous() else x.grad  # strided: indexed as the parameter
        # Row blocks small enough to stay in cache while the 2 rank - 1 passes of the product, the error
        # update, the scaling and the write-back run over them: each element gets the same operations in
        # the same order as over the whole matrix (the same bits), for about one pass of memory traffic.
        block = rows if x.m.device.type != "cpu" else max(1, _CACHE_BLOCK_ELEMENTS // cols)
        work = None
        if x.p.shape[1] > 1:
            size = min(block, rows) * cols
            if self._term.numel() < size or self._term.device != x.m.device:
                self._term = torch.empty(size, dtype=torch.float32, device=x.m.device)
        for start in range(0, rows, block):
            stop = min(start + block, rows)
            tile = approx[start:stop]
            if x.p.shape[1] > 1:
                work = self._term[: (stop - start) * cols].view(stop - start, cols)
            fixed_order_product(x.p[start:stop], x.qt, out=tile, work=work)
            x.m[start:stop].sub_(tile)
            if scale != 1.0:
                tile.mul_(scale)
            grad[start:stop].copy_(tile.view((stop - start, *grad.shape[1:])))
        return x.m

    @staticmethod
    def _buffer(store: dict[str, torch.Tensor], name: str, rows: int, cols: int, device: torch.device,
                avoid: tuple[torch.Tensor | None, ...] = ()) -> torch.Tensor:
        """An FP32 ``rows x cols`` work buffer kept in ``store``, never one of ``avoid`` (kept error, residual)."""
        buffer = store.get(name)
        if (buffer is None or any(buffer is t for t in avoid) or buffer.shape != (rows, cols)
                or buffer.device != device):
            buffer = torch.empty(rows, cols, dtype=torch.float32, device=device)
            store[name] = buffer
        return buffer


def _agreed_kernels(device: torch.device, group: dist.ProcessGroup | None, rank: int) -> LowRankKernels | None:
    """The CPU kernels if every rank of ``group`` has kernels with the same fingerprint, else None (collective on CPU).

    The ranks must agree: the kernels and torch ops round the products
    differently, and so do two builds of the kernels by compilers with other
    floating-point defaults; each rank writes its own copy of the mean
    gradient. One all-gather of each rank's fingerprint (-1: no kernels).
    """
    if device.type != "cpu":
        return None
    found = low_rank_kernels.load()
    mine = found.fingerprint if isinstance(found, LowRankKernels) else -1
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64), group=group)
    prints = [int(t.item()) for t in gathered]
    if isinstance(found, LowRankKernels):
        if -1 in prints:
            logger.info("PowerSGD uses torch ops: rank(s) %s have no CPU kernels",
                        [r for r, f in enumerate(prints) if f == -1])
        elif len(set(prints)) > 1:
            by_rank = ", ".join(f"rank {r}: {f:015x}" for r, f in enumerate(prints))
            warn_user(f"PowerSGD's CPU kernels compute other bits on other ranks (fingerprints of their output on "
                      f"a fixed input: {by_rank}; this rank's build is {found.path}): a compiler that defaults to "
                      "-ffast-math or -ffp-contract=fast, or another compiler or version, would do that. Every "
                      f"rank uses torch ops instead. {_TORCH_OPS_COST} Build with the same compiler everywhere "
                      f"(CC), or set {low_rank_kernels.KERNELS_ENV}=torch to choose torch ops without this warning")
        else:
            logger.info("PowerSGD uses the CPU kernels in %s", found.path)
            return found
    elif found != f"{low_rank_kernels.KERNELS_ENV}=torch":
        warn_user(f"PowerSGD's CPU kernels are not available on rank {rank} ({found}); every rank uses torch "
                  f"ops instead. {_TORCH_OPS_COST} Set {low_rank_kernels.KERNELS_ENV}=torch to choose that "
                  "without this warning")
    return None


def _all_reduce_each(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum each tensor over the group with one all-reduce of their concatenation (synchronous)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view_as(t))
        at += t.numel()


_FACTORED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook body for :class:`PowerSGD` (``state`` is the instance)."""
    buffer = bucket.buffer()
    params = bucket.parameters()
    grads = bucket.gradients()
    compressed, dense = state.split(grads, params)
    merged = state.merge_pending(buffer, grads, params, {entry[0] for entry in compressed})
    # The dense part goes first, asynchronously; the factors' all-reduces follow in the same order on every rank.
    if len(dense) == len(params):
        flat = buffer
    elif dense:
        flat = torch.cat([g.reshape(-1) for g in dense])
    else:
        flat = None
    future = None
    if flat is not None:
        wire = flat
        if wire.dtype != state.wire_for(wire.dtype):
            wire = wire.to(state.wire_for(wire.dtype))
        state.count(wire.numel() * wire.element_size(), wire.numel() * wire.element_size())
        future = dist.all_reduce(wire, group=state.process_group, async_op=True).get_future()
    state.compress(compressed, state._loss_scale(), merged)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.postdivide_factor != 1.0:
            reduced.div_(state.postdivide_factor)
        if flat is buffer:
            if reduced is not buffer:
                buffer.copy_(reduced)
            return buffer
        at = 0
        for g in dense:
            g.copy_(reduced[at : at + g.numel()].view_as(g))
            at += g.numel()
        return buffer

    if future is None:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    return future.then(finish)
